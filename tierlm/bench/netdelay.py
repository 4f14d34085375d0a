"""A TCP proxy that adds one-way latency, to measure a remote tier (Redis) as if it were across
a network while it runs on this machine.

Each chunk read from one side is written to the other `delay_s` after it arrived, in order, so a
round trip costs 2 × `delay_s` more and bandwidth is not limited: reading goes on while earlier
chunks wait. Per direction one thread reads and one delivers (precise sleeps, no event-loop
timer granularity); `delay_s` may be changed while it runs. `trickle = (n, every_s)` makes the
server's replies arrive `n` bytes at a time, `every_s` apart (a congested link: each read from
the socket returns within any timeout, the reply takes as long as it takes); None turns it off.
"""
from __future__ import annotations

import queue
import socket
import threading
import time


class DelayProxy:
    """`with DelayProxy("127.0.0.1", 6379, delay_s=0.00025) as port:` → connect to 127.0.0.1:port."""

    def __init__(self, host: str, port: int, delay_s: float) -> None:
        self.upstream = (host, port)
        self.delay_s = delay_s
        self.trickle: tuple[int, float] | None = None
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> int:
        threading.Thread(target=self._accept, name="tierlm-delay-proxy", daemon=True).start()
        return self.port

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._closed = True
            for s in [self._server, *self._sockets]:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
                upstream = socket.create_connection(self.upstream)
            except OSError:
                with self._lock:
                    if self._closed:
                        return
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst, replies in ((client, upstream, False), (upstream, client, True)):
                q: queue.Queue = queue.Queue()
                threading.Thread(target=self._read, args=(src, q), daemon=True).start()
                threading.Thread(target=self._deliver, args=(dst, q, replies), daemon=True).start()
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _read(self, src: socket.socket, q: queue.Queue) -> None:
        try:
            while data := src.recv(1 << 16):
                q.put((time.monotonic() + self.delay_s, data))
        except OSError:
            pass
        q.put(None)

    def _deliver(self, dst: socket.socket, q: queue.Queue, replies: bool) -> None:
        try:
            while (item := q.get()) is not None:
                due, data = item
                if (wait := due - time.monotonic()) > 0:
                    time.sleep(wait)
                while replies and self.trickle is not None and data:
                    n, every_s = self.trickle
                    dst.sendall(data[:n])
                    data = data[n:]
                    time.sleep(every_s)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
