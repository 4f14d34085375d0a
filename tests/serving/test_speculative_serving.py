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
