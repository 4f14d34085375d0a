"""Prompt text a client can send but no model can take: far too long for the context (refused
without tokenizing it, and never blocking the event loop while tokenized), or not valid
Unicode (a lone UTF-16 surrogate in the JSON). Real server, real engines (scripted models)."""
from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.serving.harness import API_KEY, SMALL_BODY_LIMIT
from tests.serving.scripted_model import TEXT_MODEL

MODEL = TEXT_MODEL
HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01", "content-type": "application/json"}
# Route → (request body around a prompt text, API shape of its errors, field its prompt is in).
ROUTES: dict[str, tuple[Any, str, str]] = {
    "/v1/messages": (lambda text: {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": text}]},
                     "anthropic", "messages"),
    "/v1/messages/count_tokens": (lambda text: {"model": MODEL, "messages": [{"role": "user", "content": text}]},
                                  "anthropic", "messages"),
    "/v1/chat/completions": (lambda text: {"model": MODEL, "max_tokens": 5,
                                           "messages": [{"role": "user", "content": text}]}, "openai", "messages"),
    "/v1/completions": (lambda text: {"model": MODEL, "max_tokens": 5, "prompt": text}, "openai", "prompt"),
}
# What each route asks its engine to tokenize with.
TOKENIZING_METHOD = {"/v1/messages": "encode_chat_text", "/v1/messages/count_tokens": "encode_chat_text",
                     "/v1/chat/completions": "encode_chat_text", "/v1/completions": "encode"}


@pytest.fixture
def engine(scripted_engines):
    return scripted_engines[MODEL]


def post(url: str, path: str, body: Any) -> httpx.Response:
    """POST a body serialised by hand (json.dumps escapes lone surrogates; httpx would refuse them)."""
    return httpx.post(url + path, content=json.dumps(body).encode(), headers=HEADERS, timeout=60)


def error_of(r: httpx.Response, style: str) -> dict[str, Any]:
    """The error object, checked to be in the route's API shape."""
    data = r.json()
    if style == "anthropic":
        assert data["type"] == "error" and set(data["error"]) == {"type", "message"}
    else:
        assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["type"] == "invalid_request_error"
    return data["error"]


# ---- far too long --------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/completions"])
def test_a_certainly_too_long_prompt_is_refused_without_tokenizing(scripted_server, engine, monkeypatch, path):
    make_body, style, field = ROUTES[path]
    tokenized: list[str] = []

    def tokenize(*args: Any, **kwargs: Any) -> Any:
        tokenized.append(path)
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(engine, TOKENIZING_METHOD[path], tokenize)
    text = "word " * (SMALL_BODY_LIMIT // 6)  # ~218 KB: at least 13k tokens, for a 512-token context
    r = post(scripted_server.url, path, make_body(text))
    assert r.status_code == 400
    error = error_of(r, style)
    n = engine.max_model_len
    at_least = re.search(r"at least (\d+) tokens", error["message"])
    assert at_least and int(at_least.group(1)) > n
    if style == "anthropic":
        assert error["message"] == f"prompt is too long: at least {at_least.group(1)} tokens > {n} maximum"
    else:
        assert error["message"] == (f"This model's maximum context length is {n} tokens. However, your {field} "
                                    f"resulted in at least {at_least.group(1)} tokens. Please reduce the length "
                                    f"of the {field}.")
        assert error["code"] == "context_length_exceeded" and error["param"] == field
    assert tokenized == []


def test_count_tokens_counts_a_prompt_longer_than_the_context(scripted_server, engine):
    """The count is the answer there, so a long prompt is counted rather than refused."""
    make_body, _, _ = ROUTES["/v1/messages/count_tokens"]
    r = post(scripted_server.url, "/v1/messages/count_tokens", make_body("word " * 1_500))
    assert r.status_code == 200 and r.json()["input_tokens"] > 1_500 > engine.max_model_len


def test_count_tokens_counts_up_to_a_multiple_of_the_context_and_refuses_past_it(scripted_server, engine,
                                                                                 monkeypatch):
    """Tokenizing keeps ~160 bytes per token: a 25 MB prompt's count peaked at 4.9 GB. Counts stop
    at COUNT_CHARS_PER_CONTEXT_TOKEN characters of rendered prompt per context token; below that
    they are the tokenizer's own, exactly."""
    from tierlm.serving.generation import COUNT_CHARS_PER_CONTEXT_TOKEN

    limit = COUNT_CHARS_PER_CONTEXT_TOKEN * engine.max_model_len
    make_body, _, _ = ROUTES["/v1/messages/count_tokens"]
    overhead = len(engine.chat_text([{"role": "user", "content": "x"}])) - 1
    for text in ["hi", "Hello, world! How are you?", "word " * 300 + "end", "naïve café 日本語 " * 40,
                 "x" * (limit - overhead)]:
        rendered = engine.chat_text([{"role": "user", "content": text}])
        r = post(scripted_server.url, "/v1/messages/count_tokens", make_body(text))
        assert r.status_code == 200, r.text
        assert r.json()["input_tokens"] == len(engine.tokenizer.encode(rendered, add_special_tokens=False))

    def tokenize(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(engine, "encode_chat_text", tokenize)
    r = post(scripted_server.url, "/v1/messages/count_tokens", make_body("x" * (limit - overhead + 1)))
    assert r.status_code == 400
    message = error_of(r, "anthropic")["message"]
    assert message.startswith(f"messages: this prompt renders to {limit + 1} characters; tierlm counts prompts "
                              f"of up to {limit} ({COUNT_CHARS_PER_CONTEXT_TOKEN} per token of model '{MODEL}'s "
                              f"{engine.max_model_len}-token context)")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_more_messages_than_the_context_holds_are_refused_before_the_template_runs(scripted_server, engine,
                                                                                   monkeypatch, path):
    """Each message renders to a token at least; 200,000 one-letter messages (7 MB) ran the
    template for 8 s before the length check, slowing every other request 10x."""
    make_body, style, _ = ROUTES[path]

    def render(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the template ran")

    monkeypatch.setattr(engine, "chat_text", render)
    n = engine.max_model_len
    body = make_body("x")
    body["messages"] = [{"role": ("user", "assistant")[i % 2], "content": "x"} for i in range(n + 1)]
    r = post(scripted_server.url, path, body)
    assert r.status_code == 400 and f"at least {n + 1} tokens" in error_of(r, style)["message"]


def test_counting_tokens_does_not_hold_up_other_requests_prompts(scripted_server, engine, monkeypatch):
    """count_tokens renders and tokenizes a prompt of any length. In the pool every request's
    prompt is rendered in (6 threads here), six 5 MB counts held a short request up for 50 s;
    they now wait for each other, in a worker of their own."""
    original, release, blocked = engine.encode_chat_text, threading.Event(), threading.Event()

    def tokenize(text: str) -> Any:
        if "COUNT-ME" in text:
            blocked.set()
            release.wait(timeout=60)
        return original(text)

    monkeypatch.setattr(engine, "encode_chat_text", tokenize)
    count_body = {"model": MODEL, "messages": [{"role": "user", "content": "COUNT-ME " * 50}]}
    n = min(32, (os.cpu_count() or 1) + 4) + 2  # more than asyncio's default pool has threads
    with ThreadPoolExecutor(n) as pool:
        counts = [pool.submit(post, scripted_server.url, "/v1/messages/count_tokens", count_body) for _ in range(n)]
        try:
            assert blocked.wait(timeout=30)
            time.sleep(0.5)  # for the other counts to reach the server (in the shared pool: every thread of it)
            short = post(scripted_server.url, "/v1/messages", ROUTES["/v1/messages"][0]("hello"))
            assert short.status_code == 200 and not any(c.done() for c in counts)
        finally:
            release.set()
        answers = {c.result(timeout=60).json()["input_tokens"] for c in counts}
    assert len(answers) == 1 and answers.pop() > 50


@pytest.mark.parametrize("path", list(ROUTES))
def test_the_server_answers_while_a_prompt_is_tokenized(scripted_server, engine, monkeypatch, path):
    """Tokenizing holds until /health has answered: on the event loop it would hold /health too."""
    make_body, _, _ = ROUTES[path]
    original = getattr(engine, TOKENIZING_METHOD[path])
    started, health_answered = threading.Event(), threading.Event()
    order: list[str] = []

    def slow_tokenize(*args: Any, **kwargs: Any) -> Any:
        started.set()
        order.append("tokenized" if health_answered.wait(timeout=5) else "tokenized, /health still waiting")
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, TOKENIZING_METHOD[path], slow_tokenize)
    text = "word " * 1200  # 6 KB: below the early refusal's bound, yet 2400 tokens, past the 512-token context
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(post, scripted_server.url, path, make_body(text))
        assert started.wait(timeout=30)
        health = httpx.get(scripted_server.url + "/health", timeout=60)
        order.append("/health answered")
        health_answered.set()
        response = big.result(timeout=60)
    assert health.status_code == 200
    assert order == ["/health answered", "tokenized"]
    if path == "/v1/messages/count_tokens":
        assert response.status_code == 200 and response.json()["input_tokens"] > engine.max_model_len
    else:
        assert response.status_code == 400  # counted, then refused
        assert "prompt is too long: " in response.text or "context_length_exceeded" in response.text


def test_a_large_body_is_parsed_off_the_event_loop(scripted_server, monkeypatch):
    from tierlm.serving import validation

    parse = validation.parse_json_object
    started, health_answered = threading.Event(), threading.Event()
    order: list[str] = []

    def slow_parse(body: bytes) -> dict[str, Any]:
        started.set()
        order.append("parsed" if health_answered.wait(timeout=5) else "parsed, /health still waiting")
        return parse(body)

    monkeypatch.setattr(validation, "PARSE_OFF_LOOP_BYTES", 64 * 1024)  # the test server takes 256 KB at most
    monkeypatch.setattr(validation, "parse_json_object", slow_parse)
    make_body, _, _ = ROUTES["/v1/messages"]
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(post, scripted_server.url, "/v1/messages", make_body("word " * 20_000))
        assert started.wait(timeout=30)
        health = httpx.get(scripted_server.url + "/health", timeout=60)
        order.append("/health answered")
        health_answered.set()
        response = big.result(timeout=60)
    assert health.status_code == 200 and response.status_code == 400
    assert order == ["/health answered", "parsed"]


# ---- not valid Unicode ---------------------------------------------------------------------


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_lone_surrogate_in_the_prompt_is_a_clear_400(scripted_server, path):
    make_body, style, field = ROUTES[path]
    r = post(scripted_server.url, path, make_body("hi \ud800 there"))
    assert r.status_code == 400
    error = error_of(r, style)
    where = "prompt" if field == "prompt" else "messages.0.content"
    assert error["message"] == (f"invalid JSON body: the string at {where} holds a lone UTF-16 surrogate "
                                "(\\ud800); send valid Unicode text")
    assert "TextEncodeInput" not in r.text


@pytest.mark.parametrize("path, extra", [
    ("/v1/messages", {"stop_sequences": ["ok", "\udfff"]}),
    ("/v1/messages/count_tokens", {"system": "\udc80"}),
    ("/v1/chat/completions", {"stop": "\ud83d"}),
    ("/v1/completions", {"user": "x", "\ud800key": 1}),
])
def test_a_lone_surrogate_anywhere_in_the_body_is_a_clear_400(scripted_server, path, extra):
    make_body, style, _ = ROUTES[path]
    r = post(scripted_server.url, path, {**make_body("hi"), **extra})
    assert r.status_code == 400
    assert "lone UTF-16 surrogate" in error_of(r, style)["message"]


def test_a_surrogate_pair_is_ordinary_text(scripted_server):
    make_body, _, _ = ROUTES["/v1/completions"]
    r = post(scripted_server.url, "/v1/completions", make_body("Hi \ud83d\ude00"))  # sent as the escaped pair of 😀
    assert r.status_code == 200


def test_a_tokenizer_failure_on_a_completion_prompt_is_a_400(scripted_server, engine, monkeypatch):
    def refuse(text: str) -> list[int]:
        raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")

    monkeypatch.setattr(engine, "encode", refuse)
    r = post(scripted_server.url, "/v1/completions", ROUTES["/v1/completions"][0]("Hello"))
    assert r.status_code == 400
    error = error_of(r, "openai")
    assert error["param"] == "prompt" and error["message"].startswith("prompt: the tokenizer of model ")
    assert "TextEncodeInput" not in error["message"]


# ---- Python's own limits, in the client's words ----------------------------------------------


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_a_number_with_too_many_digits_is_refused_in_plain_words(scripted_server, path):
    """Python refuses to read an integer of over 4300 digits, in words for Python programmers
    ("use sys.set_int_max_str_digits()"); that text reached clients."""
    make_body, style, _ = ROUTES[path]
    raw = json.dumps(make_body("hi")).replace('"max_tokens": 5', '"max_tokens": 1' + "0" * 5000)
    r = httpx.post(scripted_server.url + path, content=raw.encode(), headers=HEADERS, timeout=60)
    assert r.status_code == 400
    message = error_of(r, style)["message"]
    assert "number with too many digits (limit 4300)" in message and "sys." not in message


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_a_tool_schema_nested_too_deeply_is_refused_in_plain_words(scripted_server, path):
    """A tool's schema nested 900 deep made the chat template hit Python's recursion limit, whose
    message ("maximum recursion depth exceeded") was the client's answer."""
    from tierlm.engine.tokenizer import MAX_TEMPLATE_DEPTH
    from tests.serving.scripted_model import TOOLS_MODEL

    def nested(depth: int) -> dict:
        schema: dict = {"type": "object"}
        for _ in range(depth):
            schema = {"type": "object", "properties": {"a": schema}}
        return schema

    def body(depth: int) -> dict:
        schema = nested(depth)
        if path == "/v1/messages":
            return {"model": TOOLS_MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"name": "f", "input_schema": schema}]}
        return {"model": TOOLS_MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}

    _, style, _ = ROUTES[path]
    r = post(scripted_server.url, path, body(450))
    assert r.status_code == 400
    error = error_of(r, style)
    assert error["message"] == f"tools: nested too deeply (limit {MAX_TEMPLATE_DEPTH} levels of objects and arrays)"
    if style == "openai":
        assert error["param"] == "tools"
    # Just inside the limit the template renders it (too long for this 512-token context, but counted).
    ok = post(scripted_server.url, path, body(MAX_TEMPLATE_DEPTH // 2 - 3))
    assert "nested" not in ok.text and ("prompt is too long" in ok.text or "context length" in ok.text)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/messages/count_tokens"])
def test_more_content_blocks_than_the_context_holds_are_refused_before_validation(scripted_server, engine, path):
    """Each block renders to a token at least. A message of 1,000,000 one-letter blocks (31 MB)
    spent 7-15 s in validation holding the GIL, stalling /health and every other client; now the
    raw JSON's blocks are counted first (count_tokens: up to what it counts)."""
    from tierlm.serving.generation import COUNT_CHARS_PER_CONTEXT_TOKEN

    make_body, style, _ = ROUTES[path]
    n = engine.max_model_len
    limit = n * COUNT_CHARS_PER_CONTEXT_TOKEN if path.endswith("count_tokens") else n
    body = make_body("x")
    body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "a"}] * (limit - 1)}]
    r = post(scripted_server.url, path, body)
    assert "content blocks up to here" not in r.text  # the message and its blocks: `limit` parts
    if path == "/v1/messages":
        body["messages"][0]["content"] = [{"type": "text", "text": "a"}] * (limit - 2) + [{"type": "nonsense"}]
        r = post(scripted_server.url, path, body)
        assert r.status_code == 400 and f"content.{limit - 2}: content blocks of type 'nonsense'" in r.text  # validated
        body["messages"][0]["content"][-1] = {"type": "text", "text": "a"}
    body["messages"][0]["content"].append({"type": "text", "text": "a"})
    r = post(scripted_server.url, path, body)
    assert r.status_code == 400
    error = error_of(r, style)
    what = (f"the {limit} count_tokens counts" if path.endswith("count_tokens")
            else f"the {n}-token context holds")
    assert error["message"].startswith(f"messages.0.content: the request has {limit + 1} tools, messages and "
                                       f"content blocks up to here, more than {what}")
    if style == "openai":
        assert error["param"] == "messages.0.content" and error["code"] == "context_length_exceeded"
    if path.endswith("count_tokens"):
        return  # (its limit's worth of tools passes this server's body limit)
    # Tools render into the prompt too: 700,000 of them spent 36 s in validation and rendering.
    tool = ({"name": "f", "input_schema": {"type": "object"}} if style == "anthropic"
            else {"type": "function", "function": {"name": "f"}})
    body = make_body("x")
    body["tools"] = [tool] * (limit + 1)
    r = post(scripted_server.url, path, body)
    assert r.status_code == 400 and error_of(r, style)["message"].startswith(
        f"tools: the request has {limit + 1} tools, messages and content blocks up to here")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("where", ["document", "tool_result"])
