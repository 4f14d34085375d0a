"""`tierlm serve --replicas N`: N copies of the server on a Ray cluster, behind one router.

Why this shape: each replica is a whole `tierlm serve` (its engine, KV tiers, tenants, SLA
guard, safety layer), started as a process by a small Ray actor on whichever node Ray places it
(one GPU each where the cluster has them: Ray sets the actor's CUDA_VISIBLE_DEVICES, which the
process inherits). The router (`router.py`) runs in this process and sends each request to the
replica that holds its prompt's prefix. Nothing in the engine or the serving layer knows it is
replicated, so a replica behaves exactly as a single server does, and the router works as well
in front of replicas started by other means (`tierlm router --replica URL ...`).

The actor is a supervisor: it starts the server process (which dies with it: PR_SET_PDEATHSIG),
waits for its `/ready`, and starts it again on the same port if it exits; the router takes a
replica out of rotation while it is down and back when `/ready` answers.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Sequence

import uvicorn

logger = logging.getLogger("tierlm.router")

__all__ = ["per_replica_argv", "replica_argv", "run_replicated", "ServerProcess"]

#: Options of `tierlm serve` that belong to the front (the router), not to each replica.
_FRONT_OPTIONS = {"--replicas": True, "--ray-address": True, "--host": True, "--port": True,
                  "--routing-policy": True, "--affinity-chunks": True}
_RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)


def replica_argv(argv: Sequence[str]) -> list[str]:
    """The command line (`tierlm`'s arguments: `[--log-level X] serve ...`) without the router's
    own options (`--replicas 4`, `--port=8000`, ...): what each replica is started with, before
    its own host and port."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _FRONT_OPTIONS:
            skip = _FRONT_OPTIONS[name] and "=" not in arg
            continue
        out.append(arg)
    return out


def per_replica_argv(argv: Sequence[str], index: int) -> list[str]:
    """Replica `index`'s command line: a `--kv-disk-dir DIR` (or `--batches-dir DIR`) becomes
    `DIR/replica-INDEX`, as such a directory serves one server at a time (the second replica
    would be refused)."""
    out = list(argv)
    for i, arg in enumerate(out):
        for option in ("--kv-disk-dir", "--batches-dir"):
            if arg == option and i + 1 < len(out):
                out[i + 1] = os.path.join(out[i + 1], f"replica-{index}")
            elif arg.startswith(option + "="):
                out[i] = option + "=" + os.path.join(arg.split("=", 1)[1], f"replica-{index}")
    return out


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    """One `tierlm serve` process on this machine, kept running: started again (after 1, 2, 5,
    10, then 30 s) whenever it exits until `stop()`."""

    def __init__(self, serve_args: Sequence[str], host: str, port: int | None = None,
                 python: str = sys.executable, env: dict[str, str] | None = None, log: str | None = None) -> None:
        self.host = host
        self.env = env  # the process's environment (default: this one's)
        self.log = log  # a file for its output (default: this process's stdout and stderr)
        self.port = port or _free_port(host)
        self.cmd = [python, "-m", "tierlm.cli", *serve_args, "--host", host, "--port", str(self.port)]
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, ready_timeout: float = 1800.0) -> str:
        """Start the server and wait for its /ready; its URL. Raises RuntimeError naming the
        exit status if it exits first (its log, on this process's stderr, says why)."""
        self._spawn()
        deadline = time.monotonic() + ready_timeout
        while not self.ready():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the replica server `{' '.join(self.cmd)}` exited with status "
                                   f"{self.proc.returncode} before it was ready; {self._log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica server on {self.url} was not ready within {ready_timeout:.0f}s")
            time.sleep(0.25)
        self._watch = threading.Thread(target=self._keep_running, name="replica-watch", daemon=True)
        self._watch.start()
        return self.url

    def _log_tail(self, lines: int = 15) -> str:
        if self.log is None:
            return "its log above says why"
        try:
            with open(self.log, errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError as e:
            return f"its log {self.log} could not be read ({e})"
        return "the end of its log:\n" + "".join(tail)

    def _spawn(self) -> None:
        if self.log is None:
            self.proc = subprocess.Popen(self.cmd, preexec_fn=_die_with_parent, env=self.env)
        else:
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(self.cmd, preexec_fn=_die_with_parent, env=self.env, stdout=out,
                                             stderr=subprocess.STDOUT)
        self.starts += 1

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _keep_running(self) -> None:
        fails = 0
        while not self._stopping.is_set():
            assert self.proc is not None
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            delay = _RESTART_BACKOFF_S[min(fails, len(_RESTART_BACKOFF_S) - 1)]
            logger.error("replica server on %s exited with status %s; starting it again in %gs", self.url, code, delay)
            if self._stopping.wait(delay):
                return
            fails += 1
            self._spawn()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the server drains and saves its cache), then SIGKILL after `timeout`."""
        self._stopping.set()
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid


def _replica_actor_class():
    import ray

    class ReplicaActor:
        """A Ray actor holding one `ServerProcess` on its node."""

        def __init__(self, serve_args: list[str], driver_ip: str) -> None:
            node_ip = ray.util.get_node_ip_address()
            # On the router's own node, loopback: no port of it opens to the network.
            self.server = ServerProcess(serve_args, "127.0.0.1" if node_ip == driver_ip else node_ip)

        def start(self) -> str:
            return self.server.start()

        def pid(self) -> int | None:
            return self.server.pid()

        def starts(self) -> int:
            return self.server.starts

        def stop(self) -> int | None:
            return self.server.stop()

    return ray.remote(ReplicaActor)


def start_replicas(n: int, serve_args: list[str], ray_address: str | None, use_gpus: bool | None = None):
    """Start `n` replica actors on Ray (started here, locally, without `ray_address`) and wait
    until each server is ready; (actors, URLs)."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("--replicas needs Ray: pip install 'ray>=2.40' (or install tierlm with the [ray] extra), "
                         "or start the replicas yourself and put `tierlm router --replica URL ...` in front") from e
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    resources = ray.cluster_resources()
    gpus = resources.get("GPU", 0)
    if use_gpus is None:
        use_gpus = gpus >= n
    opts = {"num_gpus": 1, "num_cpus": 0} if use_gpus else {"num_cpus": min(1.0, resources.get("CPU", 1) / n)}
    logger.info("starting %d replicas on Ray (%s; %s each)", n, ray_address or "a local cluster",
                "1 GPU" if use_gpus else f"{opts['num_cpus']:g} CPU")
    actor_cls = _replica_actor_class().options(**opts)
    driver_ip = ray.util.get_node_ip_address()
    actors = [actor_cls.remote(per_replica_argv(serve_args, i), driver_ip) for i in range(n)]
    pending = {a.start.remote(): i for i, a in enumerate(actors)}
    urls: list[str | None] = [None] * n
    started = time.monotonic()
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=30)
            if not done:
                logger.info("waiting for %d of %d replicas to load their models (%.0fs)", len(pending), n,
                            time.monotonic() - started)
                continue
            i = pending.pop(done[0])
            try:
                urls[i] = ray.get(done[0])
            except Exception as e:  # the actor's error (its server exited: why is in the log above) or its death
                cause = getattr(e, "cause", None) or e
                raise ValueError(f"replica {i} did not start: {cause}") from None
            logger.info("replica %d ready on %s (%d of %d)", i, urls[i], n - len(pending), n)
    except BaseException:
        stop_replicas(actors)
        raise
    return actors, [u for u in urls if u is not None]


