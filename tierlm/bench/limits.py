"""`tierlm bench limits`: a tenant's limits across several servers, per server vs shared.

N real `tierlm serve` processes (the demo model unless `--model`) serve one tenant whose
requests a client spreads over them in turn. Run twice on fresh servers: each server counting
its own (the peer: what any single-process limiter gives, behind a load balancer) and all of
them sharing one Redis (`--limits-store`). Two phases per run:

- enforcement: the tenant has `--requests-per-minute` R and `--workers` clients ask as fast
  as they can for `--seconds` T. A bucket that starts full allows R + R × T / 60 requests in T;
  reported: how many were admitted, against that bound (per server: about N times it);
- overhead: a second tenant whose limits are never reached (but are counted: every request
  takes and releases its share) sends `--overhead-requests`; reported: the latency of its
  requests, the cost of the store's round trips on a real request.

Then, in this process, the cost of one admission and release alone: the in-process limiter
against the store.

Redis: the one `--limits-store` names, or a `redis-server` from PATH started on a free port.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tierlm.cli import at_least

MODES = ("per_server", "shared")  # the peer first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Redis:
    """The benchmark's Redis: the URL given, or a redis-server started for the run."""

    def __init__(self, url: str | None, workdir: Path) -> None:
        self.proc: subprocess.Popen | None = None
        if url:
            self.url = url
            return
        exe = shutil.which("redis-server")
        if exe is None:
            raise ValueError("no --limits-store given and no redis-server on PATH; install Redis "
                             "(apt-get install redis-server) or give --limits-store redis://HOST:PORT/DB")
        port = _free_port()
        self.proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{port}/0"
        import redis
        client = redis.Redis(port=port, socket_connect_timeout=1)
        for _ in range(100):
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the redis-server started on port {port} did not answer")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


def _files(workdir: Path, run_id: str, rpm: int) -> tuple[Path, Path, str, str]:
    """A keys file and a tenants file for one run: its tenants' names are new, so no run finds
    another's buckets in Redis. (keys, tenants, the limited tenant's key, the other's key)."""
    from tierlm.serving.auth import keys_file_line

    limited, free = f"sk-limited-{run_id}", f"sk-free-{run_id}"
    keys = workdir / f"keys-{run_id}.txt"
    keys.write_text(keys_file_line("limited", limited) + "\n" + keys_file_line("free", free) + "\n")
    tenants = workdir / f"tenants-{run_id}.toml"
    tenants.write_text(f'[tenants.limited-{run_id}]\nkeys = ["limited"]\nrequests_per_minute = {rpm}\n'
                       f'[tenants.free-{run_id}]\nkeys = ["free"]\nrequests_per_minute = 1000000000\n'
                       'max_concurrent = 1000000\n')
    return keys, tenants, limited, free


async def _enforce(urls: list[str], key: str, workers: int, seconds: float) -> dict[str, Any]:
    """`workers` clients asking without pause (20 ms after a 429) for `seconds`, spread over
    the servers in turn: admitted and refused per server."""
    import httpx

    admitted = [0] * len(urls)
    refused = [0] * len(urls)
    other = 0
    turn = 0
    deadline = time.monotonic() + seconds
    body = {"model": "", "prompt": "hi", "max_tokens": 1}

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal turn, other
        while time.monotonic() < deadline:
            i = turn % len(urls)
            turn += 1
            r = await client.post(urls[i] + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
            if r.status_code == 200:
                admitted[i] += 1
            elif r.status_code == 429:
                refused[i] += 1
                await asyncio.sleep(0.02)
            else:
                other += 1

    async with httpx.AsyncClient(timeout=120) as client:
        body["model"] = (await client.get(urls[0] + "/v1/models", headers={"authorization": f"Bearer {key}"})
                         ).json()["data"][0]["id"]
        started = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(workers)))
        elapsed = time.monotonic() - started
    return {"admitted": sum(admitted), "refused": sum(refused), "errors": other, "elapsed_s": elapsed,
            "admitted_per_server": admitted}


async def _latency(urls: list[str], key: str, n: int, workers: int) -> list[float]:
    """Seconds per request of `n` requests that no limit refuses, `workers` at a time."""
    import httpx

    out: list[float] = []
    left = list(range(n))

    async def worker(client: httpx.AsyncClient, model: str) -> None:
        while left:
            i = left.pop()
            started = time.monotonic()
            r = await client.post(urls[i % len(urls)] + "/v1/completions", headers={"authorization": f"Bearer {key}"},
                                  json={"model": model, "prompt": "hi", "max_tokens": 1})
            if r.status_code != 200:
                raise RuntimeError(f"a request of the unlimited tenant got {r.status_code}: {r.text[:300]}")
            out.append(time.monotonic() - started)

    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(urls[0] + "/v1/models", headers={"authorization": f"Bearer {key}"})).json()["data"][0]["id"]
        await asyncio.gather(*(worker(client, model) for _ in range(workers)))
    return out


