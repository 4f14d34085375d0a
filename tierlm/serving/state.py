"""What every route needs from the server: models, auth, limits, in-flight requests."""
from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import Request

from tierlm.serving.auth import Authenticator, RequestContext
from tierlm.serving.generation import InflightRequests
from tierlm.serving.models import ModelRegistry
from tierlm.serving.validation import DEFAULT_MAX_BODY_BYTES


@dataclass
class ServerState:
    models: ModelRegistry
    auth: Authenticator
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    inflight: InflightRequests = field(default_factory=InflightRequests)

    def admit(self, request: Request) -> RequestContext:
        """Authenticate and build the request's context (tenancy will extend this step)."""
        api_key_id = self.auth.authenticate(request.headers)
        return RequestContext(request_id=request_id_of(request), api_key_id=api_key_id)


def server_state(request: Request) -> ServerState:
    return request.app.state.tierlm


def request_id_of(request: Request) -> str:
    """Set by `RequestIdMiddleware` for every HTTP request."""
    return request.scope.get("state", {}).get("request_id") or "req_unknown"
