"""API errors and their two wire shapes (Anthropic and OpenAI).

Every failure a client can see is an `APIError` subclass carrying its HTTP status, the
Anthropic error type, the OpenAI error type/code and (when there is one) the offending field.
Handlers render it in the shape the route's API expects, so the SDKs raise their own exception
classes (`anthropic.BadRequestError`, `openai.NotFoundError`, ...). Anything that is not an
`APIError` is a server bug: it becomes a 500 `api_error` with the request id and no trace.
"""
from __future__ import annotations

import json
import logging
import math
from typing import Any, Literal

from tierlm.errors import (
    ChatTemplateError,
    EngineDeadError,
    EngineStepError,
    InvalidRequestError,
    RequestTooLongError,
)

logger = logging.getLogger("tierlm.serving")

ApiStyle = Literal["anthropic", "openai"]

# Routes whose errors use OpenAI's shape; everything else speaks Anthropic's, except the shared
# /v1/models routes, which follow the client (see `api_style_for`).
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                "/tokenize", "/detokenize",  # (these and the next two vLLM's, answering in OpenAI's shape as there)
                "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
# Where only OpenAI clients go (their 404s too: /v1/images, a mistyped /v1/chat/completion):
# every top-level resource of OpenAI's API (the `openai` SDK's resources, 3.57), so an OpenAI SDK
# gets its NotFoundError with an OpenAI body; each entry covers the path and everything under it.
OPENAI_PREFIXES = tuple("/v1/" + name for name in (
    "chat", "completions", "embeddings", "responses", "conversations", "audio", "images", "videos",
    "moderations", "files", "uploads", "batches", "vector_stores", "fine_tuning", "evals", "containers",
    "assistants", "threads", "realtime", "chatkit", "organization", "projects", "skills", "agents", "vaults",
    "webhook_endpoints", "webhook_event_types", "live", "safety", "decisions", "content_provenance_checks",
))


class APIError(Exception):
    """A client-visible error. Subclasses fix the status and the type names of both APIs."""

    status: int = 500
    anthropic_type: str = "api_error"
    openai_type: str = "server_error"
    openai_status: int | None = None  # when OpenAI clients expect a different status
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.headers = dict(headers or {})

    def status_for(self, style: ApiStyle) -> int:
        if style == "openai" and self.openai_status is not None:
            return self.openai_status
        return self.status

    def message_for(self, style: ApiStyle) -> str:
        """The message in `style`'s words (the same for both, except where an API has its own)."""
        return self.message


class InvalidRequest(APIError):
    status = 400
    anthropic_type = "invalid_request_error"
    openai_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """The prompt (+ max_tokens) does not fit the model's context, in each API's own words, so
    clients that look for them (OpenAI's `context_length_exceeded` code, Anthropic's "prompt is
    too long") recognise it. `at_least`: the prompt length is a lower bound (never tokenized)."""

    default_code = "context_length_exceeded"

    def __init__(self, *, context: int, prompt_tokens: int, max_tokens: int | None, prompt_field: str,
                 field_name: str = "max_tokens", at_least: bool = False) -> None:
        self.context, self.prompt_tokens, self.max_tokens = context, prompt_tokens, max_tokens
        self.prompt_field, self.field_name, self.at_least = prompt_field, field_name, at_least
        super().__init__(self._openai_message(), param=prompt_field)

    def message_for(self, style: ApiStyle) -> str:
        return self._anthropic_message() if style == "anthropic" else self.message

    def _openai_message(self) -> str:
        n, p, c = self.context, self.prompt_tokens, self.max_tokens
        what = "messages" if self.prompt_field == "messages" else "prompt"
        yours = "the messages" if what == "messages" else "your prompt"
        head = f"This model's maximum context length is {n} tokens. However, "
        if self.at_least or c is None:
            bound = "at least " if self.at_least else ""
            full = ", which leaves no room for the completion" if p == n and not self.at_least else ""
            return head + f"your {what} resulted in {bound}{p} tokens{full}. Please reduce the length of the {what}."
        message = (head + f"you requested {p + c} tokens ({p} in {yours}, {c} in the completion). "
                   f"Please reduce the length of the {what} or completion.")
        if p < n:  # tierlm's hint: the largest limit this prompt allows
            these = "these messages" if what == "messages" else "this prompt"
            message += f" ({self.field_name} can be at most {n - p} for {these}.)"
        return message

    def _anthropic_message(self) -> str:
        n, p, c = self.context, self.prompt_tokens, self.max_tokens
        if self.at_least:
            return f"prompt is too long: at least {p} tokens > {n} maximum"
        if c is None or p > n:
            return f"prompt is too long: {p} tokens > {n} maximum"
        return (f"input length and `max_tokens` exceed context limit: {p} + {c} > {n}, "
                "decrease input length or `max_tokens` and try again")


class MethodNotAllowed(InvalidRequest):
    status = 405


