"""Clients that hold connections without using them: a head or body that never finishes, a
stream nobody reads, more connections than the process may open files. Raw sockets against
the real server, with the deadlines (`ServerState`) set short for the test."""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.serving.harness import API_KEY, ServerThread, slow_steps, wait_until
from tests.serving.scripted_model import LOOP_MODEL, TEXT_MODEL
from tierlm.serving.app import build_app
from tierlm.serving.auth import NoAuth
from tierlm.serving.server import ACCEPT_ERROR, SEND_AFTER_LOSS, AcceptErrorFilter, install_accept_error_filter


def raw_request(path: str, body: bytes, content_length: int | None = None, **headers: str) -> bytes:
    fields = {"Host": "x", "Content-Type": "application/json", "x-api-key": API_KEY,
              "Content-Length": str(len(body) if content_length is None else content_length), **headers}
    return f"POST {path} HTTP/1.1\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in fields.items()).encode() + b"\r\n" + body


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What the server sent, and whether it closed the connection within `timeout` seconds."""
    sock.settimeout(0.2)
    data, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


@pytest.fixture
def short_deadlines(scripted_server, monkeypatch):
    state = scripted_server.app.state.tierlm
    monkeypatch.setattr(state, "request_read_timeout", 0.5)
    return scripted_server


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_a_body_shorter_than_its_content_length_gets_408_then_the_connection_closes(short_deadlines, path):
    with socket.create_connection(("127.0.0.1", short_deadlines.port)) as sock:
        sock.sendall(raw_request(path, b'{"model":', content_length=1000))
        started = time.monotonic()
        data, closed = read_until_closed(sock, 5)
    assert closed and time.monotonic() - started < 3, data
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert b"connection: close" in head.lower()
    error = json.loads(body)
    if path == "/v1/messages":
        assert error["type"] == "error" and error["error"]["type"] == "timeout_error"
        message = error["error"]["message"]
    else:
        assert error["error"]["code"] == "request_timeout" and error["error"]["type"] == "invalid_request_error"
        message = error["error"]["message"]
    assert "--request-read-timeout" in message and "9 bytes received of 1000 declared" in message


def test_a_slow_but_steady_body_is_served(short_deadlines):
    """The deadline is on the gap between parts of the body, not the whole upload: one that took
    longer than the deadline in all, never pausing that long, got a 408 (a large image at 9 Mbit/s
    past 30 s)."""
    body = json.dumps({"model": TEXT_MODEL, "messages": [{"role": "user", "content": "x" * 60}]}).encode()
    with socket.create_connection(("127.0.0.1", short_deadlines.port)) as sock:
        sock.sendall(raw_request("/v1/messages/count_tokens", b"", content_length=len(body)))
        for i in range(0, len(body), len(body) // 5 + 1):  # 6 parts, 0.3 s apart: 1.5 s > 0.5 s
            time.sleep(0.3)
            sock.sendall(body[i:i + len(body) // 5 + 1])
        data, _ = read_until_closed(sock, 2)
    assert data.startswith(b"HTTP/1.1 200 ") and b'"input_tokens"' in data, data


def test_a_connection_answered_before_its_body_is_closed_when_it_then_idles(short_deadlines):
    """A 401 goes out before the body is read; the body then came, and the connection, waiting
    for a next head with no response ending, had no deadline at all (nor uvicorn's keep-alive)."""
    with socket.create_connection(("127.0.0.1", short_deadlines.port)) as sock:
        sock.sendall(raw_request("/v1/messages", b"", content_length=10, **{"x-api-key": "wrong"}))
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 401 ")
        sock.sendall(b"0123456789")
        _, closed = read_until_closed(sock, 3)
    assert closed


def test_a_connection_answered_before_a_body_that_never_comes_is_closed_at_the_read_timeout(short_deadlines):
    """A 401 goes out before the body is read; with the body still owed, only uvicorn's 5 s
    keep-alive closed the connection, whatever --request-read-timeout said (0.5 s here). A body
    that keeps coming, slowly, is not cut off."""
    with socket.create_connection(("127.0.0.1", short_deadlines.port)) as sock:
        sock.sendall(raw_request("/v1/messages", b"", content_length=100, **{"x-api-key": "wrong"}))
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 401 ")
        started = time.monotonic()
        _, closed = read_until_closed(sock, 4)
    assert closed and time.monotonic() - started < 2.5
    with socket.create_connection(("127.0.0.1", short_deadlines.port)) as sock:
        sock.sendall(raw_request("/v1/messages", b"", content_length=8, **{"x-api-key": "wrong"}))
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 401 ")
        for byte in b"01234567":  # 8 gaps of 0.3 s: 2.4 s in all, each under the deadline
            time.sleep(0.3)
            sock.sendall(bytes([byte]))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, deadline = b"", time.monotonic() + 5
        while b"HTTP/1.1 200 " not in data and time.monotonic() < deadline:
            data += sock.recv(65536)  # (the rest of the 401 first)
        assert b"HTTP/1.1 200 " in data, data


def test_connections_that_never_finish_a_request_head_are_closed(short_deadlines):
    port = short_deadlines.port
    silent = socket.create_connection(("127.0.0.1", port))
    half_head = socket.create_connection(("127.0.0.1", port))
    half_head.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n")
    # after a whole request, half of the next head: uvicorn's keep-alive timer stops at its first byte
    second_half = socket.create_connection(("127.0.0.1", port))
    second_half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    second_half.settimeout(5)
    assert second_half.recv(65536).startswith(b"HTTP/1.1 200 ")
    second_half.sendall(b"GET /health HTTP/1.1\r\nHo")
    for sock in (silent, half_head, second_half):
        with sock:
            _, closed = read_until_closed(sock, 3)
            assert closed


def test_a_streaming_client_that_stops_reading_is_aborted_and_disconnected(scripted_models, monkeypatch, caplog):
    engine = scripted_models[LOOP_MODEL].engine("stall-loop")
    # small kernel send buffers (they grow to MBs): the server's writes stall after ~100 kB
    server = ServerThread(build_app({"stall-loop": engine}, NoAuth(), stream_send_timeout=1.0), send_buffer=8192).start()
    slow_steps(engine, monkeypatch, 0.02)  # the whole answer would take 8 s
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    # ~1.8 kB per token with 20 top logprobs: the buffers are full after ~100 tokens
    body = json.dumps({"model": "stall-loop", "max_tokens": 400, "stream": True, "logprobs": True, "top_logprobs": 20,
                       "messages": [{"role": "user", "content": "talk"}]}).encode()
    try:
        with sock, caplog.at_level(logging.WARNING, logger="tierlm.serving"):
            generated = engine.stats().generation_tokens
            sock.sendall(raw_request("/v1/chat/completions", body))
            assert wait_until(lambda: engine.stats().kv_blocks_used > 0, timeout=5)
            # never read: once the buffers are full a write waits, 1 s later the request is aborted
            assert wait_until(lambda: engine.stats().kv_blocks_used == 0, timeout=6), engine.stats()
            assert engine.stats().generation_tokens - generated < 300  # aborted, not run to the end
            assert any("--stream-send-timeout" in r.getMessage() and "req_" in r.getMessage() for r in caplog.records)
            _, closed = read_until_closed(sock, 3)
            assert closed
    finally:
        server.stop()


def test_a_shutdown_answers_a_body_still_arriving_and_drops_a_stream_nobody_reads(scripted_models, monkeypatch,
                                                                                   caplog):
    """At --shutdown-timeout the drain aborted what ran, but a request still uploading its body
    (not running yet) and a stream whose client stopped reading (its error frame cannot go out)
    waited for uvicorn's later deadline: a plain-text 500 and a logged traceback. Now the first
    gets the route's "shutting down" error in its own shape and the second its connection
    closed, within a second of the timeout."""
    engine = scripted_models[LOOP_MODEL].engine("drain-loop")
    server = ServerThread(build_app({"drain-loop": engine}, NoAuth()), graceful_timeout=1.0, send_buffer=8192).start()
    slow_steps(engine, monkeypatch, 0.02)
    uploading = socket.create_connection(("127.0.0.1", server.port))
    uploading.sendall(raw_request("/v1/chat/completions", b'{"model": "drain-', content_length=1000))
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", server.port))
    body = json.dumps({"model": "drain-loop", "max_tokens": 400, "stream": True, "logprobs": True, "top_logprobs": 20,
                       "messages": [{"role": "user", "content": "talk"}]}).encode()
    stalled.sendall(raw_request("/v1/chat/completions", body))
    assert wait_until(lambda: engine.stats().kv_blocks_used > 0, timeout=5)
    time.sleep(1.0)  # the stream's writes now wait for a client that does not read
    with uploading, stalled, caplog.at_level(logging.WARNING):
        began = time.monotonic()
        server.stop()
        took = time.monotonic() - began
        answer, closed = read_until_closed(uploading, 3)
        assert closed and answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "overloaded" and "shutting down" in error["message"]
        _, closed = read_until_closed(stalled, 3)
        assert closed
    assert took < 1.0 + 1.0 + 0.8, took  # the timeout, then at most a second to say so (uvicorn's own: 3 s more)
    assert engine.stats().kv_blocks_used == 0
    assert not any("Exception in ASGI application" in r.getMessage() or r.exc_info for r in caplog.records)
    assert any("not reading its stream" in r.getMessage() for r in caplog.records)


def test_accept_errors_at_the_open_file_limit_are_logged_once_per_interval():
    accept_filter = AcceptErrorFilter(interval=0.3)

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

    assert accept_filter.filter(record("something else"))
    first = record(ACCEPT_ERROR + "\nsocket: <...>")
    assert accept_filter.filter(first)
    assert not any(accept_filter.filter(record(ACCEPT_ERROR)) for _ in range(500))
    time.sleep(0.35)
    again = record(ACCEPT_ERROR)
    assert accept_filter.filter(again) and "500 more like this" in again.getMessage()
    assert accept_filter.filter(record("something else"))


def test_writes_to_a_vanished_client_are_not_warned_about():
    """asyncio warned "socket.send() raised exception." (naming nothing) for each frame uvicorn
    wrote to a stream whose client had gone; 22 in a soak run. The request's 499 says it all."""
    accept_filter = install_accept_error_filter()
    assert accept_filter in logging.getLogger("asyncio").filters
    record = logging.LogRecord("asyncio", logging.WARNING, __file__, 1, SEND_AFTER_LOSS, None, None)
    assert not accept_filter.filter(record)
    other = logging.LogRecord("asyncio", logging.WARNING, __file__, 1, "socket.send() took 5 s", None, None)
    assert accept_filter.filter(other)


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")
def test_a_server_at_its_open_file_limit_logs_a_line_not_a_flood():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["prlimit", "--nofile=64:64", sys.executable, "-m", "tierlm.cli", "serve", "--device", "cpu",
            "--max-model-len", "256", "--kv-cache-memory", "4MiB", "--port", str(port), "--no-request-log"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    socks = []
    try:
        deadline = time.monotonic() + 120
        while True:  # the port listens once the model has loaded
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                break
            except OSError:
                time.sleep(0.2)
        for _ in range(120):  # past the limit: the rest wait in the backlog
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        time.sleep(2)
    finally:
        for sock in socks:
            sock.close()
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert out.count(ACCEPT_ERROR) == 1, out[-3000:]


def test_successful_probes_are_left_out_of_the_access_log():
    """A router probing /ready every 2 s (and a scraper reading /metrics) wrote most of the log."""
    import logging

    from tierlm.serving.server import ProbeLogFilter

    def record(method: str, path: str, status: int) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5000", method, path, "1.1", status), None)

    f = ProbeLogFilter()
    assert not f.filter(record("GET", "/ready", 200)) and not f.filter(record("HEAD", "/health", 200))
    assert not f.filter(record("GET", "/metrics", 200))
    assert f.filter(record("GET", "/ready", 503))  # a failing probe is news
    assert f.filter(record("POST", "/v1/messages", 200)) and f.filter(record("GET", "/v1/models", 200))
    assert f.filter(logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "plain", None, None))
