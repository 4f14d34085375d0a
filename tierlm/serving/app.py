"""The ASGI app: routes of both APIs, health probes, error handling, engine lifecycle.

Error handling is layered so that no client ever sees a stack trace or a 5xx for its own
mistake: `APIError`s render in the route's API shape; Starlette's routing errors (404/405)
and FastAPI validation errors are converted to `APIError`s; and `RequestIdMiddleware`, which
wraps everything, turns anything else into a 500 `api_error` carrying the request id.
"""
from __future__ import annotations

import logging
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierlm.serving import (anthropic, batches, files, lora_admin, openai, openai_batches, openai_embeddings,
                            openai_responses, rerank, tokenize)
from tierlm.serving.batches import BatchStore
from tierlm.serving.paging import limit_param, page
from tierlm.serving.auth import Authenticator
from tierlm.serving.errors import (
    APIError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    api_style_for,
    error_body,
    error_json_bytes,
)
from tierlm.serving.models import ModelRegistry
from tierlm.serving.response_store import ResponseStore
from tierlm.serving.safety import SafetyPolicies
from tierlm.serving.sla import SlaGuard
from tierlm.serving.sse import DEFAULT_STREAM_SEND_TIMEOUT
from tierlm.serving.state import ServerState, request_id_of, server_state
from tierlm.serving.telemetry import Telemetry, TelemetryMiddleware
from tierlm.serving.tenancy import Tenancy, TenancyMiddleware
from tierlm.serving.validation import DEFAULT_MAX_BODY_BYTES, DEFAULT_REQUEST_READ_TIMEOUT

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine

logger = logging.getLogger("tierlm.serving")


def build_app(
    engines: dict[str, "AsyncEngine"],
    auth: Authenticator,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    manage_engines: bool = True,
    telemetry: Telemetry | None = None,
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT,
    stream_send_timeout: float = DEFAULT_STREAM_SEND_TIMEOUT,
    tool_call_parser: str = "auto",
    reasoning_parser: str = "auto",
    response_store: ResponseStore | None = None,
    tenancy: Tenancy | None = None,
    safety: SafetyPolicies | None = None,
    sla: SlaGuard | None = None,
    batch_store: BatchStore | None = None,
    lora_updates: lora_admin.LoRAUpdates | None = None,
) -> FastAPI:
    """An app serving `engines` (name → engine) behind `auth`.

    With `manage_engines` the app's lifespan starts the engines and shuts them down; pass
    False when the caller owns their lifecycle. Either way, requests still in flight when the
    app shuts down (after the server's graceful-shutdown timeout) are aborted.
    `telemetry` (default: metrics only, no tracing) serves GET /metrics and observes requests.
    `request_read_timeout` and `stream_send_timeout`: see `ServerState`. `tool_call_parser`:
    every model's tool-call syntax (see tools.tool_call_syntax; "auto": each one's own).
    `reasoning_parser`: whether answers' think blocks are read as reasoning (see reasoning.py;
    "auto": for each model whose chat template writes think markers). `response_store`: where
    the Responses API keeps stored responses (default: 256 MiB in memory). `tenancy`: keys →
    tenants, their priorities and limits (default: each key a tenant of its own, unlimited).
    `safety`: phrase policies prompts and answers are checked against (default: none). `sla`:
    the SLA guard's breaker settings and fallback models (default: breakers on, no fallbacks).
    `batch_store`: the Message Batches API's batches (default: in memory; with a BatchJournal
    they are written to a directory, and a restart goes on with them). `lora_updates`: who may
    load and unload LoRA adapters at run time (default: nobody; adapters loaded at start stay).
    """
    sla = sla if sla is not None else SlaGuard()
    for big, small in sla.fallbacks.items():
        for name in (big, small):
            if name not in engines:
                raise ValueError(f"--fallback-model {big}={small}: model '{name}' is not served here; serve it with "
                                 f"--model {name}=DIR (served: {', '.join(engines)})")
    state = ServerState(models=ModelRegistry(engines, tool_call_parser, reasoning_parser), auth=auth, max_body_bytes=max_body_bytes,
                        request_read_timeout=request_read_timeout, stream_send_timeout=stream_send_timeout,
                        responses=response_store if response_store is not None else ResponseStore(),
                        tenancy=tenancy if tenancy is not None else Tenancy(),
                        safety=safety if safety is not None else SafetyPolicies(), sla=sla,
                        batches=batch_store if batch_store is not None else BatchStore(),
                        lora_updates=lora_updates)
    telemetry = telemetry or Telemetry()
    state.tenancy.on_refused = telemetry.metrics.count_refusal
    if state.tenancy.store is not None:
        state.tenancy.store.on_failure = telemetry.metrics.limits_store_failures.inc
    state.sla.on_trip = state.sla.on_trip or telemetry.metrics.count_trip
    telemetry.metrics.files_bytes.set_function(lambda: state.batches.files.used)
    telemetry.metrics.files_capacity_bytes.set_function(lambda: state.batches.files.max_bytes)
    telemetry.watch(state.models.items)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engines:
            await state.models.start()
        state.models.started = True
        state.batches.restore(app, state.batch_context_of)
        try:
            yield
        finally:
            if len(state.inflight):
                logger.warning("releasing %d request(s) still in flight at shutdown", len(state.inflight))
            await state.batches.close()
            await state.inflight.close_all()
            await state.tenancy.close()
            if manage_engines:
                await state.models.shutdown()
            state.models.started = False
            telemetry.shutdown()

    app = FastAPI(title="tierlm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tierlm = state
    app.state.telemetry = telemetry
    routers = [anthropic.router, batches.router, openai.router, openai_responses.router, files.router,
               openai_batches.router, openai_embeddings.router, tokenize.router, lora_admin.router, rerank.router]
    for router in routers:
        for route in router.routes:
            # HEAD beside GET (FastAPI, unlike Starlette, does not add it): probes and load balancers use it.
            if isinstance(route, APIRoute) and "GET" in route.methods:
                route.methods.add("HEAD")
        app.include_router(router)
    reads = ["GET", "HEAD"]
    app.add_api_route("/v1/models", list_models, methods=reads)
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=reads)
    app.add_api_route("/health", health, methods=reads)
    app.add_api_route("/ready", ready, methods=reads)
    app.add_api_route("/metrics", telemetry.metrics_endpoint, methods=reads, include_in_schema=False)
    # Every route with its methods, for a 405's Allow header (_methods_on).
    app.state.api_routes = [r for routes in ([rt.routes for rt in routers] + [app.router.routes]) for r in routes
                            if isinstance(r, APIRoute)]
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_middleware(TenancyMiddleware)  # inside TelemetryMiddleware: reads its token counts
    app.add_middleware(TelemetryMiddleware, telemetry=telemetry)  # inside RequestIdMiddleware: reads its id
    app.add_middleware(RequestIdMiddleware)
    return app


