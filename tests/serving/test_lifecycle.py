"""Health probes, client disconnects and graceful shutdown, with the real engine.

Long answers come from the scripted model that never stops (`LOOP_MODEL`); steps are slowed down
(`slow_steps`) so that a request is reliably still running when the test disconnects or stops
the server.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.serving.harness import API_KEY, ServerThread, parse_sse, slow_steps, wait_until
from tests.serving.scripted_model import LOOP_MODEL, REPLY, TEXT_MODEL
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth, NoAuth

HEADERS = {"x-api-key": API_KEY}
MAX_TOKENS = 400


def stream_body(model: str = LOOP_MODEL, **fields):
    return {"model": model, "max_tokens": MAX_TOKENS, "stream": True,
            "messages": [{"role": "user", "content": "talk"}], **fields}


def engine_thread_alive(name: str) -> bool:
    return any(t.name == f"tierlm-engine-{name}" and t.is_alive() for t in threading.enumerate())


def test_health_and_ready_need_no_key(scripted_server, scripted_engines):
    assert httpx.get(scripted_server.url + "/health").json() == {"status": "ok"}
    r = httpx.get(scripted_server.url + "/ready")
    assert r.status_code == 200 and r.json() == {"status": "ready", "models": list(scripted_engines)}


def test_models_list_and_get(scripted_server, scripted_engines):
    listing = httpx.get(scripted_server.url + "/v1/models", headers=HEADERS).json()
    assert [m["id"] for m in listing["data"]] == list(scripted_engines) and listing["has_more"] is False
    one = httpx.get(scripted_server.url + f"/v1/models/{TEXT_MODEL}", headers=HEADERS).json()
    assert one["type"] == "model" and one["object"] == "model"
    r = httpx.get(scripted_server.url + "/v1/models/other", headers={**HEADERS, "anthropic-version": "2023-06-01"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_disconnect_mid_stream_frees_kv_blocks(scripted_server, scripted_engines, requests_to, monkeypatch, path):
    engine = scripted_engines[LOOP_MODEL]
    asked = requests_to(LOOP_MODEL)
    slow_steps(engine, monkeypatch, 0.01)  # the whole answer would take ~4 s
    generated = engine.stats().generation_tokens
    with httpx.Client(base_url=scripted_server.url, headers=HEADERS, timeout=10) as client:
        with client.stream("POST", path, json=stream_body()) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert engine.stats().kv_blocks_used > 0
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0, timeout=2)
    assert len(asked) == 1
    assert engine.stats().generation_tokens - generated < MAX_TOKENS // 4  # aborted, not run to the end


def test_disconnect_while_waiting_for_a_non_streaming_answer(scripted_server, scripted_engines, monkeypatch):
    engine = scripted_engines[LOOP_MODEL]
    slow_steps(engine, monkeypatch, 0.01)  # the whole answer would take ~4 s
    generated = engine.stats().generation_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(scripted_server.url + "/v1/messages", headers=HEADERS, timeout=0.5,
                   json={**stream_body(), "stream": False})
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0, timeout=10)
    # Aborted when the client left, not run to its end (~4 s): fewer than half its tokens. (No
    # wall-clock bound: on a loaded CI machine the post alone once took 6.5 s.)
    assert engine.stats().generation_tokens - generated < MAX_TOKENS // 2


def test_graceful_shutdown_aborts_what_outlives_the_timeout(scripted_models, monkeypatch):
    engine = scripted_models[LOOP_MODEL].engine("shutdown-loop")
    slow_steps(engine, monkeypatch, 0.02)  # ~8 s for the whole answer: longer than the grace period
    server = ServerThread(build_app({"shutdown-loop": engine}, NoAuth()), graceful_timeout=0.5).start()
    received: list[str] = []

    def client() -> None:
        with httpx.stream("POST", server.url + "/v1/messages", json=stream_body("shutdown-loop"), timeout=20) as r:
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
    assert engine.stats().kv_blocks_used == 0 and not engine_thread_alive("shutdown-loop")
    # the stream was ended properly: an overloaded_error event telling the client to retry
    events = parse_sse("\n".join(received))
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=1)


def test_ready_is_503_while_draining(scripted_server):
    state = scripted_server.app.state.tierlm
    state.draining = True
    try:
        assert httpx.get(scripted_server.url + "/ready").status_code == 503
        r = httpx.post(scripted_server.url + "/v1/messages", headers=HEADERS,
                       json={**stream_body(TEXT_MODEL), "stream": False})
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    finally:
        state.draining = False


def test_graceful_shutdown_lets_short_requests_finish(scripted_models, monkeypatch):
    engine = scripted_models[TEXT_MODEL].engine("shutdown-text")
    slow_steps(engine, monkeypatch, 0.03)  # ~1 s for the answer: within the grace period
    server = ServerThread(build_app({"shutdown-text": engine}, ApiKeyAuth.from_keys({"k": API_KEY})),
                          graceful_timeout=5).start()
    result: dict = {}

    def client() -> None:
        result["r"] = httpx.post(server.url + "/v1/messages", headers=HEADERS, timeout=20,
                                 json={**stream_body("shutdown-text"), "stream": False})

    reader = threading.Thread(target=client)
    reader.start()
    assert wait_until(lambda: engine.stats().kv_blocks_used > 0)
    server.stop()
    reader.join(10)
    assert result["r"].status_code == 200 and result["r"].json()["content"][0]["text"] == REPLY
    assert not engine_thread_alive("shutdown-text")