def stop_replicas(actors) -> None:
    import ray

    try:
        ray.get([a.stop.remote() for a in actors], timeout=60)
    except Exception as e:  # an actor already gone: its server died with it
        logger.warning("stopping replicas: %s", e)
    for a in actors:
        ray.kill(a)


def run_replicated(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """`tierlm serve ... --replicas N`: the replicas on Ray, the router on --host/--port."""
    import ray

    from tierlm.dist.router import Router, RouterConfig
    from tierlm.serving.server import install_probe_log_filter, listen_socket, raise_fd_limit

    from tierlm.serving.cli import _is_loopback

    if not (args.api_keys or args.no_auth or _is_loopback(args.host)):
        raise ValueError(f"refusing to serve {args.host} without API keys; pass --api-keys FILE (the replicas "
                         "check them) or --no-auth if this network is trusted")
    if getattr(args, "kv_disk_dir", None) and not getattr(args, "kv_disk_capacity", None):
        logger.warning("%d replicas each get a disk tier (%s/replica-I) whose default capacity is half of the free "
                       "space at its start: replicas on one machine may together claim more than its disk has "
                       "(each then shrinks to what it holds); give --kv-disk-capacity (each replica's own)",
                       args.replicas, args.kv_disk_dir)
    from tierlm.dist.cli import tenants_of

    # A bad keys or tenants file fails before Ray starts. With --limits-store the replicas share
    # the tenants' limits through it (all three of them), and the router only routes.
    shared = bool(getattr(args, "limits_store", None))
    if shared:
        from tierlm.config import check_redis_url

        if not getattr(args, "tenants", None):
            raise ValueError("--limits-store needs --tenants: the limits it shares are the tenants file's")
        from tierlm.serving.limit_store import check_apart_from_kv_cache

        check_redis_url(args.limits_store, option="--limits-store")
        check_apart_from_kv_cache(args.limits_store, getattr(args, "kv_remote", None))
    auth, tenancy = tenants_of(args, store=False)
    raise_fd_limit()
    install_probe_log_filter()
    sock = listen_socket(args.host, args.port)  # a busy port fails before any replica starts
    port = sock.getsockname()[1]
    try:
        actors, urls = start_replicas(args.replicas, replica_argv(argv), getattr(args, "ray_address", None))
    except BaseException:
        sock.close()
        ray.shutdown()
        raise
    try:
        router = Router(RouterConfig(replicas=urls, policy=args.routing_policy, affinity_chunks=args.affinity_chunks,
                                     max_body_bytes=args.max_body_bytes, auth=auth, tenancy=tenancy,
                                     admit_limits=not shared))
        logger.info("routing http://%s:%d to %d replicas (%s)", args.host, port, len(urls), args.routing_policy)
        config = uvicorn.Config(router, log_level=str(getattr(args, "log_level", "info")).lower(), lifespan="on",
                                timeout_graceful_shutdown=args.shutdown_timeout)
        server = _FrontServer(config)
        server.run(sockets=[sock])
    finally:
        logger.info("stopping %d replicas", len(actors))
        stop_replicas(actors)
        ray.shutdown()
    # stopped by a signal: the shell's status for it (143 for SIGTERM, 130 for Ctrl-C)
    return 128 + int(server.stopped_by) if server.stopped_by else 0


class _FrontServer(uvicorn.Server):
    """uvicorn's server, except that the signal that stopped it is only noted (`stopped_by`), not
    raised again once it has shut down, as uvicorn does: the replicas are stopped first (Ray's
    own SIGTERM handler would otherwise exit the process from inside the shutdown)."""

    stopped_by: int | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
        if self._captured_signals:
            self.stopped_by = self._captured_signals[-1]
