"""`tierlm serve` from the command line: model specs, auth choices, SIGTERM."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tierlm.serving.auth import keys_file_line
from tierlm.serving.cli import parse_model_specs

SMALL_ENGINE = ["--device", "cpu", "--max-model-len", "256", "--kv-cache-memory", str(4 << 20)]


def test_model_specs():
    assert parse_model_specs(None, []) == {"": None}
    assert parse_model_specs("/m/a", []) == {"": "/m/a"}
    assert parse_model_specs(None, ["x=/m/x", "y=/m/y"]) == {"x": "/m/x", "y": "/m/y"}
    assert list(parse_model_specs("/m/a", ["x=/m/x"])) == ["", "x"]
    for bad in (["x"], ["=/m"], ["x="], ["x=/a", "x=/b"]):
        with pytest.raises(ValueError):
            parse_model_specs(None, bad)


def serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierlm.cli", "serve", *SMALL_ENGINE, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_refuses_an_open_host_without_keys():
    proc = serve("--host", "0.0.0.0", "--port", str(free_port()))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "--api-keys" in out


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_bad_kv_tier_flags_get_a_one_line_error_not_a_traceback(command, tmp_path):
    argv = [sys.executable, "-m", "tierlm.cli", command, "--kv-disk-dir", str(tmp_path / "kv"),
            "--kv-disk-capacity", "lots"] + (["--port", str(free_port())] if command == "serve" else ["hi"])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error: kv_disk_capacity: cannot read KV tier capacity 'lots'" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "kv").exists()


@pytest.mark.slow
def test_serve_answers_then_stops_on_sigterm(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(keys_file_line("ci", "sk-cli") + "\n")
    port = free_port()
    proc = serve("--port", str(port), "--api-keys", str(keys), "--shutdown-timeout", "2")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.2)
        models = httpx.get(url + "/v1/models", headers={"x-api-key": "sk-cli"}).json()["data"]
        r = httpx.post(url + "/v1/messages", headers={"x-api-key": "sk-cli"}, timeout=60,
                       json={"model": models[0]["id"], "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        assert httpx.post(url + "/v1/messages", json={}).status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    # uvicorn re-raises the signal once it has shut down cleanly, so -SIGTERM is a clean exit too
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out
    assert "RANDOM" in out  # the demo model's notice