class Conflict(InvalidRequest):
    """The request is well formed but the thing it acts on is past the point where it applies (a
    batch that finished cannot be cancelled): OpenAI answers 409, Anthropic a 400."""

    openai_status = 409


class AuthenticationFailed(APIError):
    status = 401
    anthropic_type = "authentication_error"
    openai_type = "invalid_request_error"
    default_code = "invalid_api_key"


class PermissionDenied(APIError):
    status = 403
    anthropic_type = "permission_error"
    openai_type = "permission_error"


class NotFound(APIError):
    status = 404
    anthropic_type = "not_found_error"
    openai_type = "invalid_request_error"
    default_code = "not_found"


class RequestTooLarge(APIError):
    status = 413
    anthropic_type = "request_too_large"
    openai_type = "invalid_request_error"
    default_code = "request_too_large"


class RequestTimeout(APIError):
    """408: the client did not send its request in time (the server closes the connection)."""

    status = 408
    anthropic_type = "timeout_error"
    openai_type = "invalid_request_error"
    default_code = "request_timeout"


class RateLimited(APIError):
    """429; `retry_after` seconds is sent as the retry-after header both SDKs honour (whole
    seconds) and as retry-after-ms (the SDKs read it first), as every 429 here does."""

    status = 429
    anthropic_type = "rate_limit_error"
    openai_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.headers.setdefault("retry-after", str(max(1, round(retry_after))))
        self.headers.setdefault("retry-after-ms", str(max(1, math.ceil(retry_after * 1000))))


class InternalError(APIError):
    status = 500
    anthropic_type = "api_error"
    openai_type = "server_error"


class Overloaded(APIError):
    """Anthropic's 529; OpenAI clients know overload as 503."""

    status = 529
    anthropic_type = "overloaded_error"
    openai_type = "server_error"
    openai_status = 503
    default_code = "overloaded"


class ClientDisconnected(APIError):
    """The client went away; nobody reads this response (499 only shows up in logs)."""

    status = 499
    anthropic_type = "client_disconnected"
    openai_type = "client_disconnected"


def from_engine_error(exc: BaseException, model: str) -> APIError:
    """Map an engine exception to the API error a client should see.

    Engine validation errors are the client's fault (400, naming the field); a dead engine is
    the server's (500) and says whether a retry can help (a failed step) or not (a dead engine).
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestTooLongError):  # can never fit (e.g. the whole KV pool): OpenAI's code for it
        return InvalidRequest(str(exc), param=exc.param or "max_tokens", code=ContextLengthExceeded.default_code)
    if isinstance(exc, ChatTemplateError):
        return InvalidRequest(str(exc), param=exc.param or "messages")
    if isinstance(exc, InvalidRequestError):
        return InvalidRequest(str(exc), param=exc.param)
    if isinstance(exc, EngineDeadError):
        return InternalError(
            f"the engine serving model '{model}' has stopped after an internal error; "
            "the server must be restarted"
        )
    if isinstance(exc, EngineStepError):
        return InternalError(
            f"the engine serving model '{model}' failed while running this request (the cause is in "
            "the server log); the engine keeps serving, so retry the request"
        )
    logger.exception("unexpected engine error for model %s", model, exc_info=exc)
    return InternalError(f"internal error while generating with model '{model}'")


def stream_error(exc: BaseException, request_id: str) -> APIError:
    """What a stream that already sent its 200 tells the client in its final error frame.

    An `APIError` says itself; anything else is a server bug: logged with its trace here, and
    sent as a bare 500 so the trace never reaches the client.
    """
    if isinstance(exc, APIError):
        return exc
    logger.exception("error while streaming %s", request_id, exc_info=exc)
    return InternalError("internal error while streaming")


def api_style_for(path: str, headers: Any) -> ApiStyle:
    """Which error shape a request expects: by route, and for shared routes by the client.

    `/v1/models` is served to both SDKs; the Anthropic SDK always sends `anthropic-version`, which
    also wins on the OpenAI-looking prefixes (Anthropic has a /v1/files API of its own).
    """
    if path in OPENAI_PATHS:
        return "openai"
    if "anthropic-version" in headers:
        return "anthropic"
    if path.startswith("/v1/models") or any(path == p or path.startswith(p + "/") for p in OPENAI_PREFIXES):
        return "openai"
    return "anthropic"


def anthropic_error_body(err: APIError, request_id: str | None) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": err.anthropic_type, "message": err.message_for("anthropic")},
        "request_id": request_id,
    }


def openai_error_body(err: APIError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message_for("openai"),
            "type": err.openai_type,
            "param": err.param,
            "code": err.code,
        }
    }


def error_body(err: APIError, style: ApiStyle, request_id: str | None) -> dict[str, Any]:
    if style == "openai":
        return openai_error_body(err)
    return anthropic_error_body(err, request_id)


def error_json_bytes(err: APIError, style: ApiStyle, request_id: str | None) -> bytes:
    return json.dumps(error_body(err, style, request_id)).encode()
