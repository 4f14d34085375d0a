"""Reasoning models end to end: a think block comes back as reasoning, apart from the answer.

Scripted checkpoints (see scripted_model.py) whose chat templates show think blocks, as Qwen3's
and DeepSeek-R1's do, answer with one; the server detects the syntax from the template
(`--reasoning-parser auto`). Through the official SDKs: Anthropic thinking blocks (streamed as
thinking_delta and signature_delta), OpenAI `reasoning_content` / `reasoning` (vLLM's fields).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import random

import httpx
import openai
import pytest

from tests.serving.harness import (API_KEY, ServerThread, assert_cut_off_is_all_thinking, guarded_server, output_policies_file, parse_sse,
                                  record_requests, sdk_clients, tenants_file)
from tests.serving.scripted_model import CALL, build_templated_models
from tierlm.models.demo import CHAT_TEMPLATE
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth
from tierlm.serving.reasoning import ReasoningFormat, ReasoningSplitter, reasoning_format, split_reasoning

# Qwen3's shape: the model opens its think block (an empty one in the prompt turns thinking off)
THINK_TEMPLATE = (CHAT_TEMPLATE + "{% if add_generation_prompt and enable_thinking is false %}"
                  "<think>\n\n</think>\n\n{% endif %}")
# DeepSeek-R1's and Qwen3-Thinking's shape: the generation prompt opens it
OPEN_TEMPLATE = CHAT_TEMPLATE + "{% if add_generation_prompt %}<think>\n{% endif %}"
# Writes an assistant turn's reasoning back, as Qwen3's template does in a tool loop
HISTORY_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' }}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is string %}"
    "{{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{%- endif %}"
    "{{- (m.content if m.content is string else '') + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

THINKER, OPENER, TOOL_THINKER, SPECIAL_THINKER, HISTORY, PONDERER = (
    "thinker", "opener", "tool-thinker", "special-thinker", "history", "ponderer")
PONDERING = "tick tock, "  # PONDERER thinks this over and over (the prompt opened the block)
THOUGHT, ANSWER = "The user greets me.", "Hello there!"
# (no "\n" after both markers: a scripted model's next token depends on its last three alone)
THINKING_REPLY = f"<think>{THOUGHT}\n</think>\n\n{ANSWER}"
OPEN_THOUGHT, OPEN_ANSWER = "Count up.", "One, two."
OPEN_REPLY = f"{OPEN_THOUGHT}\n</think>\n\n{OPEN_ANSWER}"  # the prompt said <think>
TOOL_THOUGHT = "Need the weather first."
TOOL_REPLY = f"<think>{TOOL_THOUGHT}\n</think>\n\n{CALL}"

USER = [{"role": "user", "content": "Hi"}]
WEATHER = {"name": "get_weather", "description": "Weather for a city", "input_schema": {"type": "object"}}
OPENAI_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                   "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def models(demo_tokenizer, tmp_path_factory):
    # (special markers: a tokenizer that marks them special makes a plain decode drop them; in
    # OPENER's so that "</think>" ends unlike the prompt's "<think>")
    markers = ("<think>", "</think>")
    return build_templated_models(tmp_path_factory.mktemp("reasoning"), demo_tokenizer, [
        (THINKER, THINK_TEMPLATE, THINKING_REPLY, ()), (OPENER, OPEN_TEMPLATE, OPEN_REPLY, markers),
        (TOOL_THINKER, THINK_TEMPLATE, TOOL_REPLY, markers), (SPECIAL_THINKER, THINK_TEMPLATE, THINKING_REPLY, markers),
        (HISTORY, HISTORY_TEMPLATE, ANSWER, ()), (PONDERER, OPEN_TEMPLATE, PONDERING, markers),
    ], loop=frozenset({PONDERER}))


@pytest.fixture(scope="module")
def server(models):
    engines = {name: model.engine(name) for name, model in models.items()}
    server = ServerThread(build_app(engines, ApiKeyAuth.from_keys({"alice": API_KEY}))).start()
    yield server, engines
    server.stop()


@pytest.fixture(scope="module")
def clients(server):
    return sdk_clients(server[0].url)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server[0].url + path, json=body, headers={"x-api-key": API_KEY}, timeout=60)


# ---- the splitter ---------------------------------------------------------------------------

FMT = ReasoningFormat()


@pytest.mark.parametrize("text, in_reasoning, expected", [
    (THINKING_REPLY, False, (THOUGHT, ANSWER)),
    (OPEN_REPLY, True, (OPEN_THOUGHT, OPEN_ANSWER)),
    ("  \n<think>a</think>b", False, ("a", "b")),  # blank space before the block
    ("<think>\nhalf a thou", False, ("half a thou", "")),  # cut off while thinking
    ("<think>\nends with space  \n", False, ("ends with space", "")),
    ("<think>a</think>", False, ("a", "")),
    ("<think></think>\n\nb", False, ("", "b")),  # an empty block
    ("Hello <think>x</think>", False, ("", "Hello <think>x</think>")),  # not at the start: text
    ("a</think>b<think>c</think>d", True, ("a", "b<think>c</think>d")),  # only the first block
    ("  plain text  ", False, ("", "  plain text  ")),  # no block: the text as it is
    ("<thin", False, ("", "<thin")),  # a marker's start that never completed is text
    ("a </thi", True, ("a </thi", "")),
    ("", True, ("", "")),
    ("a\n\n b  </think>  c  ", True, ("a\n\n b", "c  ")),
    ("<think>\nfoo</think>bar", True, ("foo", "bar")),  # the prompt opened it, the model wrote it again
    ("<thinking>x", True, ("<thinking>x", "")),
])
def test_split(text, in_reasoning, expected):
    assert split_reasoning(text, FMT, in_reasoning) == expected


WRAPPED = ReasoningFormat(keep_token_ids=(5, 6), answer_start="\ufdd0<think>\ufdd1",
                          answer_end="\ufdd0</think>\ufdd1")


@pytest.mark.parametrize("fmt", [FMT, WRAPPED], ids=["plain", "kept-tokens"])
def test_streamed_split_equals_the_whole_split_however_the_text_is_cut(fmt):
    """Every way of cutting an answer into deltas shows the same reasoning and text as the
    non-streamed answer, and nothing of a marker (or of a kept token) leaks into either."""
    rng = random.Random(7)
    alphabet = ["<think>", "</think>", "<", "/", "t", "h", "i", "n", "k", ">", " ", "\n", "x", "é",
                fmt.answer_start, fmt.answer_end, "\ufdd0[TOOL_CALLS]\ufdd1"]
    texts = [THINKING_REPLY, OPEN_REPLY, TOOL_REPLY, "  <think> a  </think>  b  "]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14))) for _ in range(400)]
    for text, (in_reasoning, continuing) in itertools.product(texts, [(False, False), (True, False), (True, True)]):
        whole = split_reasoning(text, fmt, in_reasoning, continuing)
        assert "\ufdd0" not in whole[0] and "\ufdd1" not in whole[0]
        for _ in range(6):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
            splitter = ReasoningSplitter(fmt, in_reasoning, continuing)
            shown = [splitter.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
            shown.append(splitter.finish())
            assert ("".join(r for r, _ in shown), "".join(c for _, c in shown)) == whole, (text, cuts)


def test_blank_space_held_while_thinking_is_set_aside_not_searched_again():
    """Held-back blank space was searched again on every feed: a model writing newline after
    newline while it thinks cost time quadratic in their number (20,000: 9 s of event loop)."""
    splitter = ReasoningSplitter(FMT, in_reasoning=True)
    assert splitter.feed("step one") == ("step one", "")
    for _ in range(20_000):
        assert splitter.feed("\n") == ("", "")
        assert splitter._held == ""  # what each feed searches stays the new text alone
    assert splitter.feed("two") == ("\n" * 20_000 + "two", "")
    stray = ReasoningSplitter(FMT, in_reasoning=True)  # a model that writes U+FDD0 itself: no kept token
    assert stray.feed("x\ufdd0") == ("x", "")
    shown = "".join(stray.feed("a")[0] for _ in range(2_000))
    assert len(shown) > 1_700 and len(stray._held) <= 256
    lead = ReasoningSplitter(FMT)
    for _ in range(20_000):
        assert lead.feed(" ") == ("", "") and lead._held == ""
    assert lead.feed("<think>a</think>b") == ("a", "b")


@pytest.mark.parametrize("prompt, prefill, opens", [
    ("<|im_start|>assistant\n<think>\n", None, True),  # DeepSeek-R1's generation prompt
    ("<|im_start|>assistant\n", None, False),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", None, False),  # Qwen3, thinking off
    ("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n", None, False),  # a user's words
    ("<|im_start|>assistant\n<think>Let me see", "<think>Let me see", True),  # a prefill that thinks
    ("<|im_start|>assistant\n<think>a</think>Sure", "<think>a</think>Sure", False),
])
def test_where_the_answer_starts(prompt, prefill, opens):
    assert FMT.opens_in_reasoning(prompt, prefill) == opens


def test_a_prefill_inside_reasoning_is_continued_as_written():
    """The continuation's first blank space was dropped as if it began the block: a client
    joining its prefill "<think>Let me" and the reasoning got "Let mesee"."""
    assert FMT.continues_reasoning("<think>Let me") and not FMT.continues_reasoning("<think>\n")
    assert not FMT.continues_reasoning(None) and not FMT.continues_reasoning("<think>a</think>b")
    assert split_reasoning(" see 文.\n</think>\nYes.", FMT, True, continuing=True) == (" see 文.", "Yes.")
    assert split_reasoning(" see 文.\n</think>\nYes.", FMT, True) == ("see 文.", "Yes.")


def test_the_parser_is_detected_from_the_template(models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models[THINKER].path))
    plain = ReasoningFormat()  # (markers spelled in ordinary tokens: no token ids, no budget kept)
    assert len(tok.encode("</think>", add_special_tokens=False)) > 1
    assert reasoning_format("auto", tok) == plain and not plain.budget_kept
    assert reasoning_format("none", tok) is None
    tok.chat_template = CHAT_TEMPLATE  # writes no think marker
    assert reasoning_format("auto", tok) is None
    tok.chat_template = OPEN_TEMPLATE  # writes only <think>
    assert reasoning_format("auto", tok) == plain
    assert reasoning_format("qwen3", tok) == reasoning_format("think", tok) == plain
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; use one of auto, none, think"):
        reasoning_format("r1", tok)
    # vLLM's deepseek_r1: every answer starts inside the block, whatever the prompt
    r1 = reasoning_format("deepseek_r1", tok)
    assert r1.opens_in_reasoning("<|im_start|>assistant\n") and not FMT.opens_in_reasoning("<|im_start|>assistant\n")
    assert split_reasoning("foo</think>bar", r1, True) == ("foo", "bar")
    # ... but not when the prompt wrote a whole block last (Qwen3 with thinking switched off)
    assert not r1.opens_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert r1.opens_in_reasoning("<think>a</think>b<|im_start|>assistant\n")
    assert FMT.decoded(True) is FMT and WRAPPED.decoded(False).answer_start == "<think>"
    special = AutoTokenizer.from_pretrained(str(models[SPECIAL_THINKER].path))
    ids = tuple(special.convert_tokens_to_ids(m) for m in ("<think>", "</think>"))
    fmt = reasoning_format("auto", special)
    assert fmt.keep_token_ids == ids and (fmt.start, fmt.end) == ("<think>", "</think>")
    assert (fmt.start_token_ids, fmt.end_token_ids) == ((ids[0],), (ids[1],)) and fmt.budget_kept
    assert (fmt.answer_start, fmt.answer_end) == ("\ufdd0<think>\ufdd1", "\ufdd0</think>\ufdd1")


def test_kept_marker_tokens_mark_reasoning_and_never_show():
    """With special think tokens, only the tokens (wrapped by the detokenizer) mark reasoning:
    the same text in ordinary tokens is the model's words; stray kept ones are taken out, and
    so are other kept tokens (a tool-call marker) in the reasoning."""
    fmt = WRAPPED
    assert split_reasoning("\ufdd0<think>\ufdd1call \ufdd0[TOOL_CALLS]\ufdd1[{}]\ufdd0</think>\ufdd1hi", fmt) == (
        "call [{}]", "hi")
    text = "\ufdd0<think>\ufdd1a </think> b\ufdd0</think>\ufdd1 c \ufdd0<think>\ufdd1d\ufdd0</think>\ufdd1"
    assert split_reasoning(text, fmt) == ("a </think> b", "c d")
    assert split_reasoning("<think>x</think>y", fmt) == ("", "<think>x</think>y")
    for cut in range(len(text) + 1):
        splitter = ReasoningSplitter(fmt)
        shown = [splitter.feed(text[:cut]), splitter.feed(text[cut:]), splitter.finish()]
        assert ("".join(r for r, _ in shown), "".join(c for _, c in shown)) == ("a </think> b", "c d"), cut


def test_a_call_written_while_thinking_is_reasoning():
    """Only the answer after the think block is read for calls (and the prose's kept markers)."""
    from tierlm.serving.generation import ChatPrompt, Generation
    from tierlm.serving.tools import HERMES, ToolCallFormat

    prompt = ChatPrompt(token_ids=[1], parse_tools=True, tool_names=frozenset({"get_weather"}),
                        tool_calls=ToolCallFormat(HERMES), reasoning=FMT)
    thought = 'Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>?'
    answer = prompt.split(Generation(text=f"<think>{thought}</think>\n{CALL}", finish_reason="stop"), "call_")
    assert (answer.reasoning, answer.text) == (thought, "")
    assert [(c.name, c.arguments) for c in answer.calls] == [("get_weather", {"city": "Paris"})]
    answer = prompt.split(Generation(text=f"<think>{thought}", finish_reason="length"), "call_")
    assert (answer.reasoning, answer.text, answer.calls) == (thought, "", [])


# ---- OpenAI -------------------------------------------------------------------------------


def openai_stream(openai_client, **kwargs):
    reasoning, content, calls, finish, names = [], [], [], None, set()
    for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        names.update(k for k in ("reasoning_content", "reasoning") if k in extra)
        assert extra.get("reasoning_content") == extra.get("reasoning")  # the same text under both names
        reasoning.append(extra.get("reasoning_content") or "")
        content.append(delta.content or "")
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return "".join(reasoning), "".join(content), calls, finish, names


@pytest.mark.parametrize("model, thought, answer", [
    (THINKER, THOUGHT, ANSWER), (OPENER, OPEN_THOUGHT, OPEN_ANSWER), (SPECIAL_THINKER, THOUGHT, ANSWER),
])
def test_openai_reasoning_comes_apart_from_the_content(clients, model, thought, answer):
    _, openai_client = clients
    done = openai_client.chat.completions.create(model=model, messages=USER, max_tokens=64)
    message = done.choices[0].message
    assert (message.content, message.model_extra) == (answer, {"reasoning_content": thought, "reasoning": thought})
    assert done.choices[0].finish_reason == "stop"
    streamed = openai_stream(openai_client, model=model, messages=USER, max_tokens=64)
    assert streamed == (thought, answer, [], "stop", {"reasoning_content", "reasoning"})


def test_openai_reasoning_cut_off_is_all_reasoning(clients):
    _, openai_client = clients
    done = openai_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=9)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "length" and message.content == ""
    thought = message.model_extra["reasoning_content"]
    assert thought and THOUGHT.startswith(thought) and "<think>" not in thought
    streamed = openai_stream(openai_client, model=THINKER, messages=USER, max_tokens=9)
    assert streamed[:4] == (thought, "", [], "length")


