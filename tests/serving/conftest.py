"""Servers for the serving tests, started once per session on 127.0.0.1 (free port).

- `fake_server`: the app over a scripted `FakeEngine` (model "fake-model"); use the `fake`
  fixture to script replies for one test (it is reset around each test).
- `demo_server`: the app over the real `AsyncEngine` with the built-in demo model (random
  weights: gibberish text, real scheduling, paged KV and prefix cache); its engine is
  `demo_engine`.
Both require the key `API_KEY` and cap bodies at `SMALL_BODY_LIMIT` bytes.
"""
from __future__ import annotations

from typing import Iterator

import pytest

from tests.serving.fakes import API_KEY, SMALL_BODY_LIMIT, FakeEngine, ServerThread
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth


@pytest.fixture(scope="session")
def demo_tokenizer(tmp_path_factory):
    from tierlm.models.demo import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("demo-tokenizer"))


@pytest.fixture(scope="session")
def fake_engine(demo_tokenizer) -> FakeEngine:
    return FakeEngine(demo_tokenizer)


@pytest.fixture(scope="session")
def fake_server(fake_engine) -> Iterator[ServerThread]:
    app = build_app({fake_engine.model_name: fake_engine}, ApiKeyAuth.from_keys({"alice": API_KEY}),
                    max_body_bytes=SMALL_BODY_LIMIT)
    server = ServerThread(app).start()
    yield server
    server.stop()


@pytest.fixture
def fake(fake_engine, fake_server) -> Iterator[FakeEngine]:
    fake_engine.reset()
    fake_engine.started = True
    yield fake_engine
    fake_engine.reset()
    fake_engine.started = True


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