def test_blocks_nested_in_documents_are_counted_before_validation(scripted_server, engine, path, where):
    """A document's source.content (also inside a tool result) holds blocks too: 1,150,000 of
    them in one document were validated for 5 s before the prompt was found too long, when the
    same blocks one level up were refused in 0.4 s by the count of the raw JSON."""
    from tierlm.serving.generation import COUNT_CHARS_PER_CONTEXT_TOKEN

    make_body, style, _ = ROUTES[path]
    n = engine.max_model_len
    limit = n * COUNT_CHARS_PER_CONTEXT_TOKEN if path.endswith("count_tokens") else n
    document = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "a"}] * limit}}
    if where == "document":
        content, at = [document], "messages.0.content.0.source.content"
    else:
        content = [{"type": "tool_result", "tool_use_id": "t1", "content": [document]}]
        at = "messages.0.content.0.content.0.source.content"
    body = make_body("x")
    body["messages"] = [{"role": "user", "content": content}]
    r = post(scripted_server.url, path, body)
    assert r.status_code == 400
    assert error_of(r, style)["message"].startswith(f"{at}: the request has {limit + 2 + (where != 'document')} "
                                                    "tools, messages and content blocks up to here")


def test_nested_blocks_are_counted_in_document_order_and_only_where_they_render(scripted_server, engine):
    """The count walked nested lists last first, so the refusal named the wrong block; and it
    counted a `content` list on any block, one the API ignores unread (a text block's)."""
    n = engine.max_model_len
    make_body, style, _ = ROUTES["/v1/messages"]
    text = [{"type": "text", "text": "a"}]
    body = make_body("x")
    body["messages"] = [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": text * (n // 2)},
        {"type": "tool_result", "tool_use_id": "t2", "content": text * (n // 2)}]}]
    r = post(scripted_server.url, "/v1/messages", body)
    assert r.status_code == 400
    assert error_of(r, style)["message"].startswith(f"messages.0.content.1.content: the request has {2 * (n // 2) + 3} ")
    body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "hi", "content": text * (2 * n)}]}]
    r = post(scripted_server.url, "/v1/messages", body)
    assert r.status_code == 200, r.text