def test_openai_tool_calls_are_read_after_the_reasoning(clients):
    _, openai_client = clients
    done = openai_client.chat.completions.create(model=TOOL_THINKER, messages=USER, tools=[OPENAI_WEATHER])
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == TOOL_THOUGHT
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    thought, content, calls, finish, _ = openai_stream(openai_client, model=TOOL_THINKER, messages=USER,
                                                       tools=[OPENAI_WEATHER])
    assert (thought, content, finish) == (TOOL_THOUGHT, "", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_openai_include_reasoning_false_and_special_markers_not_skipped(clients):
    """vLLM's include_reasoning: false leaves the reasoning out (it is still not content); with
    skip_special_tokens false a special marker comes as plain text, and still marks reasoning."""
    _, openai_client = clients
    off = {"include_reasoning": False}
    message = openai_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=64,
                                                    extra_body=off).choices[0].message
    assert (message.content, message.model_extra) == (ANSWER, {})
    assert openai_stream(openai_client, model=THINKER, messages=USER, max_tokens=64, extra_body=off) == (
        "", ANSWER, [], "stop", set())
    keep = {"skip_special_tokens": False}
    message = openai_client.chat.completions.create(model=SPECIAL_THINKER, messages=USER, max_tokens=64,
                                                    extra_body=keep).choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == (ANSWER, THOUGHT)
    streamed = openai_stream(openai_client, model=SPECIAL_THINKER, messages=USER, max_tokens=64, extra_body=keep)
    assert streamed[:4] == (THOUGHT, ANSWER, [], "stop")