# ---- routes --------------------------------------------------------------------------


async def list_models(request: Request) -> Response:
    """All models, or one page of them: Anthropic's `limit` (1-1000; default all, as OpenAI
    lists all) after `after_id` or before `before_id`, with `has_more` for that direction."""
    state = server_state(request)
    allowed = state.identify(request).models
    names = state.models.names_for(allowed)
    query = request.query_params
    start, end, has_more = page(names, limit_param(query.get("limit"), None), query.get("after_id"),
                                query.get("before_id"),
                                lambda param, name: f"{param}: model '{name}' is not served here; use an id from the list")
    data = [state.models.describe(name, allowed) for name in names[start:end]]
    return JSONResponse({
        "object": "list",
        "data": data,
        "has_more": has_more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    })


async def get_model(request: Request, model_id: str) -> Response:
    state = server_state(request)
    return JSONResponse(state.models.describe(model_id, state.identify(request).models))


async def health() -> Response:
    """Liveness: the process answers. Never needs auth."""
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Readiness: every model's engine is started and the server is not shutting down."""
    state = server_state(request)
    models = state.models
    if state.draining:
        return JSONResponse({"status": "draining", "models": models.names}, status_code=503)
    if not models.started:
        return JSONResponse({"status": "loading", "models": models.names}, status_code=503)
    return JSONResponse({"status": "ready", "models": models.names})


# ---- errors --------------------------------------------------------------------------


def error_response(request: Request, err: APIError) -> Response:
    style = api_style_for(request.url.path, request.headers)
    return JSONResponse(
        error_body(err, style, request_id_of(request)),
        status_code=err.status_for(style),
        headers=err.headers,
    )


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(request, exc)


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    method, path = request.method, request.url.path
    headers = dict(exc.headers or {})  # e.g. the `Allow` header Starlette sets on a 405
    err: APIError
    if exc.status_code == 404:
        err = NotFound(f"no such route: {method} {path}", headers=headers)
    elif exc.status_code == 405:
        # Starlette names the methods of the first route on the path; a path served by several
        # (GET and POST /v1/batches, GET and DELETE /v1/files/ID) gets all of them, as RFC 9110 says.
        headers = {k: v for k, v in headers.items() if k.lower() != "allow"}
        allowed = _methods_on(request) or None
        if allowed:
            headers["Allow"] = allowed
        hint = f"; use {allowed}" if allowed else ""
        err = MethodNotAllowed(f"{method} is not allowed on {path}{hint}", headers=headers)
    elif exc.status_code < 500:
        err = InvalidRequest(str(exc.detail), headers=headers)
        err.status = exc.status_code
    else:
        err = InternalError("internal error", headers=headers)
    return error_response(request, err)


def _methods_on(request: Request) -> str:
    """Every method some route serves on the request's path, for a 405's Allow header."""
    methods: set[str] = set()
    for route in getattr(request.app.state, "api_routes", ()):
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods))


async def _validation_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first: dict[str, Any] = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
    message = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg", "invalid request"))
    return error_response(request, InvalidRequest(message, param=where or None))


class RequestIdMiddleware:
    """Gives every request an id (request-id / x-request-id headers) and is the last line of
    defence: an exception nobody handled becomes a 500 `api_error` without a trace."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = "req_" + uuid.uuid4().hex[:24]
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                headers["request-id"] = request_id
                headers["x-request-id"] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error in request %s %s", request_id, scope.get("path"))
            if started:
                return  # the client already has a response; nothing more can be said
            style = api_style_for(scope.get("path", ""), Headers(scope=scope))
            err = InternalError(f"internal server error; quote request id {request_id} when reporting it")
            body = error_json_bytes(err, style, request_id)
            await send_with_id({
                "type": "http.response.start",
                "status": err.status_for(style),
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            })
            await send_with_id({"type": "http.response.body", "body": body})