def run_mode(args: argparse.Namespace, mode: str, store_url: str, workdir: Path, run_no: int) -> dict[str, Any]:
    from tierlm.bench.serve import latency_stats
    from tierlm.dist.ray_serve import ServerProcess

    run_id = f"{run_no}-{uuid.uuid4().hex[:8]}"
    keys, tenants, limited, free = _files(workdir, run_id, args.requests_per_minute)
    serve = ["--log-level", "warning", "serve", "--no-request-log", "--device", args.device,
             "--api-keys", str(keys), "--tenants", str(tenants)]
    if args.model:
        serve[3:3] = [args.model]
    if mode == "shared":
        serve += ["--limits-store", store_url]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_server)}
    servers = [ServerProcess(serve, "127.0.0.1", env=env, log=str(workdir / f"server-{run_id}-{i}.log"))
               for i in range(args.servers)]
    try:
        for i, s in enumerate(servers):
            print(f"  starting server {i} ({mode}; log: {s.log})", file=sys.stderr, flush=True)
            s.start(ready_timeout=600)
        urls = [s.url for s in servers]
        asyncio.run(_latency(urls, free, 2 * len(urls), 1))  # warm-up: each server's first requests
        latencies = asyncio.run(_latency(urls, free, args.overhead_requests, args.workers))
        enforcement = asyncio.run(_enforce(urls, limited, args.workers, args.seconds))
    finally:
        for s in servers:
            s.stop()
    allowed = args.requests_per_minute * (1 + enforcement["elapsed_s"] / 60.0)
    return {"mode": mode, "run": run_no, **enforcement, "allowed": allowed,
            "admitted_over_allowed": enforcement["admitted"] / allowed,
            "latency_ms": latency_stats(latencies), "overhead_requests": len(latencies)}


def admission_cost(store_url: str, n: int) -> dict[str, float]:
    """Microseconds per admission + release of a tenant whose limits are never reached: this
    process's own limiter against the store (one Redis round trip each way)."""
    import tomllib

    from tierlm.serving.limit_store import LimitStore
    from tierlm.serving.tenancy import Tenancy, TenantsConfig

    toml = ('[tenants.t]\nkeys = ["k"]\nrequests_per_minute = 1000000000\ntokens_per_minute = 1000000000\n'
            'max_concurrent = 1000000\n')
    out: dict[str, float] = {}

    async def loop(t: Tenancy) -> float:
        tenant = t.tenant_of("k")
        for _ in range(min(100, n)):  # warm-up: connections, scripts loaded
            await (await t.admit(tenant, "openai")).release(10)
        started = time.perf_counter()
        for _ in range(n):
            ticket = await t.admit(tenant, "openai")
            await ticket.release(10)
        cost = (time.perf_counter() - started) / n * 1e6
        await t.close()
        return cost

    for mode in MODES:
        store = LimitStore(store_url, role=f"bench-{uuid.uuid4().hex}") if mode == "shared" else None
        t = Tenancy(TenantsConfig.parse(tomllib.loads(toml), ["k"]), store=store)
        out[mode] = asyncio.run(loop(t))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tierlm.bench.outputs import check_outputs, publish

    check_outputs({"--json": args.json, "--plot": args.plot})
    if args.limits_store is not None:
        from tierlm.config import check_redis_url
        check_redis_url(args.limits_store, option="--limits-store")
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tierlm-bench-limits-") as tmp:
        redis = _Redis(args.limits_store, Path(tmp))
        try:
            for rep in range(args.repeats):
                for mode in (MODES if rep % 2 == 0 else tuple(reversed(MODES))):
                    print(f"run {len(runs) + 1}/{args.repeats * len(MODES)}: {mode}, {args.servers} servers",
                          file=sys.stderr, flush=True)
                    row = run_mode(args, mode, redis.url, Path(tmp), len(runs))
                    runs.append(row)
                    print(f"  admitted {row['admitted']} of {row['admitted'] + row['refused']} requests in "
                          f"{row['elapsed_s']:.1f} s ({row['admitted_over_allowed']:.2f}x the {row['allowed']:.0f} "
                          f"the limit allows); unlimited tenant's latency p50 {row['latency_ms']['p50']:.1f} ms",
                          file=sys.stderr, flush=True)
            cost = admission_cost(redis.url, args.admissions)
        finally:
            redis.stop()
    summary = {}
    for mode in MODES:
        rows = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            "admitted_over_allowed": statistics.median(r["admitted_over_allowed"] for r in rows),
            "admitted": statistics.median(r["admitted"] for r in rows),
            "refused": statistics.median(r["refused"] for r in rows),
            "latency_p50_ms": statistics.median(r["latency_ms"]["p50"] for r in rows),
            "latency_p99_ms": statistics.median(r["latency_ms"]["p99"] for r in rows),
            "latency_mean_ms": statistics.median(r["latency_ms"]["mean"] for r in rows),
            "admission_us": cost[mode],
        }
    peer, shared = summary["per_server"], summary["shared"]
    vs_peer = {"over_admission_per_server": peer["admitted_over_allowed"],
               "over_admission_shared": shared["admitted_over_allowed"],
               "latency_p50_ratio": shared["latency_p50_ms"] / peer["latency_p50_ms"],
               "latency_mean_ratio": shared["latency_mean_ms"] / peer["latency_mean_ms"],
               "admission_us_added": shared["admission_us"] - peer["admission_us"]}
    doc = {"servers": args.servers, "seconds": args.seconds, "requests_per_minute": args.requests_per_minute,
           "workers": args.workers, "repeats": args.repeats, "model": args.model or "demo",
           "peer": "per_server", "elapsed_s": time.monotonic() - started, "summary": summary, "vs_peer": vs_peer,
           "runs": runs}
    return publish(doc, args.json, report, args.plot, _plot)


