"""Running the app under uvicorn with a graceful shutdown that tells clients what happened.

uvicorn alone, on SIGTERM, stops accepting connections, waits for open ones and finally
cancels them, which cuts streams off mid-answer. `GracefulServer` first drains the app
(`ServerState.drain`): requests get `shutdown_timeout` seconds to finish, then are aborted in
the engine so each ends with a proper error (an SSE `error` event, or a 529) before uvicorn's
own, slightly later, deadline.
"""
from __future__ import annotations

import asyncio
import errno
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from tierlm.serving.state import ServerState

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
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + FLUSH_GRACE_S)
    return GracefulServer(config, app.state.tierlm, shutdown_timeout)


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

