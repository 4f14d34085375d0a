"""OpenAI's /v1/embeddings through the official `openai` SDK against the real server on the
built-in demo model: vectors equal to transformers' last hidden state on the same checkpoint,
base64 (the SDK's default) and float encodings, token inputs, usage and metrics counting every
input once, and errors in OpenAI's shape that run nothing."""
from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch

from tests.serving.harness import API_KEY, record_requests, sdk_clients
from tests.serving.test_telemetry import value

TEXTS = ["The quick brown fox jumps over the lazy dog.", "A tiered cache keeps hot blocks close to the device.", "hi"]


@pytest.fixture(scope="module")
def oai(demo_server) -> openai.OpenAI:
    return sdk_clients(demo_server.url)[1]


@pytest.fixture(scope="module")
def last_hidden(demo_engine):
    """transformers' final hidden state at a prompt's last token (the base model's output)."""
    from transformers import AutoModel

    base = AutoModel.from_pretrained(str(demo_engine.engine.model_dir), dtype=torch.float32).eval()

    def at_last(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return base(torch.tensor([ids])).last_hidden_state[0, -1]

    return at_last


def _metrics(server) -> str:
    with httpx.Client(base_url=server.url, timeout=30, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        return c.get("/metrics").text


def test_embeddings_through_the_sdk_are_transformers_last_hidden_state(oai, demo_engine, last_hidden):
    """A batch of texts (the SDK asks for base64 and decodes it): one unit vector per input, in
    order, equal to transformers' normalised last hidden state; usage counts every input."""
    done = oai.embeddings.create(model=demo_engine.model_name, input=TEXTS)
    assert [d.index for d in done.data] == [0, 1, 2] and done.model == demo_engine.model_name
    for text, item in zip(TEXTS, done.data):
        want = torch.nn.functional.normalize(last_hidden(demo_engine.encode(text)), dim=0)
        torch.testing.assert_close(torch.tensor(item.embedding), want, rtol=1e-4, atol=1e-5)
    tokens = sum(len(demo_engine.encode(t)) for t in TEXTS)
    assert done.usage.prompt_tokens == done.usage.total_tokens == tokens


def test_float_and_base64_encodings_and_token_inputs_agree(demo_server, demo_engine, last_hidden):
    """encoding_format float gives the numbers; base64 their little-endian float32 bytes; token
    ids embed as their text does; normalize false (vLLM's) gives the raw hidden state."""
    ids = demo_engine.encode(TEXTS[0])
    with httpx.Client(base_url=demo_server.url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        as_float = c.post("/v1/embeddings", json={"model": demo_engine.model_name, "input": TEXTS[0],
                                                  "encoding_format": "float"}).json()
        as_b64 = c.post("/v1/embeddings", json={"model": demo_engine.model_name, "input": [ids],
                                                "encoding_format": "base64"}).json()
        raw = c.post("/v1/embeddings", json={"model": demo_engine.model_name, "input": ids, "normalize": False,
                                             "encoding_format": "float"}).json()
    vec = as_float["data"][0]["embedding"]
    packed = base64.b64decode(as_b64["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(vec, abs=1e-6)
    torch.testing.assert_close(torch.tensor(raw["data"][0]["embedding"]), last_hidden(ids), rtol=1e-4, atol=1e-4)
    assert as_float["object"] == "list" and as_float["data"][0]["object"] == "embedding"


def test_each_input_counts_once_in_the_metrics_and_batched_completions_too(demo_server, oai, demo_engine):
    """tierlm:prompt_tokens grows by every input's tokens (a batch of inputs, or of completion
    prompts, is several prompts, not one counted once)."""
    model = demo_engine.model_name
    before = value(_metrics(demo_server), "tierlm:prompt_tokens_total", model=model)
    oai.embeddings.create(model=model, input=TEXTS[:2])
    done = oai.completions.create(model=model, prompt=TEXTS[:2], n=2, max_tokens=2)
    after = value(_metrics(demo_server), "tierlm:prompt_tokens_total", model=model)
    tokens = sum(len(demo_engine.encode(t)) for t in TEXTS[:2])
    assert done.usage.prompt_tokens == tokens
    assert after - before == 2 * tokens


def test_bad_embedding_requests_are_refused_in_openais_shape_and_run_nothing(oai, demo_engine, monkeypatch):
    admitted = record_requests(demo_engine, monkeypatch)
    model = demo_engine.model_name
    for kwargs, param in (({"input": ["fine", ""]}, "input"), ({"input": "x", "dimensions": 3}, "dimensions"),
                          ({"input": ["fine", "x " * 5000]}, "input.1"), ({"input": [[1, 2], [10**6]]}, "input.1"),
                          ({"input": ["a"] * 2049}, "input")):
        with pytest.raises(openai.BadRequestError) as info:
            oai.embeddings.create(model=model, **kwargs)
        assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="no-such-model", input="x")
    assert admitted == []
    # a whole context's worth of tokens is embedded (nothing is generated), one more is a 400
    context = demo_engine.max_model_len
    whole = oai.embeddings.create(model=model, input=[[7] * context])
    assert whole.usage.prompt_tokens == context and len(admitted) == 1
    with pytest.raises(openai.BadRequestError) as info:
        oai.embeddings.create(model=model, input=[[7] * (context + 1)])
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "input"
    assert f"your prompt resulted in {context + 1} tokens" in info.value.body["message"] and len(admitted) == 1


def test_more_inputs_than_the_context_holds_tokens_are_a_batch_not_one_long_prompt(oai, demo_engine):
    """An embeddings batch's items are whole prompts: more of them than the context has tokens
    is fine (the guard against chat bodies of a million content blocks counted them as parts of
    one prompt: 1,025 one-token inputs were a 400 about "tools, messages and content blocks"),
    and a flat list of ids longer than the context is one prompt that truncate_prompt_tokens
    may cut, as on /v1/completions."""
    model, context = demo_engine.model_name, demo_engine.max_model_len
    many = oai.embeddings.create(model=model, input=[[7 + i % 50] for i in range(context + 1)])
    assert len(many.data) == context + 1 and many.usage.prompt_tokens == context + 1
    assert many.data[3].embedding == pytest.approx(many.data[53].embedding, abs=1e-5)  # same id, same vector
    assert many.data[3].embedding != pytest.approx(many.data[4].embedding, abs=1e-3)
    ids = [9 + i % 300 for i in range(context + 40)]
    for keep in (context, -1, 10):
        cut = oai.embeddings.create(model=model, input=ids, extra_body={"truncate_prompt_tokens": keep})
        kept = context if keep == -1 else keep
        assert cut.usage.prompt_tokens == kept
        alone = oai.embeddings.create(model=model, input=[ids[-kept:]])  # the last tokens are kept
        assert cut.data[0].embedding == pytest.approx(alone.data[0].embedding, abs=1e-5)
    with pytest.raises(openai.BadRequestError) as info:  # not cut: one prompt past the context
        oai.embeddings.create(model=model, input=ids)
    assert info.value.body["code"] == "context_length_exceeded"
    assert f"your prompt resulted in {context + 40} tokens" in info.value.body["message"]


def test_dimensions_shorten_a_matryoshka_models_embeddings(llama_dir, tmp_path):
    """`dimensions` through the SDK, for a model whose config.json lists matryoshka_dimensions:
    the full vector's first N entries, normalised again; a length it does not list is a 400."""
    import json
    import shutil

    from tests.serving.harness import ServerThread
    from tierlm.engine.async_engine import AsyncEngine
    from tierlm.serving.app import build_app
    from tierlm.serving.auth import NoAuth

    d = tmp_path / "mrl"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [8, 64]}))
    engine = AsyncEngine.from_model(str(d), dtype="float32", load_progress=False)
    server = ServerThread(build_app({"mrl": engine}, NoAuth())).start()
    try:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        full = oai.embeddings.create(model="mrl", input=[5, 6, 7, 8]).data[0].embedding
        short = oai.embeddings.create(model="mrl", input=[5, 6, 7, 8], dimensions=8).data[0].embedding
        assert len(full) == 64 and len(short) == 8
        want = torch.nn.functional.normalize(torch.tensor(full[:8]), dim=0)
        torch.testing.assert_close(torch.tensor(short), want, rtol=1e-4, atol=1e-5)
        with pytest.raises(openai.BadRequestError, match="matryoshka_dimensions"):
            oai.embeddings.create(model="mrl", input="x", dimensions=16)
    finally:
        server.stop()
