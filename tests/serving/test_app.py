"""App-level behaviour: several models, error shapes for every status, the last-resort 500."""
from __future__ import annotations

import threading

import httpx
import pytest
from starlette.middleware import Middleware

from tests.serving.harness import API_KEY, ServerThread, fail_after_steps
from tests.serving.scripted_model import Script, ScriptedModel, build_scripted_model, chat_prompt_ids
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
def checkpoints(demo_tokenizer, tmp_path_factory) -> dict[str, ScriptedModel]:
    """Two scripted models, each answering every chat prompt with its own name."""
    root, chat = tmp_path_factory.mktemp("two-models"), chat_prompt_ids(demo_tokenizer)
    return {name: build_scripted_model(root / name, [Script(chat, f"from {name}")], demo_tokenizer)
            for name in ("small", "big")}


@pytest.fixture(scope="module")
def two_models(checkpoints):
    small, big = checkpoints["small"].engine("small"), checkpoints["big"].engine("big")
    server = ServerThread(build_app({"small": small, "big": big}, NoAuth())).start()
    yield server, small, big
    server.stop()


def engine_thread_alive(name: str) -> bool:
    return any(t.name == f"tierlm-engine-{name}" and t.is_alive() for t in threading.enumerate())


def ask(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/messages", json={"model": model, "max_tokens": 20,
                                                 "messages": [{"role": "user", "content": "hi"}]})


def test_the_model_field_picks_the_engine(two_models):
    server, small, big = two_models
    assert engine_thread_alive("small") and engine_thread_alive("big")  # the lifespan started both
    before = small.stats().prompt_tokens, big.stats().prompt_tokens
    assert ask(server.url, "small").json()["content"][0]["text"] == "from small"
    after_small = small.stats().prompt_tokens, big.stats().prompt_tokens
    assert ask(server.url, "big").json()["content"][0]["text"] == "from big"
    after_big = small.stats().prompt_tokens, big.stats().prompt_tokens
    # each request ran on its own engine only
    assert after_small[0] > before[0] and after_small[1] == before[1]
    assert after_big[1] > after_small[1] and after_big[0] == after_small[0]
    missing = ask(server.url, "medium")
    assert missing.status_code == 404 and "small, big" in missing.json()["error"]["message"]
    cards = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in cards] == ["small", "big"]
    # the context length under each API's name: vLLM's max_model_len, Anthropic's max_input_tokens
    assert [(m["max_model_len"], m["max_input_tokens"]) for m in cards] == [(e.max_model_len,) * 2 for e in (small, big)]


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
    # Whole seconds (retry-after) and the exact wait (retry-after-ms, which the SDKs read first).
    assert RateLimited("slow down", retry_after=2.4).headers == {"retry-after": "2", "retry-after-ms": "2400"}
    assert RateLimited("now", retry_after=0.0001).headers == {"retry-after": "1", "retry-after-ms": "1"}


def test_error_style_follows_route_and_client():
    assert api_style_for("/v1/chat/completions", {}) == "openai"
    assert api_style_for("/v1/messages", {}) == "anthropic"
    assert api_style_for("/v1/models", {"anthropic-version": "2023-06-01"}) == "anthropic"
    assert api_style_for("/v1/models", {}) == "openai"


