"""Running the app under uvicorn with a graceful shutdown that tells clients what happened.

uvicorn alone, on SIGTERM, stops accepting connections, waits for open ones and finally
cancels them, which cuts streams off mid-answer. `GracefulServer` first drains the app
(`ServerState.drain`): requests get `shutdown_timeout` seconds to finish, then are aborted in
the engine so each ends with a proper error (an SSE `error` event, or a 529) before uvicorn's
own, slightly later, deadline.

It also guards the transport against clients that hold connections without using them: a
request head must arrive within the state's `request_read_timeout` (`TimedH11Protocol`), the
process may open as many files as its hard limit allows (`raise_fd_limit`), and at that limit
asyncio's accept loop logs one line per interval, not thousands (`AcceptErrorFilter`).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import resource
import signal
import socket
import time
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tierlm.serving.state import ServerState

logger = logging.getLogger("tierlm.serving")

# Time for aborted streams to send their final error frame before uvicorn cancels them.
FLUSH_GRACE_S = 3.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A second SIGTERM quits at once, as a second SIGINT does in uvicorn: an operator who
        runs `kill PID` again (SIGTERM, as everything but a terminal's Ctrl-C sends) means "now"."""
        again = self.should_exit
        super().handle_exit(sig, frame)
        if again and sig == signal.SIGTERM:
            self.force_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._drain_task = asyncio.create_task(self.state.drain(self.shutdown_timeout))
        await super().shutdown(sockets)
        if not self._drain_task.done():
            self._drain_task.cancel()


def make_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
                log_level: str = "info") -> GracefulServer:
    """A server for an app from `build_app`; run it with `.run()` (or `.run(sockets=[...])`)."""
    state: ServerState = app.state.tierlm
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + FLUSH_GRACE_S,
                            http=timed_h11_protocol(state))
    install_accept_error_filter()
    install_probe_log_filter()
    return GracefulServer(config, state, shutdown_timeout)


# ---- connections that never send a request ------------------------------------------------


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head (request line and
    headers) has not arrived `state.request_read_timeout` seconds after it connected or after its
    last response. uvicorn has no such deadline: its keep-alive timer stops at the first byte,
    so a connection that sent nothing, or half a head, was held for ever (and enough of them
    use up the process's file descriptors). The body has its own deadline (`read_body`)."""

    state: ServerState  # set by `timed_h11_protocol`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_owed = False  # answered early (a 401 before its body): the rest of a body to come
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # waiting for the next request's head
        elif self.conn.their_state is h11.SEND_BODY:
            # The rest of a body no one reads now: timed per gap, as a body being read is (it
            # was held by uvicorn's 5 s keep-alive alone, whatever --request-read-timeout said).
            self._body_owed = True
            self._arm_head_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self.scope is not None:  # uvicorn's way to close the connection now, whatever is unsent
            self.scope.setdefault("extensions", {})["tierlm.abort_connection"] = self.transport.abort
        if self._body_owed:
            if self.conn.their_state is h11.SEND_BODY:
                if not self.transport.is_closing():
                    self._arm_head_timer()  # more of it came: the next gap's deadline
                return
            self._body_owed = False  # all of it came: on to the next head
        if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
            self._head_timer.cancel()  # a whole head arrived (or the connection failed)
            self._head_timer = None
        elif (self._head_timer is None and self.conn.their_state is h11.IDLE
              and self.conn.our_state is h11.IDLE and not self.transport.is_closing()):
            # waiting for a head again without a response ending now: one answered early (a 401
            # before its body came), whose body then came; uvicorn's keep-alive timer is off too
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        timeout = self.state.request_read_timeout
        self._head_timer = self.loop.call_later(timeout, self._head_timed_out) if timeout else None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        owed = self._body_owed and self.conn.their_state is h11.SEND_BODY
        if (owed or self.conn.their_state is h11.IDLE) and not self.transport.is_closing():
            self.transport.abort()


def timed_h11_protocol(state: ServerState) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"state": state})


# ---- running out of file descriptors -------------------------------------------------------


def raise_fd_limit() -> None:
    """Raise the soft limit on open files to the hard one, as vLLM does: each connection takes
    one, and the usual soft default (1024) is soon reached by a busy server; at the limit new
    connections wait in the backlog while asyncio retries its accept every second."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft < hard:
        target = hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %s to %s (%s); the server accepts at "
                           "most about %s connections at once (raise it with `ulimit -n`)", soft, target, e, soft)


ACCEPT_ERROR = "socket.accept() out of system resource"


# asyncio's warning for each write past the fifth to a socket whose peer has gone. uvicorn
# writes a stream's frames until connection_lost runs, a loop pass after the send failed, so a
# client that drops a stream can cause several; the request is logged (499) and its blocks are
# freed, and the warning names no request: noise an operator would chase.
SEND_AFTER_LOSS = "socket.send() raised exception."


class AcceptErrorFilter(logging.Filter):
    """Lets one "socket.accept() out of system resource" record through per `interval` seconds,
    saying how many it held back. At the open-file limit asyncio's accept loop logs one full
    traceback per connection waiting in the backlog (up to 2048) every second: over 150 MB of
    log in a minute and a half. Drops SEND_AFTER_LOSS records."""

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self.interval = interval
        self._last = -float("inf")
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == SEND_AFTER_LOSS:
            return False
        if not str(record.msg).startswith(ACCEPT_ERROR):
            return True
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return False
        if self._suppressed:
            record.msg = (f"{record.msg}\n({self._suppressed} more like this in the last "
                          f"{now - self._last:.0f} s were not logged)")
        record.msg = f"{record.msg}\n(the process is at its open-file limit; new connections wait until some close)"
        self._last, self._suppressed = now, 0
        return True


def install_accept_error_filter(interval: float = 10.0) -> AcceptErrorFilter:
    """On the asyncio logger, once per process."""
    log = logging.getLogger("asyncio")
    for existing in log.filters:
        if isinstance(existing, AcceptErrorFilter):
            return existing
    accept_filter = AcceptErrorFilter(interval)
    log.addFilter(accept_filter)
    return accept_filter


class ProbeLogFilter(logging.Filter):
    """Drops uvicorn's access-log lines for successful probes (GET/HEAD /health, /ready,
    /metrics): a router or load balancer probing every 2 s, and a scraper, wrote most of the log."""

    PATHS = ("/health", "/ready", "/metrics")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:  # client, method, path, http version, status
            _, method, path, _, status = args
            if method in ("GET", "HEAD") and path in self.PATHS and status == 200:
                return False
        return True


def install_probe_log_filter() -> None:
    """On uvicorn's access logger, once per process."""
    log = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, ProbeLogFilter) for f in log.filters):
        log.addFilter(ProbeLogFilter())


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind the server's socket before any model loads (as vLLM does), so a busy port or a bad
    host fails in a second rather than after minutes of loading; `port` 0 picks a free one.
    Raises OSError naming the address."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OSError(f"cannot listen on host {host!r} ({e.strerror}); give --host an address of this "
                      "machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts need no wait
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            advice = "pick another --port or stop what is using it"
        elif e.errno == errno.EADDRNOTAVAIL:
            advice = "give --host an address of this machine, e.g. 127.0.0.1 or 0.0.0.0"
        elif e.errno == errno.EACCES:
            advice = "ports below 1024 need root: pick a --port of 1024 or more"
        else:
            advice = "check --host and --port"
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); {advice}") from None
    return sock

