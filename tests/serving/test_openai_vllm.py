"""Where tierlm's OpenAI API meets vLLM's and OpenAI's: vLLM's extra request fields (honoured,
or refused with a 400 where ignoring them would change the answer), the Completions API's
`top_logprobs`, and a forced tool call the model does not finish. Real HTTP, real engines over
the scripted models (see scripted_model.py) and, where a random distribution is needed, the
demo model."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.serving.harness import API_KEY, parse_sse
from tests.serving.scripted_model import (
    FORCED_ANY_REPLY,
    FORCED_REPLY,
    FORCED_TOOL,
    PREFILL,
    PREFILL_REPLY,
    REPLY,
    TEXT_MODEL,
    TOOLS_MODEL,
    CALL_MODEL,
    chat_prompt_ids,
)

WEATHER_TOOL = {"type": "function", "function": {"name": FORCED_TOOL, "parameters": {"type": "object"}}}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def client(openai_client):
    return openai_client


@pytest.fixture
def asked(requests_to):
    return requests_to(TEXT_MODEL)


def chat(**fields):
    return {"model": TEXT_MODEL, "messages": HI, "max_tokens": 40, **fields}


def completion(engine, **fields):
    """A completion whose prompt is the rendered chat prompt, which the text model answers with REPLY."""
    return {"model": TEXT_MODEL, "prompt": chat_prompt_ids(engine.tokenizer), "max_tokens": 40, **fields}


def streamed(client, path, body) -> tuple[str, str]:
    """(text, finish_reason) of a streamed chat completion or completion."""
    frames = [d for _, d in parse_sse(client.post(path, json={**body, "stream": True}).text)]
    assert frames[-1] == "[DONE]"
    choices = [c["choices"][0] for c in frames[:-1] if c["choices"]]
    text = "".join((c["delta"].get("content") or "") if "delta" in c else c["text"] for c in choices)
    return text, choices[-1]["finish_reason"]


def both_routes(client, engine, **fields):
    """(text, finish_reason) from chat and completions, each non-streamed and streamed."""
    out = []
    for path, body in (("/v1/chat/completions", chat(**fields)), ("/v1/completions", completion(engine, **fields))):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append((choice["message"]["content"] if "message" in choice else choice["text"], choice["finish_reason"]))
        out.append(streamed(client, path, body))
    return out


def stop_reasons(client, engine, **fields) -> list:
    """vLLM's `stop_reason` from chat and completions, each non-streamed and streamed (on the
    chunk with the finish_reason; the chunks before it carry none)."""
    out = []
    for path, body in (("/v1/chat/completions", chat(**fields)), ("/v1/completions", completion(engine, **fields))):
        out.append(client.post(path, json=body).json()["choices"][0]["stop_reason"])
        frames = [d for _, d in parse_sse(client.post(path, json={**body, "stream": True}).text)]
        choices = [c["choices"][0] for c in frames[:-1] if c["choices"]]
        assert all("stop_reason" not in c for c in choices[:-1])
        out.append(choices[-1]["stop_reason"])
    return out


# ---- vLLM's extensions, honoured -----------------------------------------------------------


def test_include_stop_str_in_output(client, scripted_engines):
    engine = scripted_engines[TEXT_MODEL]
    assert both_routes(client, engine, stop=["STOP"], include_stop_str_in_output=True) == [("alpha beta STOP", "stop")] * 4
    assert both_routes(client, engine, stop=["STOP"]) == [("alpha beta ", "stop")] * 4
    assert stop_reasons(client, engine, stop=["nope", "STOP"]) == ["STOP"] * 4  # (the string that matched)
    assert stop_reasons(client, engine) == [None] * 4  # EOS
    assert stop_reasons(client, engine, max_tokens=2) == [None] * 4  # a limit


def test_stop_token_ids(client, scripted_engines, scripted_models, asked):
    engine = scripted_engines[TEXT_MODEL]
    ids = scripted_models[TEXT_MODEL].reply_tokens(REPLY)
    before = engine.tokenizer.decode(ids[:3])
    assert REPLY.startswith(before) and ids[3] not in ids[:3]
    assert both_routes(client, engine, stop_token_ids=[ids[3]]) == [(before, "stop")] * 4
    assert stop_reasons(client, engine, stop_token_ids=[ids[3]]) == [ids[3]] * 4
    assert asked[-1].params.stop_token_ids == [ids[3]]


def test_skip_special_tokens_reaches_the_engine(client, scripted_engines, asked):
    for path, body in (("/v1/chat/completions", chat(skip_special_tokens=False)),
                       ("/v1/completions", completion(scripted_engines[TEXT_MODEL], skip_special_tokens=False))):
        assert client.post(path, json=body).status_code == 200
        assert asked[-1].params.skip_special_tokens is False
    assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    assert asked[-1].params.skip_special_tokens is True


def test_continue_final_message(client, scripted_engines, asked):
    messages = [*HI, {"role": "assistant", "content": PREFILL}]
    body = chat(messages=messages, continue_final_message=True, add_generation_prompt=False)
    data = client.post("/v1/chat/completions", json=body).json()
    assert data["choices"][0]["message"]["content"] == PREFILL_REPLY  # the continuation alone, as vLLM
    assert scripted_engines[TEXT_MODEL].tokenizer.decode(asked[-1].prompt_token_ids).endswith(PREFILL)
    assert streamed(client, "/v1/chat/completions", body) == (PREFILL_REPLY, "stop")
    # both true (add_generation_prompt's default is true) is refused, as vLLM does
    for fields in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": True}):
        r = client.post("/v1/chat/completions", json=chat(messages=messages, **fields))
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        assert "add_generation_prompt" in r.json()["error"]["message"]


def test_add_generation_prompt_false_leaves_out_the_assistant_header(client, scripted_engines, asked):
    tokenizer = scripted_engines[TEXT_MODEL].tokenizer
    assert client.post("/v1/chat/completions", json=chat(add_generation_prompt=False)).status_code == 200
    assert tokenizer.decode(asked[-1].prompt_token_ids).endswith("<|im_start|>user\nHi<|im_end|>\n")
    assert client.post("/v1/chat/completions", json=chat(add_generation_prompt=None)).status_code == 200
    assert tokenizer.decode(asked[-1].prompt_token_ids).endswith("<|im_start|>assistant\n")


# ---- vLLM's extensions that would change the answer if ignored: refused --------------------


@pytest.mark.parametrize("field, value", [
    ("guided_grammar", "root ::= 'a'"),
    ("use_beam_search", True),
    ("spaces_between_special_tokens", False),
])
def test_vllm_fields_that_change_the_answer_are_refused(client, scripted_engines, field, value):
    for path, body in (("/v1/chat/completions", chat(**{field: value})),
                       ("/v1/completions", completion(scripted_engines[TEXT_MODEL], **{field: value}))):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and error["type"] == "invalid_request_error"
        assert "not supported" in error["message"]


def test_custom_chat_template_is_refused_and_neutral_values_pass(client, scripted_engines):
    r = client.post("/v1/chat/completions", json=chat(chat_template="{{ messages }}"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    neutral = dict(guided_json=None, guided_choice=None, structured_outputs=None, use_beam_search=False,
                   prompt_logprobs=None, truncate_prompt_tokens=None, guided_decoding_backend="auto",
                   bad_words=None, allowed_token_ids=None, spaces_between_special_tokens=True)
    r = client.post("/v1/chat/completions", json=chat(chat_template=None, **neutral))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY
    assert client.post("/v1/completions", json=completion(scripted_engines[TEXT_MODEL], **neutral)).status_code == 200


# ---- /v1/completions top_logprobs hold the sampled token -----------------------------------


def legacy_logprobs_of(client, body) -> list[dict]:
    """The logprobs of a completion, non-streamed and streamed (which must agree)."""
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    frames = [d for _, d in parse_sse(client.post("/v1/completions", json={**body, "stream": True}).text)][:-1]
    parts = [c["choices"][0]["logprobs"] for c in frames if c["choices"] and c["choices"][0]["logprobs"]]
    assert {k: [v for p in parts for v in p[k]] for k in whole} == whole
    return whole


def test_completion_logprobs_zero_hold_the_sampled_token(client, scripted_engines):
    lp = legacy_logprobs_of(client, completion(scripted_engines[TEXT_MODEL], logprobs=0))
    assert "".join(lp["tokens"]) == REPLY
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]


def test_completion_top_logprobs_hold_the_sampled_token(demo_server):
    """OpenAI: "up to logprobs+1 elements"; the demo model's random weights sample outside the top 1."""
    with httpx.Client(base_url=demo_server.url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Random words", "max_tokens": 30, "temperature": 1.0, "seed": 11,
                "logprobs": 1}
        lp = legacy_logprobs_of(c, body)
    assert all(lp["tokens"][i] in top and top[lp["tokens"][i]] == lp["token_logprobs"][i] and len(top) <= 2
               for i, top in enumerate(lp["top_logprobs"]))
    assert any(len(top) == 2 for top in lp["top_logprobs"])  # a token sampled outside the top 1


