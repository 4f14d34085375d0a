"""Waits on a client (the next part of a request body, a write to a stream) that a shutdown cuts
short.

Why: the drain aborts what is still running at `--shutdown-timeout`, but a request still
uploading its body is not running yet, and a stream whose client stopped reading cannot send
its final error frame; both waited for uvicorn's later deadline, which cancelled them with a
plain-text 500 or a logged traceback. Each such wait registers here; once the drain has
aborted the rest, every wait (also one begun afterwards) ends within `FLUSH_S`: the body read
answers with the route's "shutting down" error, the stalled stream closes its connection.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import anyio

FLUSH_S = 1.0  # what an aborted request still gets to send its last words (below server.FLUSH_GRACE_S)


class ClientWaits:
    def __init__(self) -> None:
        self._open: set[anyio.CancelScope] = set()
        self.cut_at: float | None = None  # the loop's time after which no wait on a client goes on

    def __len__(self) -> int:
        return len(self._open)

    @contextlib.contextmanager
    def wait(self, timeout: float | None) -> Iterator[anyio.CancelScope]:
        """`anyio.move_on_after(timeout)` (None or 0: no limit) that the shutdown can cut."""
        with anyio.move_on_after(timeout or math.inf) as scope:
            if self.cut_at is not None:
                scope.deadline = min(scope.deadline, self.cut_at)
            self._open.add(scope)
            try:
                yield scope
            finally:
                self._open.discard(scope)

    def cut(self, after: float = FLUSH_S) -> None:
        """End every wait on a client within `after` seconds, now and from now on."""
        self.cut_at = anyio.current_time() + after
        for scope in self._open:
            scope.deadline = min(scope.deadline, self.cut_at)

    @property
    def cut_short(self) -> bool:
        return self.cut_at is not None


def waits_of(scope: dict) -> ClientWaits | None:
    """The server's registry for a request's ASGI scope (None for an app without tierlm's state)."""
    state = getattr(getattr(scope.get("app"), "state", None), "tierlm", None)
    return getattr(state, "client_waits", None)


@contextlib.contextmanager
def client_wait(waits: ClientWaits | None, timeout: float | None) -> Iterator[anyio.CancelScope]:
    """`waits.wait(timeout)`, or a plain timeout where no server state is at hand (an app
    without one, in tests)."""
    if waits is None:
        with anyio.move_on_after(timeout or math.inf) as scope:
            yield scope
    else:
        with waits.wait(timeout) as scope:
            yield scope