def test_openai_logprobs_and_choices_cover_the_reasoning(clients):
    _, openai_client = clients
    done = openai_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=64, logprobs=True, n=2)
    for choice in done.choices:
        assert (choice.message.content, choice.message.model_extra["reasoning_content"]) == (ANSWER, THOUGHT)
        assert "".join(t.token for t in choice.logprobs.content) == THINKING_REPLY  # every token, markers too
    assert len(done.choices) == 2


def test_openai_reasoning_sent_back_reaches_the_template(server, clients, monkeypatch):
    """vLLM passes an assistant message's reasoning_content (or reasoning) to the template; it
    was dropped, so a Qwen3 tool loop's prompt lost the model's earlier reasoning."""
    _, engines = server
    _, openai_client = clients
    asked = record_requests(engines[HISTORY], monkeypatch)
    for field in ("reasoning_content", "reasoning"):
        messages = [*USER, {"role": "assistant", "content": "It is blue.", field: "Check the sky."},
                    {"role": "user", "content": "Why?"}]
        openai_client.chat.completions.create(model=HISTORY, messages=messages, max_tokens=9)
        prompt = engines[HISTORY].tokenizer.decode(asked[-1].prompt_token_ids)
        assert "<|im_start|>assistant\n<think>\nCheck the sky.\n</think>\n\nIt is blue.<|im_end|>" in prompt, prompt


