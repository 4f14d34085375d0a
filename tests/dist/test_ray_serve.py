"""`tierlm serve --replicas 2` for real: a local Ray cluster, two replica servers (demo model)
started by Ray actors, the router in front; a replica killed and brought back."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.serving.harness import wait_until

pytestmark = pytest.mark.slow


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _serve_pids(port: int) -> list[int]:
    """Processes running `tierlm.cli serve ... --port PORT` (a replica server)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tierlm.cli" in argv and b"serve" in argv and str(port).encode() in argv:
            pids.append(int(d.name))
    return pids


class _Log:
    """A process's stderr, read on a thread (Ray and the replicas write a lot to it)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.lines.append(line)

    def find(self, pattern: str) -> re.Match | None:
        for line in list(self.lines):
            m = re.search(pattern, line)
            if m:
                return m
        return None


def test_serve_with_two_replicas_on_ray(tmp_path, redis_server):
    """With tenants whose limits the replicas share through one Redis (`--limits-store`): the
    replicas count there, and the router, which then admits nothing itself, does not."""
    import anthropic
    import redis

    from tierlm.serving.auth import keys_file_line

    (tmp_path / "keys.txt").write_text(keys_file_line("k", "sk-ray") + "\n")
    (tmp_path / "tenants.toml").write_text('[tenants.t]\nkeys = ["k"]\nrequests_per_minute = 1000\n'
                                           'max_concurrent = 50\n')
    cmd = [sys.executable, "-m", "tierlm.cli", "serve", "--replicas", "2", "--port", "0", "--device", "cpu",
           "--max-model-len", "1024", "--kv-cache-memory", "32MiB", "--max-num-seqs", "8",
           "--api-keys", "keys.txt", "--tenants", "tenants.toml", "--limits-store", redis_server.url]
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                            cwd=tmp_path)
    log = _Log(proc)
    try:
        assert wait_until(lambda: log.find(r"routing http://127\.0\.0\.1:(\d+) to 2 replicas") or proc.poll() is not None,
                          timeout=240), "".join(log.lines[-40:])
        m = log.find(r"routing http://127\.0\.0\.1:(\d+) to 2 replicas")
        assert m is not None, "".join(log.lines[-40:])
        url = f"http://127.0.0.1:{m.group(1)}"
        assert wait_until(lambda: _ready(url), timeout=30)
        replicas = httpx.get(url + "/ready").json()["replicas"]
        ports = [int(r["url"].rsplit(":", 1)[1]) for r in replicas]
        assert len(ports) == 2 and all(len(_serve_pids(p)) == 1 for p in ports)

        client = anthropic.Anthropic(base_url=url, api_key="sk-ray", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        system = "Answer in one word. " * 30

        def ask(tag: str, turns: int) -> list[tuple[str, int]]:
            messages, out = [], []
            for t in range(turns):
                messages.append({"role": "user", "content": f"{tag} {t}"})
                raw = client.messages.with_raw_response.create(model=model, max_tokens=3, system=tag + system,
                                                               messages=messages)
                msg = raw.parse()
                out.append((raw.headers["x-tierlm-replica"], msg.usage.cache_read_input_tokens))
                assert int(raw.headers["anthropic-ratelimit-requests-remaining"]) < 1000  # a replica's limit
                messages.append({"role": "assistant", "content": msg.content[0].text if msg.content else "."})
            return out

        a, b = ask("alpha", 2), ask("beta", 2)
        store = redis.Redis.from_url(redis_server.url)
        # the replicas count in the store, and the router (admitting nothing itself) does not
        assert store.keys("tierlm:limits:server:*") and not store.keys("tierlm:limits:router:*")
        # unrelated prompts spread out (the idler replica), then each conversation stays on its own
        assert a[0][0] == a[1][0] and b[0][0] == b[1][0] and a[0][0] != b[0][0]
        assert a[1][1] > 0 and b[1][1] > 0  # follow-ups read the conversation from their replica's cache

        # kill replica 0's server: requests go to replica 1 meanwhile, and its actor starts it again
        (victim,) = _serve_pids(ports[0])
        os.kill(victim, signal.SIGKILL)
        for i in range(3):
            assert ask(f"during {i}", 1)[0][0] == "1"
        assert wait_until(lambda: [p for p in _serve_pids(ports[0]) if p != victim], timeout=30)
        assert wait_until(lambda: all(r["up"] for r in httpx.get(url + "/ready").json()["replicas"]), timeout=120)
        assert log.find("exited with status -9; starting it again")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    assert code == 128 + signal.SIGTERM, "".join(log.lines[-40:])  # the shell's status for a SIGTERM
    assert wait_until(lambda: not any(_serve_pids(p) for p in ports), timeout=30)  # no replica outlives it


def test_replicas_that_cannot_start_end_the_command_with_the_reason(tmp_path):
    cmd = [sys.executable, "-m", "tierlm.cli", "serve", "--replicas", "2", "--port", "0", "--model", "not-a-spec"]
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.search(r"error: replica \d did not start: the replica server .* exited with status 2", done.stderr)
    assert "--model expects NAME=DIR, got 'not-a-spec'" in done.stderr  # the replica's own line, forwarded
    assert "Traceback" not in done.stderr.split("error: replica")[-1]


def test_replicas_sharing_a_kv_disk_dir_with_the_default_capacity_are_warned_about(tmp_path, caplog):
    """Each replica's disk tier (DIR/replica-I) defaults to half the free space at its start, so
    replicas on one machine claimed N halves of one disk, unwarned. (A busy port then ends the
    command before Ray starts.)"""
    import logging
    import socket

    from tierlm.cli import main

    with socket.socket() as busy, caplog.at_level(logging.WARNING, logger="tierlm.router"):
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        for extra, warned in (([], True), (["--kv-disk-capacity", "1GiB"], False)):
            caplog.clear()
            assert main(["serve", "--replicas", "3", "--port", str(busy.getsockname()[1]), "--kv-disk-dir",
                         str(tmp_path / "kv"), *extra]) == 2
            said = [r.getMessage() for r in caplog.records if "--kv-disk-capacity" in r.getMessage()]
            assert len(said) == warned and (not said or "3 replicas" in said[0])
