"""Servers for the serving tests, started once per session on 127.0.0.1 (free port). Both run
the real `AsyncEngine`; neither fakes any part of the stack.

- `scripted_server`: the scripted models of `scripted_model.py` (tiny real checkpoints whose
  answers are set in their weights: known text, EOS where wanted, tool calls, endless
  replies), one engine each (`scripted_engines`), for exact protocol assertions;
  `requests_to(model)` records what one of those engines is asked.
- `demo_server`: the built-in demo model (random weights: gibberish text, real scheduling,
  paged KV and prefix cache); its engine is `demo_engine`.
Both require the key `API_KEY` and cap bodies at `SMALL_BODY_LIMIT` bytes.
"""
from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from tests.serving.harness import API_KEY, SMALL_BODY_LIMIT, ServerThread, record_requests
from tests.serving.scripted_model import ScriptedModel, build_scripted_model, serving_scripts
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth


@pytest.fixture(scope="session")
def demo_tokenizer(tmp_path_factory):
    from tierlm.models.demo import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("demo-tokenizer"))


@pytest.fixture(scope="session")
def scripted_models(demo_tokenizer, tmp_path_factory) -> dict[str, ScriptedModel]:
    root = tmp_path_factory.mktemp("scripted")
    return {name: build_scripted_model(root / name, scripts, demo_tokenizer)
            for name, scripts in serving_scripts(demo_tokenizer).items()}


@pytest.fixture(scope="session")
def scripted_engines(scripted_models) -> dict:
    return {name: model.engine(name) for name, model in scripted_models.items()}


@pytest.fixture(scope="session")
def scripted_server(scripted_engines) -> Iterator[ServerThread]:
    app = build_app(scripted_engines, ApiKeyAuth.from_keys({"alice": API_KEY}), max_body_bytes=SMALL_BODY_LIMIT)
    server = ServerThread(app).start()
    yield server
    server.stop()


@pytest.fixture
def openai_client(scripted_server) -> Iterator[httpx.Client]:
    """An HTTP client of the scripted server, with the key as OpenAI clients send it."""
    with httpx.Client(base_url=scripted_server.url, timeout=30, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture
def requests_to(scripted_engines, monkeypatch):
    """`requests_to(model)`: the requests that scripted model's engine admits from then on, as
    the engine built them (prompt ids, SamplingParams, request id)."""
    return lambda model: record_requests(scripted_engines[model], monkeypatch)


@pytest.fixture(scope="session")
def demo_engine():
    from tierlm.engine.async_engine import AsyncEngine

    return AsyncEngine.from_model(None, device="cpu", max_model_len=1024, kv_cache_memory=32 << 20,
                                  max_num_seqs=64, load_progress=False)


@pytest.fixture(scope="session")
def demo_server(demo_engine) -> Iterator[ServerThread]:
    app = build_app({demo_engine.model_name: demo_engine}, ApiKeyAuth.from_keys({"alice": API_KEY}),
                    max_body_bytes=SMALL_BODY_LIMIT)
    server = ServerThread(app).start()
    yield server
    server.stop()