# ---- Anthropic ----------------------------------------------------------------------------


def blocks(message) -> list[tuple]:
    return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None) or getattr(b, "input", None))
            for b in message.content]


@pytest.mark.parametrize("model, thought, answer", [
    (THINKER, THOUGHT, ANSWER), (OPENER, OPEN_THOUGHT, OPEN_ANSWER), (SPECIAL_THINKER, THOUGHT, ANSWER),
])
def test_anthropic_thinking_blocks(clients, model, thought, answer):
    claude, _ = clients
    done = claude.messages.create(model=model, max_tokens=64, messages=USER)
    assert blocks(done) == [("thinking", thought), ("text", answer)] and done.stop_reason == "end_turn"
    assert done.content[0].signature  # the SDK needs one to send the block back
    with claude.messages.stream(model=model, max_tokens=64, messages=USER) as stream:
        streamed = stream.get_final_message()
    # (usage aside: the second reads the first's prompt from the cache)
    assert streamed.model_dump(exclude={"id", "usage"}) == done.model_dump(exclude={"id", "usage"})
    assert streamed.usage.output_tokens == done.usage.output_tokens


def test_anthropic_stream_events_follow_anthropics_order(server):
    r = post(server, "/v1/messages", {"model": THINKER, "max_tokens": 64, "messages": USER, "stream": True})
    events = [(name, data) for name, data in parse_sse(r.text) if name not in ("ping",)]
    kinds = [(name, data.get("index"), (data.get("delta") or data.get("content_block") or {}).get("type"))
             for name, data in events]
    first_text = kinds.index(("content_block_start", 1, "text"))
    assert kinds[:2] == [("message_start", None, None), ("content_block_start", 0, "thinking")]
    assert set(kinds[2:first_text - 2]) == {("content_block_delta", 0, "thinking_delta")}
    assert kinds[first_text - 2:first_text] == [("content_block_delta", 0, "signature_delta"),
                                                ("content_block_stop", 0, None)]
    assert kinds[-3:] == [("content_block_stop", 1, None), ("message_delta", None, None), ("message_stop", None, None)]
    thinking = "".join(d["delta"]["thinking"] for n, d in events if (d.get("delta") or {}).get("type") == "thinking_delta")
    assert thinking == THOUGHT


def test_anthropic_display_omitted_keeps_the_block_without_its_text(clients, server):
    claude, _ = clients
    # (the interleaved-thinking beta lets the budget exceed max_tokens, within the 512-token context)
    beta = {"anthropic-beta": "interleaved-thinking-2025-05-14"}
    full = claude.messages.create(model=THINKER, max_tokens=64, messages=USER, extra_headers=beta,
                                  thinking={"type": "enabled", "budget_tokens": 1024})
    thinking = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    done = claude.messages.create(model=THINKER, max_tokens=64, messages=USER, thinking=thinking, extra_headers=beta)
    assert blocks(full) == [("thinking", THOUGHT), ("text", ANSWER)]
    assert blocks(done) == [("thinking", None), ("text", ANSWER)]
    assert done.content[0].thinking == "" and done.content[0].signature  # (it carries the thinking: see below)
    r = httpx.post(server[0].url + "/v1/messages", headers={"x-api-key": API_KEY, **beta}, timeout=60,
                   json={"model": THINKER, "max_tokens": 64, "messages": USER, "stream": True, "thinking": thinking})
    deltas = [d["delta"]["type"] for n, d in parse_sse(r.text) if n == "content_block_delta"]
    assert "thinking_delta" not in deltas and deltas[0] == "signature_delta"
    with claude.messages.stream(model=THINKER, max_tokens=64, messages=USER, thinking=thinking,
                                extra_headers=beta) as stream:
        assert stream.get_final_message().model_dump(exclude={"id"}) == done.model_dump(exclude={"id"})


def test_anthropic_thinking_cut_off_by_max_tokens(clients):
    assert_cut_off_is_all_thinking(clients[0], THINKER, USER, THOUGHT, 9)


def test_anthropic_tool_use_after_thinking(clients):
    claude, _ = clients
    done = claude.messages.create(model=TOOL_THINKER, max_tokens=128, messages=USER, tools=[WEATHER])
    assert blocks(done) == [("thinking", TOOL_THOUGHT), ("tool_use", {"city": "Paris"})]
    assert done.stop_reason == "tool_use"
    with claude.messages.stream(model=TOOL_THINKER, max_tokens=128, messages=USER, tools=[WEATHER]) as stream:
        streamed = stream.get_final_message()
    assert blocks(streamed) == blocks(done) and streamed.stop_reason == "tool_use"
    # The turn sent back as the SDK holds it (thinking, signature and all) is accepted and rendered
    messages = [*USER, {"role": "assistant", "content": [b.model_dump() for b in done.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": done.content[1].id,
                                              "content": "sunny"}]}]
    assert claude.messages.count_tokens(model=TOOL_THINKER, messages=messages, tools=[WEATHER]).input_tokens > 0


