"""What every route needs from the server: models, auth, limits, in-flight requests."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

from starlette.requests import Request

from tierlm.serving.auth import Authenticator, RequestContext
from tierlm.serving.batches import BATCH_CONTEXT, BatchStore
from tierlm.serving.client_waits import ClientWaits
from tierlm.serving.errors import ContextLengthExceeded, InvalidRequest, Overloaded, api_style_for
from tierlm.serving.generation import COUNT_CHARS_PER_CONTEXT_TOKEN, InflightRequests
from tierlm.serving.models import ModelRegistry
from tierlm.serving.response_store import ResponseStore
from tierlm.serving.safety import SafetyPolicies
from tierlm.serving.sla import SlaGuard
from tierlm.serving.sse import DEFAULT_STREAM_SEND_TIMEOUT
from tierlm.serving.telemetry import GENERATION_ROUTES
from tierlm.serving.tenancy import TICKET, Tenancy, Tenant
from tierlm.serving.validation import (DEFAULT_MAX_BODY_BYTES, DEFAULT_REQUEST_READ_TIMEOUT, first_part_past,
                                       parse_request)

if TYPE_CHECKING:
    from tierlm.serving.lora_admin import LoRAUpdates

M = TypeVar("M")

logger = logging.getLogger("tierlm.serving")


@dataclass
class ServerState:
    models: ModelRegistry
    auth: Authenticator
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Seconds a client has for its request head, and for each gap in its body (0: no limit).
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT
    # Seconds one write to a streaming client may wait for it to read, before the request is
    # aborted and the connection closed (0: no limit).
    stream_send_timeout: float = DEFAULT_STREAM_SEND_TIMEOUT
    inflight: InflightRequests = field(default_factory=InflightRequests)
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's stored responses
    tenancy: Tenancy = field(default_factory=Tenancy)  # keys → tenants, and their limits
    safety: SafetyPolicies = field(default_factory=SafetyPolicies)  # phrase policies on prompts and answers
    sla: SlaGuard = field(default_factory=SlaGuard)  # breakers per model and tier, fallback models
    batches: BatchStore = field(default_factory=BatchStore)  # the Message Batches API's batches
    # Who may load and unload LoRA adapters at run time (lora_admin.py); None: nobody.
    lora_updates: "LoRAUpdates | None" = None
    draining: bool = False
    client_waits: ClientWaits = field(default_factory=ClientWaits)  # body reads and stream writes (client_waits.py)

    async def admit(self, request: Request) -> RequestContext:
        """Authenticate, find the key's tenant and, for a generation request, take one request of
        the tenant's limits (a 429 if it is over one). The hold ends with the response
        (tenancy.TenancyMiddleware)."""
        scope_state = request.scope.setdefault("state", {})
        preset = scope_state.get(BATCH_CONTEXT)
        if preset is not None:  # a request of a message batch, run in process as its creator (batches.py)
            if self.draining:
                raise Overloaded("the server is shutting down; retry on another replica or after restart")
            observer = scope_state.get("telemetry")
            if observer is not None and preset.tenant_id is not None:
                observer.tenant = preset.tenant_id
            return replace(preset, request_id=request_id_of(request))
        context, tenant = self._identify(request)
        if request.method == "POST" and request.url.path in GENERATION_ROUTES and TICKET not in scope_state:
            ticket = await self.tenancy.admit(tenant, api_style_for(request.url.path, request.headers))
            if ticket is not None:
                scope_state[TICKET] = ticket
        return context

    def identify(self, request: Request) -> RequestContext:
        """Authenticate and find the key's tenant, taking nothing of its limits: for the routes
        that generate nothing (models, count_tokens, stored responses)."""
        return self._identify(request)[0]

    def _identify(self, request: Request) -> tuple[RequestContext, Tenant]:
        if self.draining:
            raise Overloaded("the server is shutting down; retry on another replica or after restart")
        api_key_id = self.auth.authenticate(request.headers)
        context, tenant = self.context_of_key(api_key_id, request_id_of(request))
        observer = request.scope.setdefault("state", {}).get("telemetry")
        if observer is not None and tenant.id is not None:
            observer.tenant = tenant.id  # a refusal or a 400 counts under its tenant too
        return context, tenant

    def batch_context_of(self, api_key_id: str | None) -> RequestContext | None:
        """What a restored batch's requests run as: its key's context now (None: the key is gone)."""
        if api_key_id is not None and api_key_id not in set(getattr(self.auth, "key_ids", None) or ()):
            return None
        return self.context_of_key(api_key_id, "")[0]

    def context_of_key(self, api_key_id: str | None, request_id: str) -> tuple[RequestContext, Tenant]:
        """What a request of this key runs as: its tenant's priority, share, salt, policies."""
        tenant = self.tenancy.tenant_of(api_key_id)
        # The cache salt is the tenant's: a key reads in its usage whether a prompt was cached, so
        # no other tenant's prompts may be (one could tell what another had recently sent).
        return RequestContext(request_id=request_id, api_key_id=api_key_id, tenant_id=tenant.id,
                              priority=tenant.priority, cache_salt=tenant.cache_salt, tenant_weight=tenant.weight,
                              kv_share=tenant.kv_share, kv_cache_share=tenant.kv_cache_share, tier=tenant.tier, ttft_target_s=tenant.ttft_target_s,
                              breaker=tenant.breaker, max_batch_requests=tenant.max_batch_requests,
                              safety=self.safety.for_request(tenant.tier, tenant.id) if self.safety else None,
                              sla=self.sla, models=tenant.models), tenant

    async def parse(self, request: Request, cls: type[M], counting: bool = False, items: str = "messages") -> M:
        """The request body as `cls` (400 in the API's shape if it is not one). Once the JSON
        decodes, a "model" this server serves labels the request's telemetry, so a request
        refused for a bad field (max_tokens 0, temperature 9) counts under its model. Before it
        is validated, more tools, messages (the body's list named `items`) and content blocks than
        the context holds (or, `counting`, than count_tokens counts) are refused: see `first_part_past`."""
        observer = request.scope.get("state", {}).get("telemetry")

        def before_validation(data: dict) -> None:
            name = data.get("model")
            served = isinstance(name, str) and name in self.models.names
            if observer is not None and served:
                observer.model = name
            names = [name] if served else self.models.names  # an unknown model is a 404 once validated
            context = max(int(getattr(self.models.get(n), "max_model_len", 0) or 0) for n in names)
            limit = context * (COUNT_CHARS_PER_CONTEXT_TOKEN if counting else 1)
            found = first_part_past(data, limit, items) if context else None
            if found is not None:
                where, count = found
                if where == "messages" and not counting:  # messages alone: _render_chat's rule and words
                    raise ContextLengthExceeded(context=context, prompt_tokens=count, max_tokens=None,
                                                prompt_field="messages", at_least=True)
                what = (f"the {limit} count_tokens counts ({COUNT_CHARS_PER_CONTEXT_TOKEN} per token of the "
                        f"{context}-token context)" if counting else f"the {context}-token context holds")
                raise InvalidRequest(
                    f"{where}: the request has {count} tools, messages and content blocks up to here, more than {what} "
                    "(each renders to a token at least); send fewer",
                    param=where, code=None if counting else ContextLengthExceeded.default_code,
                )

        return await parse_request(request, cls, self.max_body_bytes, on_json=before_validation,
                                   timeout=self.request_read_timeout)


    async def drain(self, timeout: float) -> None:
        """Refuse new work, give in-flight requests `timeout` seconds, then abort the rest.

        Aborted requests end normally with an error telling the client to retry (an `error`
        event for streams), rather than a connection cut mid-answer.
        """
        self.draining = True
        deadline = time.monotonic() + timeout
        # (A request still uploading its body is not in flight yet: it waits on its client.)
        while (len(self.inflight) or len(self.client_waits)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if len(self.inflight):
            logger.warning("aborting %d request(s) still running after %.1fs", len(self.inflight), timeout)
            await self.inflight.abort_all()
        # Bodies still arriving and writes to clients that stopped reading end within a second:
        # the first with the route's "shutting down" error, the second by closing the connection.
        self.client_waits.cut()


def server_state(request: Request) -> ServerState:
    return request.app.state.tierlm


def request_id_of(request: Request) -> str:
    """Set by `RequestIdMiddleware` for every HTTP request."""
    return request.scope.get("state", {}).get("request_id") or "req_unknown"
