"""`tierlm serve` from the command line: model specs, auth choices, SIGTERM."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tierlm.serving.auth import keys_file_line
from tierlm.serving.cli import freeze_startup_objects, parse_model_specs

SMALL_ENGINE = ["--device", "cpu", "--max-model-len", "256", "--kv-cache-memory", "4MiB"]


def test_model_specs():
    assert parse_model_specs(None, []) == {"": None}
    assert parse_model_specs("/m/a", []) == {"": "/m/a"}
    assert parse_model_specs(None, ["x=/m/x", "y=/m/y"]) == {"x": "/m/x", "y": "/m/y"}
    assert list(parse_model_specs("/m/a", ["x=/m/x"])) == ["", "x"]
    for bad in (["x"], ["=/m"], ["x="], ["x=/a", "x=/b"]):
        with pytest.raises(ValueError):
            parse_model_specs(None, bad)


def serve(*args: str, ignore_sigint: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierlm.cli", "serve", *SMALL_ENGINE, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, deadline: float) -> None:
    """Until the server on `port` answers /ready (the process must stay alive meanwhile)."""
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become ready"
        time.sleep(0.2)


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
        wait_ready(proc, port, time.monotonic() + 120)
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


def test_a_busy_port_fails_before_the_model_loads_and_port_0_picks_a_free_one():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        proc = serve("--port", str(taken))
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert f"error: cannot listen on 127.0.0.1:{taken} (Address already in use)" in out
    assert "engine ready" not in out and "Traceback" not in out  # refused before loading anything

    proc = serve("--port", "0")
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # the log names the port it got
            m = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", line)
            if m:
                break
            assert time.monotonic() < deadline
        port = int(m.group(1))
        assert port != 0
        wait_ready(proc, port, deadline)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


@pytest.mark.parametrize("argv, says", [
    (["bench", "cache", "--trace", "/no/such/trace.jsonl", "--capacities", "10"], "No such file or directory"),
    (["bench", "cache", "--trace", "{bad_trace}", "--capacities", "10"], "not JSON"),
    (["bench", "cache", "--trace", "{bad_trace}", "--capacities", "10", "--policies", "mru"], "unknown policies"),
    (["bench", "throughput", "--model", "/no/such/model"], "not a Hugging Face checkpoint directory"),
    (["generate", "--model", "/no/such/model", "hi"], "model directory /no/such/model does not exist"),
    (["serve", "/no/such/model", "--port", "0"], "model directory /no/such/model does not exist"),
    # named models: a fallback naming none of them fails before any model loads
    (["serve", "--model", "big=/no/such/model", "--fallback-model", "big=small", "--port", "0"],
     "--fallback-model big=small: no model is served as 'small'; served: big"),
])
def test_bad_command_line_input_gets_one_error_line(argv, says, tmp_path):
    bad_trace = tmp_path / "trace.jsonl"
    bad_trace.write_text("not json\n")
    argv = [a.replace("{bad_trace}", str(bad_trace)) for a in argv]
    if argv[0] == "bench":
        argv += ["--json", str(tmp_path / "out.json")]
    proc = subprocess.run([sys.executable, "-m", "tierlm.cli", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and proc.stderr.count("error:") == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("argv, says", [
    (["serve", "--kv-disk-dir", ""], "kv_disk_dir is empty"),
    (["serve", "--kv-remote", " "], "kv_remote is empty"),
    (["serve", "--api-keys", ""], "--api-keys is empty"),
    (["serve", "--safety-policies", ""], "--safety-policies is empty"),
    (["serve", ""], "model is empty"),
    (["generate", "--model", "", "hi"], "model is empty"),
])
def test_an_empty_value_is_refused_not_read_as_the_feature_off(argv, says):
    """What `--kv-disk-dir "$CACHE_DIR"` gives with the variable unset: the server started with
    no disk tier (no Redis tier, no API keys) and said nothing of it."""
    if argv[0] == "serve":
        argv = argv + ["--port", str(free_port())]
    proc = subprocess.run([sys.executable, "-m", "tierlm.cli", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and proc.stderr.count("error:") == 1
    assert "Traceback" not in proc.stderr + proc.stdout and "engine ready" not in proc.stderr + proc.stdout


@pytest.mark.slow
def test_one_checkpoint_under_two_names_with_one_kv_disk_dir(llama_dir, tmp_path):
    """Each served name gets its own disk-tier directory: the server used to refuse its own
    second model ("in use by tierlm pid <itself>"). Several models sharing the directory
    without a capacity are warned about (each defaults to half the free space)."""
    kv, port = tmp_path / "kv", free_port()
    env_cache = {"TIERLM_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "tierlm.cli", "serve", *SMALL_ENGINE, "--port", str(port),
                             "--model", f"x={llama_dir}", "--model", f"y={llama_dir}", "--kv-disk-dir", str(kv)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env_cache})
    try:
        wait_ready(proc, port, time.monotonic() + 120)
        listed = subprocess.run([sys.executable, "-m", "tierlm.cli", "kv", "ls", str(kv), "--json"],
                                capture_output=True, text=True, timeout=120, env={**os.environ, **env_cache})
        dirs = {d["name"].rsplit("-", 1)[0]: d for d in json.loads(listed.stdout)["dirs"]}
        assert set(dirs) == {"x", "y"}
        assert all(d["in_use_by"] == f"tierlm pid {proc.pid}" and d["weights"] == "current" for d in dirs.values())
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "is used now by 1 other engine (x-" in out and "Traceback" not in out  # y's tier, at its start
    assert "also holds" not in out  # its own other model is not an "other model directory"


def test_start_up_objects_are_frozen_out_of_the_garbage_collectors_sight():
    """`tierlm serve` freezes what start-up allocated before it serves: a full collection then
    skips it, instead of walking hundreds of thousands of torch objects while a step waits."""
    import gc
    import torch  # noqa: F401  (what a server has loaded)
    try:
        frozen = freeze_startup_objects()
        assert frozen > 10_000 and gc.get_freeze_count() > 10_000  # torch alone is more than that
        assert len(gc.get_objects()) < frozen // 10  # what a collection still walks (other threads allocate too)
    finally:
        gc.unfreeze()  # the rest of the suite keeps collecting as before


def test_ctrl_c_while_torch_still_imports_is_status_130_without_a_traceback():
    """`import tierlm` loaded torch (a second or so) before the command's Ctrl-C handling began, so
    an early Ctrl-C printed the import's traceback; the package now loads its names on first use."""
    code = ("import os, signal, sys, threading\n"
            "from tierlm import cli\n"
            "assert 'torch' not in sys.modules, 'import tierlm.cli loaded torch'\n"
            "threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
            "sys.exit(cli.main(['serve', '--device', 'cpu']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_sigterm_quits_at_once_as_a_second_sigint_does(first, second):
    """A second `kill PID` (SIGTERM) means "now" as a second Ctrl-C (SIGINT) does; uvicorn forced
    the exit only on a second SIGINT, so a second SIGTERM still waited out --shutdown-timeout."""
    import uvicorn

    from tierlm.serving.server import GracefulServer

    server = GracefulServer(uvicorn.Config(app=lambda scope, receive, send: None), state=None,
                            shutdown_timeout=30)
    server.handle_exit(first, None)
    assert server.should_exit and not server.force_exit  # the first one drains
    server.handle_exit(second, None)
    assert server.force_exit


@pytest.mark.parametrize("level", ["LOUD", "", "verbose"])
def test_an_unknown_log_level_is_refused(level, capsys):
    """It used to fall back to INFO silently."""
    from tierlm.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--log-level", level, "kv", "ls", "/nonexistent"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --log-level: invalid choice" in err and err.count("error:") == 1


@pytest.mark.parametrize("level", ["debug", "INFO", "Warning", "error", "critical"])
def test_log_levels_are_taken_in_any_case(level):
    from tierlm.cli import build_parser

    args = build_parser().parse_args(["--log-level", level, "kv", "ls", "/nonexistent"])
    assert args.log_level == level.upper()


@pytest.mark.parametrize("flag, value, says", [
    ("--max-tokens", "0", "must be at least 1, got 0"),
    ("--temperature", "-1", "must be in [0, 100], got -1"),
    ("--top-p", "0", "must be in (0, 1], got 0"),
    ("--top-p", "1.5", "must be in (0, 1], got 1.5"),
    ("--top-p", "nan", "must be in (0, 1], got nan"),
])
def test_generate_refuses_bad_sampling_flags_before_the_model_loads(flag, value, says, capsys):
    """They were checked only when the first request ran, after the model had loaded (17-30 s),
    and named `sampling parameter 'max_tokens'` rather than the flag."""
    from tierlm.cli import main

    with pytest.raises(SystemExit) as e:  # the parser's refusal: nothing has loaded
        main(["generate", "hi", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: {says}" in err and err.count("error:") == 1


def test_sigint_inherited_as_ignored_still_exits_130():
    """A script's background job (`tierlm serve &`) starts with SIGINT ignored. `kill -INT` still
    shut the server down (uvicorn installs its own handler), but uvicorn's raising it again to set
    the exit status was swallowed: the status was 0, not 130."""
    port = free_port()
    proc = serve("--port", str(port), "--shutdown-timeout", "1", ignore_sigint=True)
    try:
        wait_ready(proc, port, time.monotonic() + 120)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "Application shutdown complete" in out and "Traceback" not in out


@pytest.mark.slow
def test_ctrl_c_stops_serve_quietly_with_130_and_keeps_the_kv_cache(tmp_path):
    """SIGINT (Ctrl-C) shut down as gracefully as SIGTERM, but uvicorn re-raises it afterwards and
    the process ended in a KeyboardInterrupt traceback; the KV cache must still reach the disk."""
    port, kv = free_port(), tmp_path / "kv"
    proc = serve("--port", str(port), "--kv-disk-dir", str(kv), "--shutdown-timeout", "1")
    try:
        wait_ready(proc, port, time.monotonic() + 120)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tierlm-demo", "prompt": "hello " * 40, "max_tokens": 4})
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert "Application shutdown complete" in out
    found = re.search(r"moved ([1-9]\d*) cached blocks .* (\d+) newly written to the disk tier", out)
    assert found and int(found.group(2)) == int(found.group(1)), out  # a fresh directory: all of them written