def test_anthropic_omitted_thinking_sent_back_gives_the_model_its_reasoning(server, clients, monkeypatch):
    """With display omitted the block's text is empty: its signature carries the thinking, as
    Anthropic's does, so a tool loop that sends the turn back still shows the model its reasoning."""
    _, engines = server
    claude, _ = clients
    beta = {"anthropic-beta": "interleaved-thinking-2025-05-14"}
    thinking = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    done = claude.messages.create(model=THINKER, max_tokens=64, messages=USER, thinking=thinking, extra_headers=beta)
    asked = record_requests(engines[HISTORY], monkeypatch)
    garbled = {"type": "thinking", "thinking": "", "signature": "tierlm-thinking:%%"}  # not base64: no thinking
    for block, shown in ((done.content[0].model_dump(), True), (garbled, False)):
        turn = [block, {"type": "text", "text": "It is blue."}]
        messages = [*USER, {"role": "assistant", "content": turn}, {"role": "user", "content": "Why?"}]
        counted = claude.messages.count_tokens(model=HISTORY, messages=messages)
        msg = claude.messages.create(model=HISTORY, max_tokens=4, messages=messages)
        prompt = engines[HISTORY].tokenizer.decode(asked[-1].prompt_token_ids)
        assert (f"<think>\n{THOUGHT}\n</think>\n\nIt is blue." in prompt) == shown, prompt
        assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_a_forced_call_turns_reasoning_off(server, clients, monkeypatch):
    """tool_choice required starts the answer with the call: there is no think block to look for,
    or to cap (the budget of a request whose answer thinks first reaches the engine)."""
    _, engines = server
    _, openai_client = clients
    asked = record_requests(engines[TOOL_THINKER], monkeypatch)
    for choice in ("auto", "required"):
        openai_client.chat.completions.create(model=TOOL_THINKER, messages=USER, max_tokens=32, tools=[OPENAI_WEATHER],
                                              tool_choice=choice, extra_body={"thinking_token_budget": 5})
    assert asked[0].params.thinking_budget.budget == 5 and asked[1].params.thinking_budget is None
    from tierlm.serving.generation import chat_prompt

    fmt = reasoning_format("auto", engines[TOOL_THINKER].tokenizer)
    tools = [OPENAI_WEATHER]
    prompts = [asyncio.run(chat_prompt(engines[TOOL_THINKER], TOOL_THINKER, USER, tools=tools, reasoning=fmt,
                                       call_required_by=required)) for required in (None, "required")]
    assert prompts[0].reasoning == fmt and prompts[1].reasoning is None and prompts[1].forced_prefix


def test_a_thinking_budget_ends_the_think_block(clients, server, monkeypatch):
    """vLLM's thinking_token_budget (and Anthropic's budget_tokens): once the block holds that
    many tokens its end marker is forced and the model answers (here, off its script, at once)."""
    _, engines = server
    claude, openai_client = clients
    looped = openai_client.chat.completions.create(model=PONDERER, messages=USER, max_tokens=12)
    assert looped.choices[0].finish_reason == "length" and looped.choices[0].message.content == ""
    capped = openai_client.chat.completions.create(model=PONDERER, messages=USER, max_tokens=12,
                                                   extra_body={"thinking_token_budget": 6})
    thought = capped.choices[0].message.model_extra["reasoning_content"]
    assert capped.choices[0].finish_reason == "stop" and capped.choices[0].message.content == ""
    assert looped.choices[0].message.model_extra["reasoning_content"].startswith(thought)
    assert thought.startswith("tick") and len(thought) < len(looped.choices[0].message.model_extra["reasoning"])
    assert capped.usage.completion_tokens == 6 + 2  # the budget, the forced </think>, then EOS
    streamed = openai_stream(openai_client, model=PONDERER, messages=USER, max_tokens=12,
                             extra_body={"thinking_token_budget": 6})
    assert streamed[:4] == (thought, "", [], "stop")
    # Anthropic's budget_tokens is the same cap (the engine request carries it), where the
    # markers are tokens of their own: THINKER spells them in ordinary tokens, so it has none
    beta = {"anthropic-beta": "interleaved-thinking-2025-05-14"}
    enabled = {"type": "enabled", "budget_tokens": 1500}
    for model, kept in ((SPECIAL_THINKER, True), (THINKER, False)):
        asked = record_requests(engines[model], monkeypatch)
        claude.messages.create(model=model, max_tokens=64, messages=USER, extra_headers=beta, thinking=enabled)
        claude.messages.create(model=model, max_tokens=64, messages=USER, thinking={"type": "adaptive"})
        assert asked[1].params.thinking_budget is None
        limit = asked[0].params.thinking_budget
        if not kept:
            assert limit is None
            continue
        tokenizer = engines[model].tokenizer
        assert (limit.budget, limit.starts_inside) == (1500, False)
        assert tokenizer.convert_ids_to_tokens(list(limit.end_token_ids + limit.start_token_ids)) == [
            "</think>", "<think>"]


def test_a_thinking_budget_for_a_model_without_think_markers_is_refused(openai_client, clients):
    # markers spelled in ordinary tokens: a budget could miss the model's own </think> and force
    # one into its answer
    _, reasoning_client = clients
    with pytest.raises(openai.BadRequestError, match="has no think markers tierlm can follow"):
        reasoning_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=4,
                                                 extra_body={"thinking_token_budget": 10})
    r = openai_client.post("/v1/chat/completions", json={"model": "scripted", "messages": USER, "max_tokens": 4,
                                                         "thinking_token_budget": 10})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
    assert "has no think markers tierlm can follow" in r.json()["error"]["message"]
    r = openai_client.post("/v1/chat/completions", json={"model": "scripted", "messages": USER, "max_tokens": 4,
                                                         "thinking_token_budget": -1})
    assert r.status_code == 400 and "thinking_token_budget" in r.text


# ---- a structured answer after the reasoning -------------------------------------------------

CHOICE_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok"],
                 "properties": {"ok": {"enum": ["yes", "no"]}}}
CHOICES = ('{"ok": "yes"}', '{"ok": "no"}')
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "ok", "schema": CHOICE_SCHEMA}}
ANTHROPIC_FORMAT = {"format": {"type": "json_schema", "schema": CHOICE_SCHEMA}}


