"""An HTTP router in front of several tierlm replicas (or any server with the same API): one
address for clients, each request sent to the replica that holds its prompt's prefix.

Why a router and not a plain load balancer: a replica's KV cache is its own, so where a request
lands decides whether its prefix is a cache hit (`affinity.py`). Beyond placement it does what a
client would otherwise have to: a replica that cannot be reached, or that sheds the request
(529 / 503 before any answer), is skipped and the request goes to the next one; stored
Responses-API objects are found on the replica that made them; a replica that dies is probed
until it answers `/ready` again. Errors of its own come in the route's API shape (Anthropic's
529 `overloaded_error`, OpenAI's 503), never as a stack trace.

What it leaves to the replicas: the SLA guard, tokens_per_minute and KV quotas, each per replica,
and without `--api-keys`, authentication (keys are forwarded unchanged, and a bad key gets the
replica's own 401). With the replicas' keys and tenants files it authenticates itself, routes by
tenant, and holds each tenant to requests_per_minute and max_concurrent across the replicas (with
`--limits-store`, across routers too); with `admit_limits` off, the replicas do all of that
through a limits store they share. It keeps no conversation state and can be restarted freely;
its affinity record then starts empty.

It is a raw ASGI app: it streams bodies both ways without buffering an answer, and watches for
the client leaving so that an abandoned stream's upstream connection is closed at once (the
replica then aborts the request and frees its KV blocks).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable
from urllib.parse import parse_qsl

import anyio
import httpx
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from tierlm.dist.affinity import (
    ROUTING_POLICIES,
    AffinityIndex,
    Choice,
    Replica,
    choose_replica,
    prefix_chain,
    prompt_prefix,
)
from tierlm.serving.errors import (
    APIError,
    InvalidRequest,
    Overloaded,
    RequestTooLarge,
    api_style_for,
    error_body,
)
from tierlm.dist.listing import ListKind, list_kind, merged_list
from tierlm.serving.auth import Authenticator, presented_key
from tierlm.serving.telemetry import GENERATION_ROUTES
from tierlm.serving.tenancy import Tenancy, Ticket
from tierlm.serving.validation import DEFAULT_MAX_BODY_BYTES

__all__ = ["RouterConfig", "Router", "RouterThread", "DEFAULT_AFFINITY_CHUNKS"]

logger = logging.getLogger("tierlm.router")
# httpx logs every request at INFO: each probe and forwarded request would be a line here.
logging.getLogger("httpx").setLevel(logging.WARNING)

#: Chunks remembered per replica: 256-byte chunks, ~64 tokens each, so ~6M tokens of prompts:
#: about what a GPU replica's device and host tiers hold.
DEFAULT_AFFINITY_CHUNKS = 100_000
# vLLM's runtime LoRA routes: every replica takes them (Router._broadcast)
LORA_ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_OWNERS_KEPT = 100_000  # Responses-API ids -> the replica that stored them
_PROBE_TIMEOUTS_DOWN = 3
# Hop-by-hop headers (RFC 9110 7.6.1) are the router's own, per connection, and not forwarded.
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
        "proxy-authenticate", "proxy-authorization", "host", "content-length"}
_OWN_RESPONSE_HEADERS = {"server", "date"}  # the router's server sets its own
# Objects a replica keeps, found again by their ids: stored responses, message batches, and
# OpenAI's files and batches.
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"((?:resp_|msgbatch_|batch_|file-|file_)[A-Za-z0-9_\-]+)"')
_ID_ROUTE = re.compile(r"^/v1/(?:responses|messages/batches|batches|files)/((?:resp_|msgbatch_|batch_|file-|file_)"
                       r"[A-Za-z0-9_\-]+)(/.*)?$")
# A request naming an uploaded file (an Anthropic document's source, `file_...`; a Chat
# Completions file part or a Responses input_file, `file-...`): sent where the file is
_FILE_REF = re.compile(rb'"file_id"\s*:\s*"(file[_-][A-Za-z0-9]+)"')
_NAMES_FILES = ("/v1/messages", "/v1/messages/count_tokens", "/v1/messages/batches", "/v1/chat/completions",
                "/v1/responses")
# POSTed: the answer's id is remembered
_CREATES_OBJECT = ("/v1/responses", "/v1/messages/batches", "/v1/batches", "/v1/files")


@dataclass
class RouterConfig:
    """What `tierlm router` (and `tierlm serve --replicas`) is given."""

    replicas: list[str]
    policy: str = "cache_aware"
    affinity_chunks: int = DEFAULT_AFFINITY_CHUNKS
    health_interval: float = 2.0  # seconds between probes of each replica's /ready
    connect_timeout: float = 5.0
    #: Longest wait for a replica's next bytes once a request is sent (a long prefill sends
    #: nothing for a while; streams send pings)
    read_timeout: float = 600.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: With both (the replicas' own keys and tenants files), the router admits each generation
    #: request against its tenant's requests_per_minute and max_concurrent across all replicas
    #: (each replica alone sees only its share), and routes by the tenant's cache salt.
    auth: Authenticator | None = None
    tenancy: Tenancy | None = None
    #: False: the replicas hold the tenants to their limits across all of them (one shared
    #: limits store), and the router only authenticates and routes.
    admit_limits: bool = True

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the router needs at least one replica URL (--replica http://HOST:PORT)")
        for url in self.replicas:
            if not re.match(r"^https?://[^/\s]+/?$", url):
                raise ValueError(f"replica '{url}' is not a server's base URL; give it as http://HOST:PORT")
        if len(set(u.rstrip("/") for u in self.replicas)) != len(self.replicas):
            raise ValueError("a replica URL is given twice; each replica once")
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy '{self.policy}'; choose one of {', '.join(ROUTING_POLICIES)}")
        if self.affinity_chunks < 1:
            raise ValueError(f"--affinity-chunks must be at least 1, got {self.affinity_chunks}")


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tierlm:router_requests", "Requests sent to each replica, by why it was chosen "
                                "(affinity; balance: a replica with a longer prefix was busier; least_load; "
                                "round_robin; owner and search: stored responses; any: no prompt; merged: each replica asked for a list of "
                                "files or batches; broadcast: each replica told to load or unload a LoRA adapter).",
                                ["replica", "decision"], registry=r)
        self.retries = Counter("tierlm:router_retries", "Requests moved on to another replica, by why (unreachable; "
                               "broken: the connection failed before an answer; overloaded; not_here).",
                               ["replica", "reason"], registry=r)
        self.unrouted = Counter("tierlm:router_unrouted", "Requests answered by the router itself because no "
                                "replica could take them.", ["reason"], registry=r)
        self.prompt_chunks = Counter("tierlm:router_prompt_chunks", "Prompt chunks (256 bytes) routed, and those "
                                     "of them the chosen replica was known to hold.", ["kind"], registry=r)
        self.up = Gauge("tierlm:router_replica_up", "1 while a replica answers /ready, else 0.", ["replica"],
                        registry=r)
        self.in_flight = Gauge("tierlm:router_in_flight", "Requests in flight at each replica through this router.",
                               ["replica"], registry=r)


class Router:
    """Replicas, their affinity records and load, and the forwarding itself (`__call__` is ASGI)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.replicas = [Replica(url=u.rstrip("/"), index=AffinityIndex(config.affinity_chunks), name=str(i))
                         for i, u in enumerate(config.replicas)]
        self.metrics = _Metrics()
        for r in self.replicas:
            self.metrics.up.labels(r.name).set(1)
            self.metrics.in_flight.labels(r.name).set(0)
        self._owners: OrderedDict[str, Replica] = OrderedDict()
        self._turn = 0
        self._client: httpx.AsyncClient | None = None
        self._health: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        timeout = httpx.Timeout(connect=self.config.connect_timeout, read=self.config.read_timeout,
                                write=self.config.read_timeout, pool=None)
        # No pool limit: every request in flight holds one upstream connection, as a proxy must.
        # Idle connections are dropped after 4 s, before uvicorn's 5 s keep-alive closes them under a request.
        self._client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0), follow_redirects=False)
        await self.probe_all()
        self._health = asyncio.create_task(self._probe_forever())

    async def stop(self) -> None:
        if self._health is not None:
            self._health.cancel()
            try:
                await self._health
            except asyncio.CancelledError:
                pass
        if self._client is not None:
            await self._client.aclose()
        if self.config.tenancy is not None:
            await self.config.tenancy.close()

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                await self.probe_all()
            except Exception:  # a probe must never end the loop
                logger.exception("replica health probe failed")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(r) for r in self.replicas))

    async def _probe(self, r: Replica) -> None:
        """A refused connection or an answer other than 200 (503: loading, draining) takes the
        replica out at once; a probe that times out only the third time running (a replica busy
        with a long prefill may answer late, and coming back costs it its affinity record)."""
        assert self._client is not None
        try:
            resp = await self._client.get(r.url + "/ready", timeout=self.config.connect_timeout)
            ok, why = resp.status_code == 200, f"/ready answered {resp.status_code}"
            r.probe_timeouts = 0
        except httpx.TimeoutException as e:
            r.probe_timeouts += 1
            if r.probe_timeouts < _PROBE_TIMEOUTS_DOWN:
                return
            ok, why = False, f"{_PROBE_TIMEOUTS_DOWN} probes of /ready timed out ({type(e).__name__})"
        except httpx.HTTPError as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        self._mark(r, ok, why)

    def _mark(self, r: Replica, up: bool, why: str = "") -> None:
        if up and not r.up:
            logger.info("replica %s (%s) is back", r.name, r.url)
            r.index.clear()  # a restarted replica's cache is empty
        elif not up and r.up:
            logger.warning("replica %s (%s) is out of rotation: %s; it is probed every %gs until /ready "
                           "answers 200", r.name, r.url, why, self.config.health_interval)
        r.up, r.last_error = up, ("" if up else why)
        self.metrics.up.labels(r.name).set(1 if up else 0)

    # -- ASGI ------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]
        hmap = dict(headers)
        style = api_style_for(path, hmap)
        if path in ("/health", "/ready", "/metrics") and scope["method"] in ("GET", "HEAD"):
            await self._own_route(path, send)
            return
        try:
            body = await self._read_body(receive)
            salt, ticket = await self._admit(scope["method"], path, hmap, style)
        except APIError as e:
            await self._error(send, e, style)
            return
        except _Disconnected:
            return
        if scope["method"] == "POST" and path in LORA_ADMIN_PATHS:
            await self._broadcast(send, path, headers, body, style)
            return
        kind = list_kind(scope["method"], path, hmap)
        if kind is not None:  # files and batches live on their replicas: the lists are merged here
            await self._merged_list(send, kind, path, headers, scope.get("query_string", b""), style)
            return
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        shed: list[bool] = []  # set by `_attempts`: the answer was an overload refusal, no replica ran it
        try:
            await self._forward(scope, receive, tracked, path, headers, body, style, salt, ticket, shed)
        except Exception:  # a bug of the router's: logged with its trace, the client gets a 500 in its API's shape
            logger.exception("router error on %s %s", scope["method"], path)
            if started:
                raise
            await self._error(send, APIError("internal error in the router; the cause is in its log"), style)
        finally:
            if ticket is not None:
                # Tokens are charged by the replica that ran the request. One that every replica
                # shed (529 / 503: SLA guard, draining) or that found none up ran nowhere: its
                # request unit is given back, as a replica gives back the unit of one it sheds
                # (both SDKs retry these, and would spend the tenant's minute on refusals).
                await ticket.release(0, refund_request=bool(shed))

    async def _merged_list(self, send: Callable, kind: ListKind, path: str, headers: list[tuple[str, str]],
                           query_string: bytes, style: str) -> None:
        assert self._client is not None
        up = await self._every_replica_up(send, style, "list from")
        if not up:
            return

        def down(url: str, e: Exception) -> None:
            logger.warning("replica %s did not answer a list of %s (%s); the list leaves its objects out", url, path, e)

        forwarded = {k: v for k, v in headers if k not in _HOP}
        query = dict(parse_qsl(query_string.decode("latin-1")))
        try:
            status, content = await merged_list(self._client, [r.url for r in up], kind, path, forwarded, query, down)
        except APIError as e:
            await self._error(send, e, style)
            return
        for r in up:
            self.metrics.requests.labels(r.name, "merged").inc()
        await _respond(send, status, content, "application/json")

    async def _every_replica_up(self, send: Callable, style: str, to: str) -> list[Replica]:
        """The replicas up now; none: the client has its overload error (and the list is empty)."""
        up = [r for r in self.replicas if r.up]
        if not up:
            self.metrics.unrouted.labels("no_replica").inc()
            await self._error(send, Overloaded(f"no replica of this server is up to {to}; retry after a few seconds",
                                               headers={"retry-after": "2"}), style)
        return up

    async def _broadcast(self, send: Callable, path: str, headers: list[tuple[str, str]], body: bytes,
                         style: str) -> None:
        """vLLM's runtime LoRA routes change what a model name means, so every replica must hear
        them, not the one a prompt's affinity picks: sent to every replica up, at once. All took
        it: the first one's answer, with `x-tierlm-replicas` naming them. One refused it (a bad
        path, a taken name, a key that may not: they share files and keys files, so they refuse
        alike): its answer, `x-tierlm-replicas` naming those that took it anyway. A replica down
        now misses it (logged): a replica loads at start only what its command line names."""
        assert self._client is not None
        up = await self._every_replica_up(send, style, "change adapters on")
        if not up:
            return
        forwarded = {k: v for k, v in headers if k not in _HOP}

        async def one(r: Replica) -> httpx.Response | Exception:
            try:
                return await self._client.post(r.url + path, content=body, headers=forwarded)  # type: ignore[union-attr]
            except httpx.HTTPError as e:
                return e

        answers = await asyncio.gather(*(one(r) for r in up))
        took = [r.name for r, a in zip(up, answers) if isinstance(a, httpx.Response) and a.status_code < 400]
        for r in up:
            self.metrics.requests.labels(r.name, "broadcast").inc()
        missed = [r.name for r in self.replicas if not r.up]
        if missed:
            logger.warning("%s went to %s only: %s down, and will not have the change", path, ", ".join(took) or "none",
                           ", ".join(missed))
        told = [("x-tierlm-replicas", ",".join(took))]
        for r, a in zip(up, answers):
            if isinstance(a, Exception):
                err = APIError(f"replica {r.name} did not answer {path} ({type(a).__name__}); it may or may not have "
                               f"the change: replicas that took it: {', '.join(took) or 'none'}")
                await self._error(send, err, style)
                return
            if a.status_code >= 400:
                await _respond(send, a.status_code, a.content, a.headers.get("content-type"), told)
                return
        first = answers[0]
        assert isinstance(first, httpx.Response)
        await _respond(send, first.status_code, first.content, first.headers.get("content-type"), told)

    async def _admit(self, method: str, path: str, headers: dict[str, str],
                     style: str) -> tuple[str | None, Ticket | None]:
        """With tenants: the caller's cache salt (what routing keys prefixes by) and its hold on
        its tenant's limits for a generation request; raises the replica's own 401 or 429."""
        if self.config.tenancy is None or self.config.auth is None:
            return None, None
        key_id = self.config.auth.authenticate(headers)
        tenant = self.config.tenancy.tenant_of(key_id)
        ticket = None
        if method == "POST" and path in GENERATION_ROUTES and self.config.admit_limits:
            # Without its tokens_per_minute: the replicas count tokens (they are known where a
            # request ran); the router's own bucket of them, never charged, put "all remaining"
            # token headers on its 429s.
            routed = replace(tenant, limits=replace(tenant.limits, tokens_per_minute=None))
            ticket = await self.config.tenancy.admit(routed, style)  # type: ignore[arg-type]
        return tenant.cache_salt, ticket

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as e:  # reported to uvicorn, which exits
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _own_route(self, path: str, send: Callable) -> None:
        if path == "/metrics":
            for r in self.replicas:
                self.metrics.in_flight.labels(r.name).set(r.in_flight)
            await _respond(send, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
            return
        up = [r.name for r in self.replicas if r.up]
        status = 200 if (path == "/health" or up) else 503
        doc = {"status": "ok" if status == 200 else "no replica ready",
               "replicas": [{"replica": r.name, "url": r.url, "up": r.up, "in_flight": r.in_flight,
                             **({"error": r.last_error} if r.last_error else {})} for r in self.replicas]}
        await _respond(send, status, json.dumps(doc).encode(), "application/json")

    async def _read_body(self, receive: Callable) -> bytes:
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Disconnected
            part = msg.get("body", b"")
            size += len(part)
            if size > self.config.max_body_bytes:
                raise RequestTooLarge(f"the request body is larger than this router's limit of "
                                      f"{self.config.max_body_bytes} bytes (--max-body-bytes)")
            chunks.append(part)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    async def _error(self, send: Callable, err: APIError, style: str) -> None:
        """The router's own error (a 401 or 429 it decides, a replica that did not answer), with a
        request id of its own in the body and headers, as every replica response carries one."""
        request_id = "req_" + uuid.uuid4().hex[:24]
        body = json.dumps(error_body(err, style, request_id)).encode()  # type: ignore[arg-type]
        await _respond(send, err.status_for(style), body, "application/json",  # type: ignore[arg-type]
                       [*err.headers.items(), ("request-id", request_id), ("x-request-id", request_id)])

    # -- routing ---------------------------------------------------------------------------
    def _plan(self, method: str, path: str, headers: dict[str, str], body: bytes, salt: str | None) -> "_Plan":
        """Where to try a request, in order: `_Plan.next(tried)` names the next replica."""
        m = _ID_ROUTE.match(path)
        if m is not None:  # a stored response: where it was made, else ask each replica
            return _Plan(self, owner=self._owners.get(m.group(1)), search="not_found")
        try:
            parsed = json.loads(body) if body and method == "POST" else None
        except (ValueError, UnicodeDecodeError):
            parsed = None
        ref = _FILE_REF.search(body) if method == "POST" and path in _NAMES_FILES else None
        if ref is not None:  # (the file's replica also holds the prefixes of earlier requests naming it)
            return _Plan(self, owner=self._owners.get(ref.group(1).decode()), search="file_not_found")
        prev = parsed.get("previous_response_id") if isinstance(parsed, dict) and path == "/v1/responses" else None
        if isinstance(parsed, dict) and path == "/v1/batches" and isinstance(parsed.get("input_file_id"), str):
            # where its input file was uploaded (another replica answers 404)
            return _Plan(self, owner=self._owners.get(parsed["input_file_id"]), search="not_found")
        if isinstance(prev, str):
            return _Plan(self, owner=self._owners.get(prev), search="previous_not_found")
        data = prompt_prefix(path, parsed)
        if data is None:
            return _Plan(self, search="any")
        model = parsed.get("model") if isinstance(parsed, dict) else None
        # The tenant's cache salt where the router knows tenants, else the caller's key: what the
        # replicas' caches are keyed by (a key is a tenant of its own without a tenants file). The
        # key itself, however it came: "x-api-key: K" and "Authorization: Bearer K" are one caller
        # (the raw header values sent the same prefix to two replicas, one of them cold).
        who = salt if salt is not None else presented_key(headers) or ""
        return _Plan(self, chain=prefix_chain(hashlib.sha256(f"{who}\0{model}".encode()).digest(), data))

    async def _forward(self, scope: dict, receive: Callable, send: Callable, path: str,
                       headers: list[tuple[str, str]], body: bytes, style: str, salt: str | None,
                       ticket: Ticket | None, shed: list[bool]) -> None:
        """Send the request on, watching for the client leaving meanwhile: then the upstream
        request is cancelled wherever it is (waiting for a non-streamed answer, or streaming),
        which closes its connection, and the replica aborts it (its KV blocks freed)."""

        async def attempts(cancel: anyio.CancelScope) -> None:
            try:
                if await self._attempts(scope, send, path, headers, body, style, salt, ticket):
                    shed.append(True)
            finally:
                cancel.cancel()

        async def watch(cancel: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(attempts, tg.cancel_scope)
            tg.start_soon(watch, tg.cancel_scope)

    async def _attempts(self, scope: dict, send: Callable, path: str, headers: list[tuple[str, str]],
                        body: bytes, style: str, salt: str | None, ticket: Ticket | None) -> bool:
        """Try the request's replicas in turn; True when the client got an overload refusal (every
        replica shed it, or none was up): no replica ran it."""
        method = scope["method"]
        hmap = dict(headers)
        plan = self._plan(method, path, hmap, body, salt)
        # The router's view of the request limit, across replicas, replaces each replica's own
        # (tokens are counted by the replicas: theirs stay).
        limit_headers = {k: v for k, v in (ticket.headers if ticket is not None else {}).items() if "requests" in k}
        qs = scope.get("query_string", b"").decode("latin-1")
        target = path + (f"?{qs}" if qs else "")
        out_headers = [(k, v) for k, v in headers if k not in _HOP]
        client = scope.get("client")
        if client:
            prior = hmap.get("x-forwarded-for")
            out_headers.append(("x-forwarded-for", f"{prior}, {client[0]}" if prior else client[0]))
        assert self._client is not None
        tried: set[str] = set()
        last: tuple[int, list[tuple[str, str]], bytes] | None = None  # a refusal to pass on if all refuse
        while True:
            choice = plan.next(tried)
            if choice is None:
                break
            r = choice.replica
            tried.add(r.url)
            hold = _Hold(r, choice.work)
            release = hold.release
            try:
                req = self._client.build_request(method, r.url + target, headers=out_headers, content=body)
                upstream = await self._client.send(req, stream=True)
                hold.answering()
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                release()
                self._mark(r, False, f"{type(e).__name__}: {e}")
                self.metrics.retries.labels(r.name, "unreachable").inc()
                continue
            except httpx.TransportError as e:
                # Connected, but the connection failed before an answer (most often a kept-alive
                # connection the replica closed as this request went out): the replica is up,
                # and saw a disconnect if it saw the request at all. Tried elsewhere.
                release()
                logger.info("replica %s (%s): %s: %s; trying the request elsewhere", r.name, r.url,
                            type(e).__name__, e)
                self.metrics.retries.labels(r.name, "broken").inc()
                continue
            except BaseException:
                release()
                raise
            try:
                reason = await plan.refused(upstream)
            except BaseException:
                release()
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
                raise
            if reason is not None:
                try:
                    content = await _raw(upstream)
                except httpx.HTTPError:
                    content = b""
                finally:
                    with anyio.CancelScope(shield=True):
                        await upstream.aclose()
                    release()
                last = (upstream.status_code, _response_headers(upstream, r), content)
                self.metrics.retries.labels(r.name, reason).inc()
                continue
            if upstream.status_code < 400:  # a refused request (a bad body, an unknown model) cached nothing
                plan.routed(choice, r)
            self.metrics.requests.labels(r.name, choice.decision).inc()
            try:
                await self._relay(upstream, r, send, style, path, sniff=path in _CREATES_OBJECT and method == "POST",
                                  extra_headers=limit_headers)
            finally:
                release()
            return False
        if last is not None:  # every replica refused: the last refusal, as the replica said it
            status, hdrs, content = last
            await _respond(send, status, content, None, hdrs)
            return status in (503, 529)
        self.metrics.unrouted.labels("no_replica").inc()
        down = [f"{r.name} ({r.last_error or 'down'})" for r in self.replicas if not r.up]
        if plan.search in ("not_found", "previous_not_found") and not down:
            err: APIError = InvalidRequest("no replica holds this response; it may have expired or been deleted")
            await self._error(send, err, style)
            return False
        err = Overloaded("no replica of this server can take the request now: "
                         + ("; ".join(down) if down else "every replica refused it")
                         + ". Retry after a few seconds.", headers={"retry-after": "2"})
        await self._error(send, err, style)
        return True

    def _remember(self, rid: str, r: Replica) -> None:
        self._owners[rid] = r
        self._owners.move_to_end(rid)
        while len(self._owners) > _OWNERS_KEPT:
            self._owners.popitem(last=False)

    async def _relay(self, upstream: httpx.Response, r: Replica, send: Callable, style: str, path: str,
                     *, sniff: bool, extra_headers: dict[str, str]) -> None:
        """Stream `upstream` to the client as it comes. With `sniff`, the id of the response it
        creates (Responses API) is remembered as living on `r`. A replica that fails
        mid-answer ends an event stream with an error event in the route's shape."""
        seen = b""
        sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        try:
            hdrs = [(k, v) for k, v in _response_headers(upstream, r) if k not in extra_headers]
            await send({"type": "http.response.start", "status": upstream.status_code,
                        "headers": _encode(hdrs + list(extra_headers.items()))})
            try:
                async for chunk in _chunks(upstream):
                    if sniff and len(seen) < 16384:
                        seen += chunk
                        m = _RESPONSE_ID.search(seen)
                        if m is not None:
                            self._remember(m.group(1).decode(), r)
                            sniff = False
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as e:
                logger.warning("replica %s (%s) broke off an answer to %s: %s", r.name, r.url, path, e)
                if not sse:
                    return  # the response ends unfinished: uvicorn closes the connection, the client sees it cut
                await send({"type": "http.response.body", "body": _sse_error(style, path), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()


class RouterThread:
    """A `Router` under uvicorn on 127.0.0.1 (a free port) in a background thread of this process,
    as a context manager: for `tierlm bench router` and the tests, which drive it from here."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(router, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "RouterThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the router did not start within 30 s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class _Disconnected(Exception):
    pass


class _Hold:
    """One request's share of a replica's load while it is there: counted in flight until it
    ends, and its prompt's work (`Choice.work`) pending until the replica starts answering. A
    tierlm replica answers (status and headers) once the first token is out, so from then on
    the prompt is done and only its decoding, one unit, remains."""

    def __init__(self, replica: Replica, work: int) -> None:
        self.replica, self.prompt = replica, work - 1
        replica.in_flight += 1
        replica.pending += work
        self._answering = self._released = False

    def answering(self) -> None:
        if not self._answering and not self._released:
            self._answering = True
            self.replica.pending -= self.prompt

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.replica.in_flight -= 1
            self.replica.pending -= 1 + (0 if self._answering else self.prompt)


class _Plan:
    """The order in which one request tries replicas, and which answers send it on."""

    def __init__(self, router: Router, *, chain: list[bytes] | None = None, owner: Replica | None = None,
                 search: str | None = None) -> None:
        self.router, self.chain, self.owner, self.search = router, chain, owner, search

    def next(self, tried: set[str]) -> Choice | None:
        live = [r for r in self.router.replicas if r.up and r.url not in tried]
        if self.owner is not None:  # a stored response lives on one replica only
            return Choice(self.owner, "owner", 0, 0) if self.owner.url not in tried and self.owner.up else None
        turn = self.router._turn
        self.router._turn += 1
        if self.chain is None:  # no prompt: the least loaded, to find a stored response or list models
            choice = choose_replica("least_load", live, [], turn)
            return Choice(choice.replica, "search" if self.search != "any" else "any", 0, 0) if choice else None
        return choose_replica(self.router.config.policy, live, self.chain, turn)

    async def refused(self, resp: httpx.Response) -> str | None:
        """Why `resp` sends the request on to another replica, or None to pass it to the client."""
        if self.chain is not None or self.search == "any":
            # shed before any answer (SLA guard, draining): another replica may have room
            return "overloaded" if resp.status_code in (503, 529) else None
        if self.owner is not None:
            return None
        if self.search == "not_found" and resp.status_code == 404:
            return "not_here"
        if self.search == "previous_not_found" and resp.status_code == 400:
            if b"previous_response_not_found" in await _raw(resp):
                return "not_here"
        if self.search == "file_not_found" and resp.status_code == 400:
            if b"upload it through the Files API" in await _raw(resp):
                return "not_here"
        return None

    def routed(self, choice: Choice, r: Replica) -> None:
        if self.chain is not None:
            r.index.insert(self.chain)
            m = self.router.metrics.prompt_chunks
            m.labels("total").inc(choice.chunks)
            m.labels("matched").inc(choice.matched)


async def _raw(resp: httpx.Response) -> bytes:
    """A response's body as the replica sent it (not decoded), read once and kept."""
    raw = resp.extensions.get("tierlm.raw")
    if raw is None:
        raw = b"".join([c async for c in resp.aiter_raw()])
        resp.extensions["tierlm.raw"] = raw
    return raw


async def _chunks(resp: httpx.Response):
    raw = resp.extensions.get("tierlm.raw")
    if raw is not None:  # read already, to decide whether to move on
        yield raw
        return
    async for chunk in resp.aiter_raw():
        yield chunk


def _response_headers(upstream: httpx.Response, r: Replica) -> list[tuple[str, str]]:
    out = [(k.lower(), v) for k, v in upstream.headers.multi_items()
           if (k.lower() not in _HOP or k.lower() == "content-length") and k.lower() not in _OWN_RESPONSE_HEADERS]
    out.append(("x-tierlm-replica", r.name))
    return out


def _encode(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]


async def _respond(send: Callable, status: int, body: bytes, content_type: str | None,
                   headers: list[tuple[str, str]] | None = None) -> None:
    hdrs = [(k, v) for k, v in (headers or []) if k != "content-length"]
    if content_type is not None:
        hdrs = [(k, v) for k, v in hdrs if k != "content-type"] + [("content-type", content_type)]
    hdrs.append(("content-length", str(len(body))))
    await send({"type": "http.response.start", "status": status, "headers": _encode(hdrs)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _sse_error(style: str, path: str) -> bytes:
    """The last frame of a stream whose replica failed mid-answer, in the route's own shape."""
    err = APIError("the replica serving this stream failed mid-answer; retry the request")
    if path == "/v1/responses":
        doc = {"type": "error", "code": "server_error", "message": err.message, "param": None}
        return b"event: error\ndata: " + json.dumps(doc).encode() + b"\n\n"
    if style == "openai":
        return b"data: " + json.dumps(error_body(err, "openai", None)).encode() + b"\n\n"
    return b"event: error\ndata: " + json.dumps(error_body(err, "anthropic", None)).encode() + b"\n\n"