def report(doc: dict[str, Any]) -> str:
    s, v = doc["summary"], doc["vs_peer"]
    lines = [f"one tenant of {doc['requests_per_minute']} requests a minute through {doc['servers']} servers, "
             f"{doc['workers']} clients for {doc['seconds']:g} s (median of {doc['repeats']} run(s) per mode)",
             f"{'mode':<11} {'admitted':>9} {'x bound':>8} {'p50':>8} {'p99':>8} {'admission':>10}"]
    for mode in MODES:
        m = s[mode]
        lines.append(f"{mode:<11} {m['admitted']:>9.0f} {m['admitted_over_allowed']:>7.2f}x {m['latency_p50_ms']:>6.1f}ms "
                     f"{m['latency_p99_ms']:>6.1f}ms {m['admission_us']:>8.0f}us")
    lines.append(f"shared: {v['over_admission_shared']:.2f}x the limit's bound, against {v['over_admission_per_server']:.2f}x "
                 f"per server; request latency {v['latency_p50_ratio']:.2f}x (p50), "
                 f"+{v['admission_us_added']:.0f} us per admission and release")
    return "\n".join(lines)


def _plot(path: str, doc: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tierlm.bench.plots import _save

    s = doc["summary"]
    colors = ["tab:gray", "tab:green"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = [(f"requests admitted / what {doc['requests_per_minute']}/min allows", "x the bound",
               [s[m]["admitted_over_allowed"] for m in MODES]),
              ("latency of requests under the limiter (bars: p50; marks: p99)", "ms", [s[m]["latency_p50_ms"] for m in MODES]),
              ("one admission + release, in process", "µs", [s[m]["admission_us"] for m in MODES])]
    for ax, (title, unit, vals) in zip(axes, panels):
        ax.bar(range(len(MODES)), vals, color=colors)
        ax.set_xticks(range(len(MODES)), MODES)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(unit)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="black", linestyle="--", linewidth=1)
    axes[1].scatter(range(len(MODES)), [s[m]["latency_p99_ms"] for m in MODES], marker="_", s=400, color="black")
    fig.suptitle(f"one tenant's limits across {doc['servers']} servers: each its own vs shared through Redis")
    _save(fig, path)


def add_cli(sub: Any) -> None:
    p = sub.add_parser("limits", help="a tenant's request limit across N servers: each its own vs one shared "
                       "Redis (--limits-store)")
    p.add_argument("--servers", type=at_least(2, int), default=3)
    p.add_argument("--seconds", type=at_least(1, float), default=20.0, help="length of the enforcement phase")
    p.add_argument("--requests-per-minute", type=at_least(1, int), default=60)
    p.add_argument("--workers", type=at_least(1, int), default=8, help="clients asking at once")
    p.add_argument("--overhead-requests", type=at_least(1, int), default=300,
                   help="requests of the tenant no limit refuses, timed")
    p.add_argument("--admissions", type=at_least(1, int), default=2000,
                   help="admissions + releases timed in process, per mode")
    p.add_argument("--repeats", type=at_least(1, int), default=1)
    p.add_argument("--limits-store", default=None, metavar="URL",
                   help="the Redis to share through (default: a redis-server from PATH on a free port)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads-per-server", type=at_least(1, int), default=1, help="OMP_NUM_THREADS of each server")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=lambda a: run(a) and 0)
