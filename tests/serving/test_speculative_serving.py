"""Speculative decoding behind the HTTP server: a step may give a request several tokens, and
the streams (official SDKs) carry exactly what the same model gives without speculation."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.serving.harness import ServerThread
from tests.serving.test_telemetry import samples, value
from tierlm.engine.async_engine import AsyncEngine
from tierlm.serving.app import build_app
from tierlm.serving.auth import NoAuth

LOOP = [7, 8, 9, 10, 11] * 6


@pytest.fixture(scope="module")
def server(llama_dir):
    kw = dict(dtype="float32", block_size=4, load_progress=False)
    engines = {"plain": AsyncEngine.from_model(str(llama_dir), served_model_name="plain", **kw),
               "spec": AsyncEngine.from_model(str(llama_dir), served_model_name="spec", **kw,
                                              speculative_config={"num_speculative_tokens": 4,
                                                                  "prompt_lookup_min": 1})}
    srv = ServerThread(build_app(engines, NoAuth())).start()
    yield srv
    srv.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_streamed_completions_match_the_model_without_speculation(server):
    client = _client(server)
    texts = {}
    for model in ("plain", "spec"):
        stream = client.completions.create(model=model, prompt=LOOP, max_tokens=40, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        texts[model] = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage.completion_tokens == 40 and usage.prompt_tokens == len(LOOP)
        whole = client.completions.create(model=model, prompt=LOOP, max_tokens=40, temperature=0)
        assert whole.choices[0].text == texts[model]
    assert texts["spec"] == texts["plain"] and texts["plain"]
    s = samples(httpx.get(server.url + "/metrics").text)
    assert value(s, "tierlm:spec_decode_num_accepted_tokens_total", model="spec") > 0
    assert value(s, "tierlm:spec_decode_num_draft_tokens_total", model="plain") == 0


def test_chat_with_stop_and_logprobs_matches_too(server):
    client = _client(server)
    got = {}
    for model in ("plain", "spec"):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "abc abc abc abc"}],
                                           max_tokens=24, temperature=0, logprobs=True, top_logprobs=2)
        c = r.choices[0]
        got[model] = (c.message.content, c.finish_reason, [t.token for t in c.logprobs.content],
                      r.usage.completion_tokens)
    assert got["spec"] == got["plain"]


def _phrase_from(text: str, after: int) -> str:
    """Four characters of `text`, first found past `after`, that are words to the safety layer
    (white space collapses, so none), as a policy would name them."""
    for at in range(after, len(text) - 4):
        piece = text[at:at + 4]
        if (piece.isprintable() and not any(ch.isspace() or ch in "\\'\"" for ch in piece)
                and text.find(piece) == at):
            return piece
    raise AssertionError(f"no phrase to use in {text!r}")


def test_output_policies_see_an_accepted_run_as_the_stream_it_is(llama_dir, tmp_path):
    """Tokens of one step's accepted guesses are read by the safety layer one by one: a blocked
    phrase inside them stops the answer where it stops without speculation, a redacted one is
    replaced, and streamed and whole answers (text, reason, usage) agree with the plain model's."""
    from tierlm import LLM, SamplingParams
    from tierlm.serving.safety import SafetyPolicies
    kw = dict(dtype="float32", block_size=4, load_progress=False)
    ref = LLM(str(llama_dir), **kw)
    text = ref.generate({"prompt_token_ids": LOOP}, SamplingParams(max_tokens=40, temperature=0,
                                                                   ignore_eos=True))[0].outputs[0].text
    redacted = _phrase_from(text, 4)
    blocked = _phrase_from(text, text.find(redacted) + 8)  # (after it: the redaction is shown first)
    (tmp_path / "p.toml").write_text(f'[policies.blk]\nphrases = [{blocked!r}]\ncheck = "output"\n'
                                     f'[policies.red]\nphrases = [{redacted!r}]\ncheck = "output"\n'
                                     'action = "redact"\nreplacement = "[x]"\n')
    safety = SafetyPolicies.from_file(tmp_path / "p.toml")
    engines = {"plain": AsyncEngine.from_model(str(llama_dir), served_model_name="plain", **kw),
               "spec": AsyncEngine.from_model(str(llama_dir), served_model_name="spec", **kw,
                                              speculative_config={"num_speculative_tokens": 4,
                                                                  "prompt_lookup_min": 1})}
    srv = ServerThread(build_app(engines, NoAuth(), safety=safety)).start()
    try:
        client = _client(srv)
        got = {}
        for model in ("plain", "spec"):
            args = dict(model=model, prompt=LOOP, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
            whole = client.completions.create(**args)
            chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
            streamed = ("".join(c.choices[0].text for c in chunks if c.choices),
                        [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1],
                        chunks[-1].usage.completion_tokens)
            got[model] = (whole.choices[0].text, whole.choices[0].finish_reason, whole.usage.completion_tokens)
            assert streamed == got[model]
        assert got["spec"] == got["plain"]
        shown, reason, used = got["spec"]
        assert reason == "content_filter" and blocked.casefold() not in shown.casefold() and used < 40
        assert "[x]" in shown and redacted not in shown, (shown, blocked, redacted)
        s = samples(httpx.get(srv.url + "/metrics").text)
        assert value(s, "tierlm:spec_decode_num_accepted_tokens_total", model="spec") > 0
    finally:
        srv.stop()