@pytest.mark.parametrize("model, thought", [(SPECIAL_THINKER, THOUGHT), (OPENER, OPEN_THOUGHT)])
def test_a_structured_answer_thinks_first_then_keeps_to_its_grammar(clients, model, thought):
    """As vLLM with a reasoning parser and Anthropic's output_config.format with thinking: the
    model thinks unconstrained (THOUGHT's words are no JSON), and its answer after </think> follows
    the schema (the script's own answer, prose, is not). It opened the block, or the prompt did."""
    claude, openai_client = clients
    for seed in range(3):
        done = openai_client.chat.completions.create(model=model, messages=USER, max_tokens=64, seed=seed,
                                                     response_format=JSON_FORMAT)
        message = done.choices[0].message
        assert message.model_extra == {"reasoning_content": thought, "reasoning": thought}
        assert message.content in CHOICES and done.choices[0].finish_reason == "stop", message.content
        streamed = openai_stream(openai_client, model=model, messages=USER, max_tokens=64, seed=seed,
                                 response_format=JSON_FORMAT)
        assert streamed[:4] == (thought, message.content, [], "stop")
    thinking = {"type": "enabled", "budget_tokens": 1024}
    beta = {"anthropic-beta": "interleaved-thinking-2025-05-14"}  # (a budget above max_tokens)
    for kwargs in ({}, {"thinking": thinking, "extra_headers": beta}):
        done = claude.messages.create(model=model, max_tokens=64, messages=USER, output_config=ANTHROPIC_FORMAT,
                                      **kwargs)
        assert blocks(done)[0] == ("thinking", thought) and done.stop_reason == "end_turn"
        assert [b.type for b in done.content] == ["thinking", "text"] and done.content[1].text in CHOICES
        with claude.messages.stream(model=model, max_tokens=64, messages=USER, output_config=ANTHROPIC_FORMAT,
                                    **kwargs) as stream:
            streamed = stream.get_final_message()
        # (sampled unseeded: the answer may differ, not its shape)
        assert blocks(streamed)[0] == ("thinking", thought) and streamed.content[1].text in CHOICES


def test_a_structured_answer_beside_tools_thinks_first_and_is_never_a_call(clients):
    """TOOL_THINKER thinks, then writes a call: under a structured output the call's place is the
    grammar's, and the answer is never read for calls."""
    claude, openai_client = clients
    done = openai_client.chat.completions.create(model=TOOL_THINKER, messages=USER, max_tokens=64,
                                                 tools=[OPENAI_WEATHER], response_format=JSON_FORMAT)
    choice = done.choices[0]
    assert choice.message.model_extra["reasoning_content"] == TOOL_THOUGHT and not choice.message.tool_calls
    assert choice.message.content in CHOICES and choice.finish_reason == "stop"
    message = claude.messages.create(model=TOOL_THINKER, max_tokens=64, messages=USER, tools=[WEATHER],
                                     output_config=ANTHROPIC_FORMAT)
    assert blocks(message)[0] == ("thinking", TOOL_THOUGHT) and [b.type for b in message.content] == [
        "thinking", "text"] and message.content[1].text in CHOICES


def test_a_thinking_budget_beside_a_structured_output_ends_the_thinking_then_the_grammar_holds(
        clients, server, monkeypatch):
    """It was refused (its forced </think> was off the grammar): now the forced marker ends the
    thinking, and the answer keeps to the schema."""
    _, engines = server
    claude, openai_client = clients
    budget = {"thinking_token_budget": 6}
    done = openai_client.chat.completions.create(model=PONDERER, messages=USER, max_tokens=40, extra_body=budget,
                                                 response_format=JSON_FORMAT)
    message = done.choices[0].message
    capped = openai_client.chat.completions.create(model=PONDERER, messages=USER, max_tokens=40, extra_body=budget)
    assert message.model_extra["reasoning_content"] == capped.choices[0].message.model_extra["reasoning_content"]
    assert message.content in CHOICES and done.choices[0].finish_reason == "stop"
    streamed = openai_stream(openai_client, model=PONDERER, messages=USER, max_tokens=40, extra_body=budget,
                             response_format=JSON_FORMAT)
    assert streamed[0] == message.model_extra["reasoning_content"] and streamed[1] in CHOICES
    # no budget: it thinks until max_tokens, unconstrained, and gives no answer
    looped = openai_client.chat.completions.create(model=PONDERER, messages=USER, max_tokens=12,
                                                   response_format=JSON_FORMAT).choices[0]
    assert looped.finish_reason == "length" and looped.message.content == ""
    # Anthropic's budget_tokens: the engine request waits for the budget's block
    asked = record_requests(engines[SPECIAL_THINKER], monkeypatch)
    claude.messages.create(model=SPECIAL_THINKER, max_tokens=64, messages=USER, output_config=ANTHROPIC_FORMAT,
                           thinking={"type": "enabled", "budget_tokens": 1024},
                           extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    params = asked[0].params
    tokenizer = engines[SPECIAL_THINKER].tokenizer
    block = params.structured_outputs.after_reasoning
    assert params.thinking_budget.budget == 1024 and (block.starts_inside, *tokenizer.convert_ids_to_tokens(
        [block.start_token_id, block.end_token_id])) == (False, "<think>", "</think>")


def test_a_structured_answer_whose_markers_are_not_tokens_is_never_reasoning(clients, server, monkeypatch):
    """THINKER spells <think> and </think> in ordinary tokens: the engine could not see its block
    end, so its structured answer follows the grammar from its first token, and is not parsed for
    reasoning."""
    _, engines = server
    claude, openai_client = clients
    asked = record_requests(engines[THINKER], monkeypatch)
    message = openai_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=8,
                                                    extra_body={"guided_choice": ["yes", "no"]}).choices[0].message
    assert message.content in ("yes", "no") and "reasoning_content" not in (message.model_extra or {})
    done = claude.messages.create(model=THINKER, max_tokens=16, messages=USER,
                                  output_config={"format": {"type": "json_schema", "schema": {"enum": [1, 2]}}})
    assert [(b.type, b.text) for b in done.content] in ([("text", "1")], [("text", "2")])
    assert [r.params.structured_outputs.after_reasoning for r in asked] == [None, None]


