"""App-level behaviour: several models, error shapes for every status, the last-resort 500."""
from __future__ import annotations

import httpx
import pytest

from tests.serving.fakes import API_KEY, FakeEngine, ServerThread
from tierlm.serving.app import build_app
from tierlm.serving.auth import NoAuth
from tierlm.serving.errors import (
    AuthenticationFailed,
    InternalError,
    InvalidRequest,
    NotFound,
    Overloaded,
    PermissionDenied,
    RateLimited,
    RequestTooLarge,
    anthropic_error_body,
    api_style_for,
    openai_error_body,
)
from tierlm.serving.models import ModelRegistry


@pytest.fixture(scope="module")
def two_models(demo_tokenizer):
    small, big = FakeEngine(demo_tokenizer, model_name="small"), FakeEngine(demo_tokenizer, model_name="big")
    small.reply = lambda prompt: "from small"
    big.reply = lambda prompt: "from big"
    server = ServerThread(build_app({"small": small, "big": big}, NoAuth())).start()
    yield server, small, big
    server.stop()


def ask(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/messages", json={"model": model, "max_tokens": 20,
                                                 "messages": [{"role": "user", "content": "hi"}]})


def test_the_model_field_picks_the_engine(two_models):
    server, small, big = two_models
    assert ask(server.url, "small").json()["content"][0]["text"] == "from small"
    assert ask(server.url, "big").json()["content"][0]["text"] == "from big"
    assert len(small.calls) == 1 and len(big.calls) == 1
    missing = ask(server.url, "medium")
    assert missing.status_code == 404 and "small, big" in missing.json()["error"]["message"]
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["small", "big"]
    assert small.started and big.started  # the lifespan started both


def test_no_auth_accepts_requests_without_keys(two_models):
    server, _, _ = two_models
    assert ask(server.url, "small").status_code == 200


@pytest.mark.parametrize("err, status, anthropic_type, openai_status", [
    (InvalidRequest("x", param="p"), 400, "invalid_request_error", 400),
    (AuthenticationFailed("x"), 401, "authentication_error", 401),
    (PermissionDenied("x"), 403, "permission_error", 403),
    (NotFound("x"), 404, "not_found_error", 404),
    (RequestTooLarge("x"), 413, "request_too_large", 413),
    (RateLimited("x", retry_after=2.4), 429, "rate_limit_error", 429),
    (InternalError("x"), 500, "api_error", 500),
    (Overloaded("x"), 529, "overloaded_error", 503),
])
def test_error_shapes(err, status, anthropic_type, openai_status):
    assert err.status_for("anthropic") == status and err.status_for("openai") == openai_status
    assert anthropic_error_body(err, "req_1") == {"type": "error", "error": {"type": anthropic_type, "message": "x"},
                                                  "request_id": "req_1"}
    body = openai_error_body(err)["error"]
    assert body["message"] == "x" and body["type"] and "param" in body and "code" in body


def test_rate_limit_carries_retry_after():
    assert RateLimited("slow down", retry_after=2.4).headers == {"retry-after": "2"}


def test_error_style_follows_route_and_client():
    assert api_style_for("/v1/chat/completions", {}) == "openai"
    assert api_style_for("/v1/messages", {}) == "anthropic"
    assert api_style_for("/v1/models", {"anthropic-version": "2023-06-01"}) == "anthropic"
    assert api_style_for("/v1/models", {}) == "openai"


def test_unexpected_errors_are_500_without_trace(fake_server, monkeypatch):
    registry: ModelRegistry = fake_server.app.state.tierlm.models

    def broken(name: str) -> dict:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(registry, "describe", broken)
    r = httpx.get(fake_server.url + "/v1/models", headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 500
    data = r.json()
    assert data["error"]["type"] == "api_error" and data["request_id"] == r.headers["request-id"]
    assert "secret" not in r.text and "Traceback" not in r.text and data["request_id"] in data["error"]["message"]


class Recorder:
    """Stands in for telemetry's per-request observer."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_engine_request(self, model, params=None, *, tenant=None) -> None:
        self.events.append(("request", model, params.max_tokens, tenant))

    def on_delta(self, delta) -> None:
        self.events.append(("delta", delta.finished))

    def on_error(self, error) -> None:
        self.events.append(("error", error.status))


def test_engine_streams_report_to_the_scope_observer(demo_tokenizer):
    engine = FakeEngine(demo_tokenizer)
    engine.reply = lambda prompt: "abc"
    recorders: list[Recorder] = []
    app = build_app({"fake-model": engine}, NoAuth())

    class InstallRecorder:
        def __init__(self, inner) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] == "http":
                recorders.append(Recorder())
                scope.setdefault("state", {})["telemetry"] = recorders[-1]
            await self.inner(scope, receive, send)

    app.add_middleware(InstallRecorder)
    server = ServerThread(app).start()
    try:
        body = {"model": "fake-model", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(server.url + "/v1/messages", json=body).status_code == 200
        engine.fail_after = 1
        httpx.post(server.url + "/v1/messages", json={**body, "stream": True})
    finally:
        server.stop()
    ok, failed = recorders
    assert ok.events[0] == ("request", "fake-model", 9, None)
    assert [e[0] for e in ok.events[1:]] == ["delta"] * (len(engine.encode("abc")) + 1) and ok.events[-1][1]
    assert failed.events[-1] == ("error", 500)