# ---- return_token_ids, return_tokens_as_token_ids (vLLM's) ---------------------------------


def _ids_of(client, path, body) -> tuple[dict, list[dict], list]:
    """(the non-streamed choice and its top level, the streamed choices' chunks, streamed ids)."""
    whole = client.post(path, json=body).json()
    frames = [d for _, d in parse_sse(client.post(path, json={**body, "stream": True}).text)][:-1]
    return whole, [f for f in frames if f["choices"]], [t for f in frames if f["choices"]
                                                       for t in f["choices"][0].get("token_ids", [])]


@pytest.mark.parametrize("stop", [None, ["STOP"]])
def test_return_token_ids_on_both_routes(client, scripted_engines, scripted_models, asked, stop):
    """The prompt's ids as run and every generated id (the EOS too, as usage counts it; those past
    a stop string's start too), non-streamed and streamed (each chunk the ids since the last,
    the prompt's on the first chunk only); without the field, neither."""
    engine = scripted_engines[TEXT_MODEL]
    reply = scripted_models[TEXT_MODEL].reply_tokens(REPLY)
    for path, body in (("/v1/chat/completions", chat(return_token_ids=True, stop=stop)),
                       ("/v1/completions", completion(engine, return_token_ids=True, stop=stop))):
        whole, chunks, streamed_ids = _ids_of(client, path, body)
        choice, prompt_ids = whole["choices"][0], asked[-1].prompt_token_ids
        assert (whole if "message" in choice else choice)["prompt_token_ids"] == prompt_ids
        got = choice["token_ids"]
        assert len(got) == whole["usage"]["completion_tokens"]
        if stop is None:
            assert got == [*reply, engine.tokenizer.eos_token_id]
        else:  # the stop string's tokens are generated, not shown
            assert got == reply[:len(got)] and engine.tokenizer.decode(got).startswith("alpha beta STOP")
        assert streamed_ids == got
        # incremental: most chunks carry the ids that came with them, not all on the last one
        carrying = [ch["choices"][0].get("token_ids") for ch in chunks]
        assert sum(1 for ids in carrying if ids) > len(got) // 2
        carrier = (lambda c: c) if "message" in choice else (lambda c: c["choices"][0])
        assert [i for i, c in enumerate(chunks) if "prompt_token_ids" in carrier(c)] == [0]
        assert carrier(chunks[0])["prompt_token_ids"] == prompt_ids
        plain = client.post(path, json={**body, "return_token_ids": None}).json()
        assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(demo_server):
    """The demo model's byte-level tokens: every logprobs entry (chat's token and top entries,
    the Completions API's tokens and top keys, the echoed prompt's) is "token_id:N", N the token
    generated (return_token_ids says which), on both routes, streamed or not."""
    with httpx.Client(base_url=demo_server.url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        fields = {"model": model, "max_tokens": 12, "temperature": 1.0, "seed": 5, "return_token_ids": True,
                  "return_tokens_as_token_ids": True}
        chat_body = {**fields, "messages": HI, "logprobs": True, "top_logprobs": 2}
        whole, chunks, streamed_ids = _ids_of(c, "/v1/chat/completions", chat_body)
        choice = whole["choices"][0]
        named = [e["token"] for e in choice["logprobs"]["content"]]
        assert named == [f"token_id:{t}" for t in choice["token_ids"]] and streamed_ids == choice["token_ids"]
        streamed = [e["token"] for ch in chunks for e in (ch["choices"][0]["logprobs"] or {}).get("content", [])]
        assert streamed == named
        tops = [t["token"] for e in choice["logprobs"]["content"] for t in e["top_logprobs"]]
        assert len(tops) == 2 * len(named) and all(t.startswith("token_id:") and t[9:].isdigit() for t in tops)
        body = {**fields, "prompt": "Random words", "logprobs": 2, "echo": True}
        lp = legacy_logprobs_of(c, body)
        done = c.post("/v1/completions", json=body).json()["choices"][0]
        ids = done["prompt_token_ids"] + done["token_ids"]
        assert lp["tokens"] == [f"token_id:{t}" for t in ids]
        assert all(all(k.startswith("token_id:") for k in top) for top in lp["top_logprobs"][1:])
        plain = c.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
        assert not any(t.startswith("token_id:") for t in plain["choices"][0]["logprobs"]["tokens"])


# ---- logit_bias (OpenAI's) -----------------------------------------------------------------


def test_logit_bias_reaches_the_sampler_on_both_routes_and_bad_ids_are_named(demo_server, demo_engine):
    """+100 on a token makes a greedy and a sampled answer that token over and over; a token id past
    the vocabulary is a 400 naming the field and the id."""
    tok = demo_engine.tokenizer
    token = tok.encode(" hello", add_special_tokens=False)[-1]
    with httpx.Client(base_url=demo_server.url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for temperature in (0.0, 1.0):
            fields = {"model": model, "max_tokens": 3, "temperature": temperature, "logit_bias": {str(token): 100}}
            r = c.post("/v1/completions", json={**fields, "prompt": "Random words", "logprobs": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["logprobs"]["tokens"] == [tok.decode([token])] * 3
            r = c.post("/v1/chat/completions", json={**fields, "messages": HI})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == tok.decode([token] * 3)
        vocab = demo_engine.engine.args.vocab_size
        for path, body in (("/v1/completions", {"prompt": "Random words"}), ("/v1/chat/completions", {"messages": HI})):
            r = c.post(path, json={"model": model, "logit_bias": {"3": 1, str(vocab + 5): -1}, **body})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "logit_bias" and str(vocab + 5) in r.json()["error"]["message"]


# ---- allowed_token_ids and bad_words (vLLM's) -----------------------------------------------


def test_allowed_token_ids_and_bad_words_reach_the_sampler_on_both_routes(demo_server, demo_engine):
    """allowed_token_ids keep a greedy and a sampled answer to the set; bad_words ban a word a
    +100 bias forces, the rest of the answer going on (vLLM's order: the ban wins)."""
    tok = demo_engine.tokenizer
    hello = tok.encode("hello", add_special_tokens=False)
    assert len(hello) == 1
    allowed = tok.encode(" zq xv", add_special_tokens=False)
    with httpx.Client(base_url=demo_server.url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for temperature in (0.0, 1.0):
            fields = {"model": model, "max_tokens": 6, "temperature": temperature, "seed": 3}
            r = c.post("/v1/completions", json={**fields, "prompt": "Random words", "logprobs": 0,
                                                "allowed_token_ids": allowed})
            assert r.status_code == 200, r.text
            assert set(r.json()["choices"][0]["logprobs"]["tokens"]) <= {tok.decode([t]) for t in allowed}
            forced = {**fields, "logit_bias": {str(hello[0]): 100}, "ignore_eos": True}
            r = c.post("/v1/chat/completions", json={**forced, "messages": HI})
            assert r.json()["choices"][0]["message"]["content"] == "hello" * 6
            r = c.post("/v1/chat/completions", json={**forced, "messages": HI, "bad_words": ["hello"]})
            assert r.status_code == 200, r.text
            content = r.json()["choices"][0]["message"]["content"]
            assert "hello" not in content and r.json()["usage"]["completion_tokens"] == 6
            r = c.post("/v1/chat/completions", json={**fields, "messages": HI, "allowed_token_ids": allowed})
            content = r.json()["choices"][0]["message"]["content"]
            assert set(tok.encode(content, add_special_tokens=False)) <= set(allowed)
            r = c.post("/v1/completions", json={**forced, "prompt": "Random words", "bad_words": [" hello"]})
            assert r.status_code == 200 and "hello" not in r.json()["choices"][0]["text"]


@pytest.mark.parametrize("field, value, says", [
    ("allowed_token_ids", [], "must not be empty"), ("allowed_token_ids", [3, -2], "non-negative"),
    ("allowed_token_ids", "3", "list"), ("allowed_token_ids", [3, 1 << 40], "outside the model's vocabulary"),
    ("bad_words", [""], "empty"), ("bad_words", "hello", "list"), ("bad_words", ["x"] * 1025, "at most 1024 words"),
    ("bad_words", ["x" * 257], "at most 256 characters")])
def test_bad_allowed_token_ids_and_bad_words_are_a_400_naming_the_field(demo_server, field, value, says):
    with httpx.Client(base_url=demo_server.url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for path, body in (("/v1/completions", {"prompt": "Random words"}), ("/v1/chat/completions", {"messages": HI})):
            r = c.post(path, json={"model": model, "max_tokens": 2, field: value, **body})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field and says in r.json()["error"]["message"], r.text


# ---- truncate_prompt_tokens (vLLM's) ---------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(demo_server, demo_engine):
    """The answer is the one to the prompt's last N tokens, and usage counts N; more than
    max_model_len, or 0, is a 400 naming the field."""
    ids = demo_engine.encode("one two three four five six seven eight nine ten")
    with httpx.Client(base_url=demo_server.url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        base = {"model": model, "max_tokens": 5, "temperature": 0}
        cut = c.post("/v1/completions", json={**base, "prompt": ids, "truncate_prompt_tokens": 4}).json()
        tail = c.post("/v1/completions", json={**base, "prompt": ids[-4:]}).json()
        assert cut["usage"]["prompt_tokens"] == 4 and cut["choices"][0]["text"] == tail["choices"][0]["text"]
        text = c.post("/v1/completions", json={**base, "prompt": "one two three", "truncate_prompt_tokens": 2}).json()
        assert text["usage"]["prompt_tokens"] == 2
        chat = c.post("/v1/chat/completions", json={**base, "messages": HI, "truncate_prompt_tokens": 3})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 3
        whole = c.post("/v1/completions", json={**base, "prompt": ids, "truncate_prompt_tokens": -1}).json()
        assert whole["usage"]["prompt_tokens"] == len(ids)
        context = demo_engine.max_model_len  # -1 on a prompt past the context: as many as fit beside max_tokens
        over = c.post("/v1/completions", json={**base, "prompt": (ids * context)[:context + 9],
                                               "truncate_prompt_tokens": -1})
        assert over.status_code == 200 and over.json()["usage"]["prompt_tokens"] == context - base["max_tokens"]
        # A text prompt to truncate is tokenized whole: bounded as count_tokens is (a 25 MB one took 4.9 GB).
        from tierlm.serving.generation import COUNT_CHARS_PER_CONTEXT_TOKEN
        huge = "a " * (COUNT_CHARS_PER_CONTEXT_TOKEN * context // 2 + 1)
        r = c.post("/v1/completions", json={**base, "prompt": huge, "truncate_prompt_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "tokenizes prompts to truncate of up to" in r.json()["error"]["message"]
        for bad in (demo_engine.max_model_len + 1, 0, -2):
            r = c.post("/v1/completions", json={**base, "prompt": ids, "truncate_prompt_tokens": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


# ---- a forced tool call the model does not finish ------------------------------------------


def forced_answer(client, body) -> tuple[dict, tuple[str, str, bool]]:
    """(non-streamed choice, (streamed content, finish_reason, whether any tool_calls came))."""
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    frames = [d for _, d in parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)]
    deltas = [c["choices"][0] for c in frames[:-1] if c["choices"]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    return choice, (content, deltas[-1]["finish_reason"], any("tool_calls" in d["delta"] for d in deltas))


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": FORCED_TOOL}}, "required"])
def test_unfinished_forced_call_is_the_models_text_without_the_prefill(client, scripted_engines, scripted_models,
                                                                       tool_choice):
    """tierlm starts a forced call in the prompt (`<tool_call>` ...); that start is never content."""
    tokenizer = scripted_engines[TOOLS_MODEL].tokenizer
    named = isinstance(tool_choice, dict)
    reply = FORCED_REPLY if named else FORCED_ANY_REPLY
    ids = scripted_models[TOOLS_MODEL].reply_tokens(reply)
    body = {"model": TOOLS_MODEL, "messages": HI, "tools": [WEATHER_TOOL], "tool_choice": tool_choice}
    cut = tokenizer.decode(ids[:4])
    choice, streamed_answer = forced_answer(client, {**body, "max_tokens": 4})
    assert choice["message"] == {"role": "assistant", "content": cut, "refusal": None, "annotations": [],
                                 "tool_calls": None}
    assert choice["finish_reason"] == "length" and streamed_answer == (cut, "length", False)
    # cut by a stop string inside the arguments: `stop`
    choice, streamed_answer = forced_answer(client, {**body, "stop": ["Oslo" if named else "Paris"]})
    before = reply[:reply.index("Oslo" if named else "Paris")]
    assert (choice["message"]["content"], choice["finish_reason"]) == (before, "stop")
    assert streamed_answer == (before, "stop", False)


def test_a_forced_call_the_model_would_not_write_is_written_on_the_schema(client):
    """The call model has no script after the started call: unconstrained it ended at once (empty
    content, no call). The call's grammar allows no EOS before the call is whole, so what it
    writes, off its script, is a call to the named tool whose arguments follow the schema."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
              "additionalProperties": False}
    tool = {"type": "function", "function": {"name": FORCED_TOOL, "parameters": schema}}
    body = {"model": CALL_MODEL, "messages": HI, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": FORCED_TOOL}}}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    # a named tool_choice's call ends with `stop` (OpenAI's and vLLM's rule; `required` and `auto`: tool_calls)
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == FORCED_TOOL
    assert json.loads(call["function"]["arguments"])["city"] in ("Oslo", "Paris")
    frames = [d for _, d in parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)]
    deltas = [c["choices"][0] for c in frames[:-1] if c["choices"]]
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or ()]
    assert [c["function"]["name"] for c in calls] == [FORCED_TOOL] and deltas[-1]["finish_reason"] == "stop"
    required = client.post("/v1/chat/completions", json={**body, "tool_choice": "required"}).json()["choices"][0]
    assert required["finish_reason"] == "tool_calls" and required["message"]["tool_calls"]
    assert json.loads(calls[0]["function"]["arguments"]) in ({"city": "Oslo"}, {"city": "Paris"})
    assert not "".join(d["delta"].get("content") or "" for d in deltas)


THINKING_TEMPLATE = (  # Qwen3's switch: `enable_thinking=false` opens the answer with an empty think block
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    "{% if documents is defined and documents %}[{{ documents | length }} documents]{% endif %}"
)


@pytest.fixture(scope="module")
def thinking(scripted_models, tmp_path_factory):
    """A scripted checkpoint with a Qwen3-style `enable_thinking` switch in its template, served alone."""
    import json
    import shutil

    from tests.serving.harness import ServerThread
    from tests.serving.scripted_model import ENGINE_OPTIONS
    from tierlm.engine.async_engine import AsyncEngine
    from tierlm.serving.app import build_app
    from tierlm.serving.auth import ApiKeyAuth

    path = tmp_path_factory.mktemp("thinking") / "scripted-thinking"
    shutil.copytree(scripted_models[TEXT_MODEL].path, path)
    for f in path.glob("chat_template.j*"):
        f.unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    engine = AsyncEngine.from_model(str(path), served_model_name="scripted-thinking", **ENGINE_OPTIONS)
    server = ServerThread(build_app({"scripted-thinking": engine}, ApiKeyAuth.from_keys({"alice": API_KEY}))).start()
    yield engine, server.url
    server.stop()


def test_chat_template_kwargs_reach_the_template(thinking, monkeypatch):
    """vLLM's `chat_template_kwargs` (Qwen3's `enable_thinking: false`) was ignored: the model
    thought though the client had switched it off."""
    from tests.serving.harness import record_requests

    engine, url = thinking
    asked = record_requests(engine, monkeypatch)
    headers = {"authorization": f"Bearer {API_KEY}"}
    body = {"model": "scripted-thinking", "messages": HI, "max_tokens": 2}
    for kwargs in (None, {"enable_thinking": True}, {"enable_thinking": False}):
        r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=30,
                       json={**body, **({"chat_template_kwargs": kwargs} if kwargs else {})})
        assert r.status_code == 200, r.text
    prompts = [engine.tokenizer.decode(req.prompt_token_ids) for req in asked]
    assert ["<think>" in p for p in prompts] == [False, False, True]
    # As vLLM: the kwargs may set add_generation_prompt and documents; tokenize is refused
    docs = [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]
    for fields in ({"chat_template_kwargs": {"add_generation_prompt": False}}, {"documents": docs},
                   {"chat_template_kwargs": {"documents": docs, "return_dict": True}}):
        r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=30, json={**body, **fields})
        assert r.status_code == 200, r.text
    no_header, *with_docs = [engine.tokenizer.decode(req.prompt_token_ids) for req in asked[3:]]
    assert "<|im_start|>assistant" not in no_header
    assert all("[2 documents]" in p for p in with_docs)
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=30,
                   json={**body, "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert "tokenize cannot be set here" in r.json()["error"]["message"]


def test_best_of_n_and_output_arguments_in_chat_template_kwargs(client):
    """A reviewer's and a false-refusal hunt's cases: `best_of` below `n` ran (OpenAI refuses
    it), `best_of` equal to `n` was refused, and `sanitize_control_tokens` in
    `chat_template_kwargs` failed later as a template error."""
    r = client.post("/v1/completions", json={"model": TEXT_MODEL, "prompt": "Hi", "n": 3, "best_of": 1,
                                             "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    assert "best_of must be greater than or equal to n, got n=3 and best_of=1" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": TEXT_MODEL, "prompt": "Hi", "n": 2, "best_of": 2,
                                             "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2  # the best 2 of 2: the 2 themselves
    # apply_chat_template's arguments about tokenized output change no text: left out, not a
    # template error (sanitize_control_tokens=True failed rendering before)
    r = client.post("/v1/chat/completions", json=chat(chat_template_kwargs={"sanitize_control_tokens": True,
                                                                            "return_dict": True}))
    assert r.status_code == 200, r.text


# ---- OpenAI's fields that would change the answer if ignored: refused ----------------------


@pytest.mark.parametrize("field, value, says", [
    ("functions", [{"name": FORCED_TOOL, "parameters": {"type": "object"}}], "use tools and tool_choice"),
    ("function_call", {"name": FORCED_TOOL}, "use tools and tool_choice"),
    ("audio", {"voice": "alloy", "format": "wav"}, "tierlm produces text only"),
    ("modalities", ["text", "audio"], "tierlm produces text only"),
    ("web_search_options", {}, "tierlm runs no web search; pass search results in the messages"),
    ("web_search_options", {"search_context_size": "low"}, "tierlm runs no web search"),
])
def test_openai_fields_that_change_the_answer_are_refused(client, asked, field, value, says):
    before = len(asked)
    r = client.post("/v1/chat/completions", json=chat(**{field: value}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}: ") and says in error["message"]
    assert len(asked) == before


def test_openai_neutral_values_of_those_fields_pass(client):
    neutral = dict(functions=None, function_call=None, audio=None, web_search_options=None, modalities=["text"])
    # function_call "none" / "auto" without functions ask for nothing tierlm does not do
    for fields in (neutral, {"modalities": None}, {"functions": []}, {"function_call": "none"},
                   {"function_call": "auto", "functions": []}):
        r = client.post("/v1/chat/completions", json=chat(**fields))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY, r.text


# ---- vLLM's stream_options.continuous_usage_stats ------------------------------------------


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, scripted_engines, asked):
    engine = scripted_engines[TEXT_MODEL]
    for path, body in (("/v1/chat/completions", chat(n=2)), ("/v1/completions", completion(engine, n=2))):
        options = {"include_usage": True, "continuous_usage_stats": True}
        frames = [d for _, d in parse_sse(client.post(path, json={**body, "stream": True,
                                                                  "stream_options": options}).text)][:-1]
        prompt = len(asked[-1].prompt_token_ids)
        *chunks, last = frames
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * (len(engine.encode(REPLY)) + 1)
        seen = {0: 0, 1: 0}  # each choice's usage counts that choice's tokens, growing to its total (as vLLM)
        for chunk in chunks:
            (choice,) = chunk["choices"]
            usage = chunk["usage"]
            assert usage["prompt_tokens"] == prompt
            assert usage["total_tokens"] == prompt + usage["completion_tokens"] >= prompt + seen[choice["index"]]
            seen[choice["index"]] = usage["completion_tokens"]
        assert seen == {0: len(engine.encode(REPLY)) + 1, 1: len(engine.encode(REPLY)) + 1}
        # without include_usage it does nothing, as in vLLM; without it, chunks carry usage null
        for options in ({"continuous_usage_stats": True}, {"include_usage": True}):
            frames = [d for _, d in parse_sse(client.post(path, json={**body, "stream": True,
                                                                      "stream_options": options}).text)][:-1]
            assert all(f.get("usage") is None for f in frames if f["choices"])