def test_reasoning_parser_none_leaves_the_answer_as_text(models):
    engine = models[THINKER].engine(THINKER)
    server = ServerThread(build_app({THINKER: engine}, ApiKeyAuth.from_keys({"alice": API_KEY}),
                                    reasoning_parser="none")).start()
    try:
        claude, openai_client = sdk_clients(server.url)
        done = claude.messages.create(model=THINKER, max_tokens=64, messages=USER)
        assert blocks(done) == [("text", THINKING_REPLY)]
        message = openai_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=64).choices[0].message
        assert (message.content, message.model_extra) == (THINKING_REPLY, {})
    finally:
        server.stop()
    with pytest.raises(ValueError, match="unknown reasoning parser 'on'"):
        build_app({THINKER: engine}, ApiKeyAuth.from_keys({"alice": API_KEY}), reasoning_parser="on")


def test_a_structured_answer_with_thinking_switched_off_may_not_open_a_block(clients, server, monkeypatch):
    """Qwen3's enable_thinking false (Anthropic's thinking disabled) ends the prompt with an empty
    block: the grammar holds from the first token, and <think> is not among the tokens it may be
    (offering it there pushed a model told not to think into thinking)."""
    _, engines = server
    claude, openai_client = clients
    asked = record_requests(engines[SPECIAL_THINKER], monkeypatch)
    done = openai_client.chat.completions.create(
        model=SPECIAL_THINKER, messages=USER, max_tokens=16, response_format=JSON_FORMAT,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "thinking_token_budget": 4})
    assert done.choices[0].message.content in CHOICES
    claude.messages.create(model=SPECIAL_THINKER, max_tokens=16, messages=USER, output_config=ANTHROPIC_FORMAT,
                           thinking={"type": "disabled"})
    openai_client.chat.completions.create(model=SPECIAL_THINKER, messages=USER, max_tokens=16,
                                          response_format=JSON_FORMAT)  # thinking on: the answer may open one
    blocks_asked = [r.params.structured_outputs.after_reasoning for r in asked]
    assert [b.start_token_id is None for b in blocks_asked] == [True, True, False]
    assert asked[0].params.thinking_budget is None  # (no block to cap)
    assert "<think>\n\n</think>" in engines[SPECIAL_THINKER].tokenizer.decode(asked[0].prompt_token_ids)


# ---- the safety layer reads what the client does ------------------------------------------------

def think_masked(text: str, cuts: tuple[int, ...], fmt: ReasoningFormat, in_reasoning: bool = False,
                 continuing: bool = False) -> str:
    """`text` fed in pieces cut at `cuts` to a recording splitter, as the safety layer scans it:
    the characters its markup spans cover as "#" (the undecided tail never scanned before the end)."""
    splitter = ReasoningSplitter(fmt, in_reasoning, continuing).record()
    hidden, decided_before = [], 0
    for a, b in itertools.pairwise((0, *cuts, len(text))):
        splitter.feed(text[a:b])
        decided, spans = splitter.markup()
        assert decided_before <= decided <= b and all(e <= decided for _, e in spans), (spans, decided)
        hidden, decided_before = hidden + spans, decided
    splitter.finish()
    decided, spans = splitter.markup()
    assert decided == len(text)
    out = list(text)
    for s, e in hidden + spans:
        out[s:e] = "#" * (e - s)
    return "".join(out)


@pytest.mark.parametrize("fmt", [FMT, WRAPPED], ids=["plain", "kept-tokens"])
def test_markup_is_what_the_client_never_sees_however_the_text_is_cut(fmt):
    """The spans the safety layer does not read (think markers, the blank space dropped around
    them, kept tokens in the reasoning) come out the same for every cut, and what is left is
    exactly what the client is shown: the reasoning, then the text."""
    rng = random.Random(11)
    alphabet = ["<think>", "</think>", "<", "/", "t", "h", "i", "n", "k", ">", " ", "\n", "x", "é",
                fmt.answer_start, fmt.answer_end, "\ufdd0[TOOL_CALLS]\ufdd1"]
    texts = [THINKING_REPLY, OPEN_REPLY, TOOL_REPLY, "  <think> a  </think>  b  ", "a\n\n b  </think>  c  "]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14))) for _ in range(300)]
    for text, (in_reasoning, continuing) in itertools.product(texts, [(False, False), (True, False), (True, True)]):
        reasoning, shown = split_reasoning(text, fmt, in_reasoning, continuing)
        whole = think_masked(text, (), fmt, in_reasoning, continuing)
        assert whole.replace("#", "") == reasoning + shown, (text, whole)
        for _ in range(4):
            cuts = tuple(sorted(rng.sample(range(1, len(text)), max(0, min(len(text) - 1, rng.randint(1, 6))))))
            assert think_masked(text, cuts, fmt, in_reasoning, continuing) == whole, (text, cuts)
    assert think_masked(THINKING_REPLY, (), FMT) == "#" * 7 + THOUGHT + "#" * 11 + ANSWER


@pytest.mark.parametrize("fmt", [FMT, WRAPPED], ids=["plain", "kept-tokens"])
def test_a_guarded_think_answer_is_redacted_where_the_client_reads_it(fmt, tmp_path):
    """Through an output guard reading the think markup, however the answer is cut: "think"
    (whole word) is redacted in the reasoning and in the text, a marker written as text included
    ("Hello <think>" shows it), never in a marker the splitter takes out (which showed the
    reasoning as text, `<~>The user...`)."""
    from tests.serving.test_safety_policies import _rules, deltas
    from tierlm.serving.safety import OutputGuard

    rules = _rules(tmp_path, "[policies.r]\nphrases = ['think']\nwhole_word = true\naction = 'redact'\n"
                             "replacement = '~'\n")
    s, e = fmt.answer_start, fmt.answer_end
    cases = [(f"\n{s}\nI think, so.\n{e}\n\nthink again <think>", False, ("I ~, so.", "~ again <~>")),
             (f"{s}{THOUGHT}\n{e}\n\n{ANSWER}", False, (THOUGHT, ANSWER)),
             (f"{OPEN_THOUGHT}\n{e}\n\n{OPEN_ANSWER}", True, (OPEN_THOUGHT, OPEN_ANSWER)),
             (f"{s}\n{s}think\n\n", True, ("~", ""))]
    rng = random.Random(3)
    for text, in_reasoning, expected in cases:
        for cuts in [(), *(tuple(sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, 6)))) for _ in range(30))]:
            pieces = [text[a:b] for a, b in itertools.pairwise((0, *cuts, len(text)))]
            guard = OutputGuard(rules, ReasoningSplitter(fmt, in_reasoning).record())
            shown = "".join(d.text for delta in deltas(pieces) for d in guard.feed(delta)[0])
            assert split_reasoning(shown, fmt, in_reasoning) == expected, (text, cuts, shown)