def test_unexpected_errors_are_500_without_trace(scripted_server, monkeypatch):
    registry: ModelRegistry = scripted_server.app.state.tierlm.models

    def broken(name: str) -> dict:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(registry, "describe", broken)
    r = httpx.get(scripted_server.url + "/v1/models", headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 500
    data = r.json()
    assert data["error"]["type"] == "api_error" and data["request_id"] == r.headers["request-id"]
    assert "secret" not in r.text and "Traceback" not in r.text and data["request_id"] in data["error"]["message"]


class Recorder:
    """Stands in for telemetry's per-request observer."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_engine_request(self, model, params=None, *, tenant=None, prompt_tokens=0, request_id=None,
                          prompt_index=0) -> None:
        self.events.append(("request", model, params.max_tokens, tenant))

    def on_delta(self, delta) -> None:
        self.events.append(("delta", delta.finished))

    def on_error(self, error) -> None:
        self.events.append(("error", error.status))


def test_engine_streams_report_to_the_scope_observer(checkpoints, monkeypatch):
    engine = checkpoints["small"].engine("observed")
    recorders: list[Recorder] = []
    app = build_app({"observed": engine}, NoAuth())

    class InstallRecorder:
        def __init__(self, inner) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] == "http":
                recorders.append(Recorder())
                scope.setdefault("state", {})["telemetry"] = recorders[-1]
            await self.inner(scope, receive, send)

    # Innermost, so it replaces whatever observer the app's own telemetry middleware installed.
    app.user_middleware.append(Middleware(InstallRecorder))
    server = ServerThread(app).start()
    try:
        body = {"model": "observed", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(server.url + "/v1/messages", json=body).json()["content"][0]["text"] == "from small"
        fail_after_steps(engine, monkeypatch, 1)  # the first token, then a device fault
        httpx.post(server.url + "/v1/messages", json={**body, "stream": True})
    finally:
        server.stop()
    ok, failed = recorders
    assert ok.events[0] == ("request", "observed", 20, None)
    reply = checkpoints["small"].reply_tokens("from small")
    assert [e[0] for e in ok.events[1:]] == ["delta"] * (len(reply) + 1) and ok.events[-1][1]
    assert failed.events == [("request", "observed", 20, None), ("delta", False), ("error", 500)]


@pytest.mark.parametrize("path", ["/v1/embeddings/x", "/v1/responses/x/y", "/v1/chat/completion", "/v1/chat",
                                  "/v1/audio/speech", "/v1/images/generations", "/v1/moderations", "/v1/files/f1/x",
                                  "/v1/batches/b1/x", "/v1/completions/x", "/v1/conversations", "/v1/vector_stores",
                                  "/v1/fine_tuning/jobs", "/v1/assistants", "/v1/uploads", "/v1/containers",
                                  "/v1/evals", "/v1/videos", "/v1/threads/t1/runs", "/v1/realtime/sessions",
                                  "/v1/organization/costs"])
def test_unknown_openai_routes_answer_in_openai_shape(scripted_server, path):
    assert api_style_for(path, {}) == "openai"
    r = httpx.post(scripted_server.url + path, json={}, headers={"authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404
    assert set(r.json()) == {"error"} and r.json()["error"]["message"] == f"no such route: POST {path}"
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == "not_found"


def test_unknown_routes_otherwise_answer_in_anthropic_shape(scripted_server):
    # Anthropic's SDK always sends anthropic-version (Anthropic has a /v1/files API too)
    assert api_style_for("/v1/files", {"anthropic-version": "2023-06-01"}) == "anthropic"
    for path in ("/v1/messagez", "/v1/complete", "/v1/completionsx", "/v2/chat/completions"):
        assert api_style_for(path, {}) == "anthropic"
    r = httpx.post(scripted_server.url + "/v1/skills", json={}, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(scripted_server.url + "/v1/files", json={}, headers={"anthropic-version": "2023-06-01",
                                                                        "x-api-key": API_KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"  # both APIs' Files APIs are served there
    assert "multipart/form-data with the field 'file'" in r.json()["error"]["message"]


def test_every_get_route_answers_head(scripted_server):
    """The README: "all GET routes answer HEAD too"; the batch and file routes answered 405."""
    routes = [r for r in scripted_server.app.state.api_routes if "GET" in r.methods]
    assert {"/v1/batches", "/v1/files/{file_id}/content", "/v1/messages/batches/{batch_id}/results"} <= \
        {r.path for r in routes}
    assert all("HEAD" in r.methods for r in routes)
    for path in ("/v1/batches", "/v1/files", "/v1/messages/batches"):
        r = httpx.head(scripted_server.url + path, headers={"x-api-key": API_KEY})
        assert r.status_code == 200 and r.content == b"", path


@pytest.mark.parametrize("method, path, allowed, style", [
    ("GET", "/v1/messages", {"POST"}, "anthropic"),
    ("DELETE", "/v1/messages/count_tokens", {"POST"}, "anthropic"),
    ("GET", "/v1/chat/completions", {"POST"}, "openai"),
    ("PUT", "/v1/completions", {"POST"}, "openai"),
    ("POST", "/health", {"GET", "HEAD"}, "anthropic"),
    ("POST", "/v1/models", {"GET", "HEAD"}, "openai"),
    # Paths several routes serve: every method (Starlette named the first route's alone).
    ("PATCH", "/v1/batches", {"GET", "HEAD", "POST"}, "openai"),
    ("PUT", "/v1/files", {"GET", "HEAD", "POST"}, "openai"),
    ("PATCH", "/v1/files/file-x", {"GET", "HEAD", "DELETE"}, "openai"),
    ("PUT", "/v1/messages/batches", {"GET", "HEAD", "POST"}, "anthropic"),
    ("PUT", "/v1/messages/batches/msgbatch_x", {"GET", "HEAD", "DELETE"}, "anthropic"),
])
def test_405_names_the_allowed_methods(scripted_server, method, path, allowed, style):
    r = httpx.request(method, scripted_server.url + path, headers={"x-api-key": API_KEY})
    assert r.status_code == 405
    assert set(r.headers["allow"].split(", ")) == allowed
    error = r.json()["error"]
    assert (r.json().get("type") == "error") == (style == "anthropic")
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{method} is not allowed on {path}; use ")


@pytest.mark.parametrize("path", ["/health", "/ready", "/v1/models", "/v1/models/scripted", "/metrics"])
def test_head_is_answered_wherever_get_is(scripted_server, path):
    get = httpx.get(scripted_server.url + path, headers={"x-api-key": API_KEY})
    head = httpx.head(scripted_server.url + path, headers={"x-api-key": API_KEY})
    assert get.status_code == head.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
