"""Health probes, client disconnects and graceful shutdown."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.serving.fakes import API_KEY, FakeEngine, ServerThread, parse_sse
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth, NoAuth

HEADERS = {"x-api-key": API_KEY}
LONG_REPLY = "word " * 400


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def stream_body(**fields):
    return {"model": "fake-model", "max_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": "talk"}], **fields}


def test_health_and_ready_need_no_key(fake_server):
    assert httpx.get(fake_server.url + "/health").json() == {"status": "ok"}
    r = httpx.get(fake_server.url + "/ready")
    assert r.status_code == 200 and r.json() == {"status": "ready", "models": ["fake-model"]}


def test_models_list_and_get(fake_server):
    listing = httpx.get(fake_server.url + "/v1/models", headers=HEADERS).json()
    assert [m["id"] for m in listing["data"]] == ["fake-model"] and listing["has_more"] is False
    one = httpx.get(fake_server.url + "/v1/models/fake-model", headers=HEADERS).json()
    assert one["type"] == "model" and one["object"] == "model"
    r = httpx.get(fake_server.url + "/v1/models/other", headers={**HEADERS, "anthropic-version": "2023-06-01"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_disconnect_mid_stream_frees_kv_blocks(fake_server, fake, path):
    fake.reply = lambda prompt: LONG_REPLY
    fake.token_delay = 0.01
    with httpx.Client(base_url=fake_server.url, headers=HEADERS, timeout=10) as client:
        with client.stream("POST", path, json=stream_body()) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert fake.stats().kv_blocks_used > 0
    assert wait_until(lambda: fake.stats().kv_blocks_used == 0, timeout=2)
    assert len(fake.calls) == 1


def test_disconnect_while_waiting_for_a_non_streaming_answer(fake_server, fake):
    fake.reply = lambda prompt: LONG_REPLY
    fake.token_delay = 0.01  # the full answer would take ~4 s
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_server.url + "/v1/messages", headers=HEADERS, timeout=0.5,
                   json={**stream_body(), "stream": False})
    assert wait_until(lambda: fake.stats().kv_blocks_used == 0, timeout=2)
    assert time.monotonic() - started < 3


def test_graceful_shutdown_aborts_what_outlives_the_timeout(demo_tokenizer):
    engine = FakeEngine(demo_tokenizer)
    engine.reply = lambda prompt: LONG_REPLY
    engine.token_delay = 0.02  # ~8 s for the whole reply: longer than the grace period
    server = ServerThread(build_app({"fake-model": engine}, NoAuth()), graceful_timeout=0.5).start()
    received: list[str] = []

    def client() -> None:
        with httpx.stream("POST", server.url + "/v1/messages", json=stream_body(), timeout=20) as r:
            for line in r.iter_lines():
                received.append(line)

    reader = threading.Thread(target=client)
    reader.start()
    assert wait_until(lambda: len(received) > 8)
    assert engine.stats().kv_blocks_used > 0
    began = time.monotonic()
    server.stop()
    reader.join(10)
    assert not reader.is_alive()
    assert time.monotonic() - began < 5
    assert engine.stats().kv_blocks_used == 0 and not engine.started
    # the stream was ended properly: an overloaded_error event telling the client to retry
    events = parse_sse("\n".join(received))
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=1)


def test_ready_is_503_while_draining(fake_server):
    state = fake_server.app.state.tierlm
    state.draining = True
    try:
        assert httpx.get(fake_server.url + "/ready").status_code == 503
        r = httpx.post(fake_server.url + "/v1/messages", headers=HEADERS, json={**stream_body(), "stream": False})
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    finally:
        state.draining = False


def test_graceful_shutdown_lets_short_requests_finish(demo_tokenizer):
    engine = FakeEngine(demo_tokenizer)
    engine.reply = lambda prompt: "short answer"
    engine.token_delay = 0.05
    server = ServerThread(build_app({"fake-model": engine}, ApiKeyAuth.from_keys({"k": API_KEY})),
                          graceful_timeout=5).start()
    result: dict = {}

    def client() -> None:
        result["r"] = httpx.post(server.url + "/v1/messages", headers=HEADERS, timeout=20,
                                 json={**stream_body(), "stream": False})

    reader = threading.Thread(target=client)
    reader.start()
    assert wait_until(lambda: engine.stats().kv_blocks_used > 0)
    server.stop()
    reader.join(10)
    assert result["r"].status_code == 200 and result["r"].json()["content"][0]["text"] == "short answer"