MUSER = "muser"
MUSE, MUSED = "Users think alike.", "I think so."
GUARDED_KEYS = {"blk": "sk-blk", "red": "sk-red"}
GUARDED_TENANTS = tenants_file({"blk": "bronze", "red": "gold"})
# A word the think markers spell (whole word: "<" and ">" end it), stopped for one tenant, masked for the other
GUARDED_POLICIES = output_policies_file([("stop", ["think"], "block", "blk"), ("mask", ["think"], "redact", "red")],
                                        whole_word=True)


@pytest.fixture(scope="module")
def guarded(demo_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning-guarded")
    markers = ("<think>", "</think>")
    models = build_templated_models(root, demo_tokenizer, [
        (THINKER, THINK_TEMPLATE, THINKING_REPLY, ()), (SPECIAL_THINKER, THINK_TEMPLATE, THINKING_REPLY, markers),
        (OPENER, OPEN_TEMPLATE, OPEN_REPLY, markers),
        (MUSER, THINK_TEMPLATE, f"<think>{MUSE}\n</think>\n\n{MUSED}", markers),
    ])
    server = guarded_server(root, {name: model.engine(name) for name, model in models.items()}, GUARDED_KEYS,
                            GUARDED_TENANTS, GUARDED_POLICIES)
    yield server
    server.stop()


@pytest.mark.parametrize("key", ["blk", "red"])
def test_output_policies_do_not_read_think_markers(guarded, key):
    """A whole-word "think" neither stops nor redacts a think model's answer at its markers,
    which the client never sees (kept special tokens, plain text, a block the prompt opened):
    it stopped every answer at its first marker (content_filter, nothing shown), or masked the
    marker, so that the reasoning came back as text (`<[x]>The user greets me.`)."""
    claude, openai_client = sdk_clients(guarded.url, GUARDED_KEYS[key])
    for model, thought, answer, plain in [(THINKER, THOUGHT, ANSWER, True), (SPECIAL_THINKER, THOUGHT, ANSWER, True),
                                          (SPECIAL_THINKER, THOUGHT, ANSWER, False),
                                          (OPENER, OPEN_THOUGHT, OPEN_ANSWER, True)]:
        kwargs = dict(model=model, messages=USER, max_tokens=64, extra_body={"skip_special_tokens": plain})
        choice = openai_client.chat.completions.create(**kwargs).choices[0]
        assert (choice.finish_reason, choice.message.model_extra["reasoning"], choice.message.content) == (
            "stop", thought, answer), (model, plain)
        assert openai_stream(openai_client, **kwargs)[:4] == (thought, answer, [], "stop"), (model, plain)
        if not plain:
            continue
        message = claude.messages.create(model=model, max_tokens=64, messages=USER)
        assert (message.stop_reason, blocks(message)) == ("end_turn", [("thinking", thought), ("text", answer)])
        with claude.messages.stream(model=model, max_tokens=64, messages=USER) as stream:
            streamed = stream.get_final_message()
        assert (streamed.stop_reason, blocks(streamed)) == ("end_turn", [("thinking", thought), ("text", answer)])
    response = openai_client.responses.create(model=SPECIAL_THINKER, input="Hi")
    assert response.status == "completed" and response.output_text == ANSWER


def test_output_policies_still_read_think_in_the_reasoning_and_the_answer(guarded):
    claude, openai_client = sdk_clients(guarded.url, GUARDED_KEYS["red"])
    redacted = (MUSE.replace("think", "[x]"), MUSED.replace("think", "[x]"))
    kwargs = dict(model=MUSER, messages=USER, max_tokens=64)
    choice = openai_client.chat.completions.create(**kwargs).choices[0]
    assert (choice.message.model_extra["reasoning"], choice.message.content) == redacted
    assert openai_stream(openai_client, **kwargs)[:4] == (*redacted, [], "stop")
    message = claude.messages.create(model=MUSER, max_tokens=64, messages=USER)
    assert blocks(message) == [("thinking", redacted[0]), ("text", redacted[1])]
    with claude.messages.stream(model=MUSER, max_tokens=64, messages=USER) as stream:
        assert blocks(stream.get_final_message()) == [("thinking", redacted[0]), ("text", redacted[1])]
    claude, openai_client = sdk_clients(guarded.url, GUARDED_KEYS["blk"])
    choice = openai_client.chat.completions.create(**kwargs).choices[0]
    shown = (choice.message.model_extra or {}).get("reasoning") or ""
    assert choice.finish_reason == "content_filter" and "think" not in shown + (choice.message.content or "")
    assert MUSE.startswith(shown)
    reasoning, content, _, finish, _ = openai_stream(openai_client, **kwargs)
    assert finish == "content_filter" and MUSE.startswith(reasoning) and content == ""
    message = claude.messages.create(model=MUSER, max_tokens=64, messages=USER)
    assert message.stop_reason == "refusal" and all("think" not in str(b[1]) for b in blocks(message))
    with claude.messages.stream(model=MUSER, max_tokens=64, messages=USER) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "refusal" and all("think" not in str(b[1]) for b in blocks(streamed))
