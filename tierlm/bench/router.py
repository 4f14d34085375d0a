"""`tierlm bench router`: where requests land decides what the replicas' caches are worth.

The same trace (a Mooncake trace: conversations whose turns share their earlier turns' blocks)
is replayed through `tierlm router` in front of the same number of fresh replicas, once per
routing policy: `cache_aware` (tierlm's: the replica that holds the prompt's prefix), and the
peers a plain load balancer offers, `round_robin` (nginx's, a Kubernetes Service's default)
and `least_load` (fewest requests in flight). Replicas are started anew for each run, so no run
finds another's cache. Reported per policy: the share of prompt tokens read from a replica's
cache (the replicas' own `usage` counts), the prompt tokens computed, time to first token and
throughput; then the ratios against round robin. With `--repeats` the policies alternate and
medians are reported.

On one machine the replicas share its CPUs (or GPU), so the times compare the policies with
each other, not with a single server.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tierlm.cli import at_least, in_range

logger = logging.getLogger("tierlm.bench")

PEER = "round_robin"


def _serve_args(args: argparse.Namespace) -> list[str]:
    out = ["--log-level", "warning", "serve", "--no-request-log", "--device", args.device,
           "--max-model-len", str(args.max_model_len), "--kv-cache-memory", args.kv_cache_memory]
    if args.model:
        out[3:3] = [args.model]
    return out


def _router_counts(router) -> dict[str, Any]:
    decisions: dict[str, float] = {}
    for metric in router.metrics.requests.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                decisions[s.labels["decision"]] = decisions.get(s.labels["decision"], 0) + s.value
    chunks = {s.labels["kind"]: s.value for m in router.metrics.prompt_chunks.collect() for s in m.samples
              if s.name.endswith("_total")}
    per_replica = [sum(s.value for m in router.metrics.requests.collect() for s in m.samples
                       if s.name.endswith("_total") and s.labels["replica"] == r.name) for r in router.replicas]
    return {"decisions": decisions, "prompt_chunks": chunks, "requests_per_replica": per_replica}


def run_once(args: argparse.Namespace, policy: str, requests, reuse: list[float], workdir: Path,
             run_no: int) -> dict[str, Any]:
    """One policy's run on fresh replicas. `reuse`: each request's `prefix_reuse`; those at 0.5
    or more (mostly a conversation's later turns) get their own TTFT figures."""
    from tierlm.bench.serve import Target, latency_stats, run_benchmark, summarize
    from tierlm.dist.ray_serve import ServerProcess
    from tierlm.dist.router import Router, RouterConfig, RouterThread

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_replica)}
    servers = [ServerProcess(_serve_args(args), "127.0.0.1", env=env, log=str(workdir / f"replica-{run_no}-{i}.log"))
               for i in range(args.replicas)]
    try:
        for i, s in enumerate(servers):
            print(f"  starting replica {i} for {policy} (log: {s.log})", file=sys.stderr, flush=True)
            s.start(ready_timeout=600)
        router = Router(RouterConfig(replicas=[s.url for s in servers], policy=policy))
        with RouterThread(router) as front:
            import httpx
            model = httpx.get(servers[0].url + "/v1/models", timeout=30).json()["data"][0]["id"]  # not counted by the router
            target = Target(front.url, api="openai", model=model, endpoint="/v1/completions", ignore_eos=True)
            results, duration = asyncio.run(run_benchmark(target, requests, progress=args.progress))
            counts = _router_counts(router)
    finally:
        for s in servers:
            s.stop()
    summary = summarize(results, duration)
    follow = [r.ttft for r, share in zip(results, reuse) if r.ok and r.ttft is not None and share >= 0.5]
    summary["follow_up_ttft_ms"] = latency_stats(follow)
    summary["follow_ups"] = len(follow)
    ok = [r for r in results if r.ok]
    prompt = sum(r.input_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {"policy": policy, "run": run_no, "cached_share": cached / prompt if prompt else 0.0,
            "prompt_tokens": prompt, "computed_prompt_tokens": prompt - cached, "router": counts, **summary}


def prefix_reuse(trace: str, start: int, n: int) -> list[float]:
    """Per request of the replayed window: the share of its blocks that lead with blocks an
    earlier request of the window had (what an unbounded cache on one server would hold)."""
    import json

    seen: set = set()
    out: list[float] = []
    with open(trace) as f:
        rows = [json.loads(line) for i, line in enumerate(f) if start <= i and line.strip()][:n]
    for row in rows:
        ids = row.get("hash_ids") or []
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        out.append(k / len(ids) if ids else 0.0)
        seen.update(ids)
    return out


def _median(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> float | None:
    vals = [(r[key][sub] if sub else r[key]) for r in rows]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tierlm.bench.outputs import check_outputs, publish
    from tierlm.bench.serve import TraceScaling, trace_requests

    check_outputs({"--json": args.json, "--plot": args.plot}, inputs=[args.trace])
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    from tierlm.dist.affinity import ROUTING_POLICIES
    for p in policies:
        if p not in ROUTING_POLICIES:
            raise ValueError(f"--policies: unknown routing policy '{p}'; choose from {', '.join(ROUTING_POLICIES)}")
    if PEER not in policies:
        policies.append(PEER)
    scaling = TraceScaling(block_tokens=args.trace_block_tokens, time_scale=args.trace_time_scale,
                           max_input=args.trace_max_input, max_output=args.trace_max_output)
    requests = trace_requests(args.trace, args.num_prompts, scaling, start=args.trace_start, seed=args.seed)
    reuse = prefix_reuse(args.trace, args.trace_start, len(requests))
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tierlm-bench-router-") as tmp:
        for rep in range(args.repeats):
            order = policies if rep % 2 == 0 else list(reversed(policies))
            for policy in order:
                print(f"run {len(runs) + 1}/{args.repeats * len(policies)}: {policy}, {len(requests)} requests "
                      f"through {args.replicas} replicas", file=sys.stderr, flush=True)
                row = run_once(args, policy, requests, reuse, Path(tmp), len(runs))
                runs.append(row)
                print(f"  cached {row['cached_share']:.1%} of prompt tokens, TTFT mean "
                      f"{row['ttft_ms']['mean']:.0f} ms, p90 {row['ttft_ms']['p90']:.0f} ms (follow-ups: mean "
                      f"{row['follow_up_ttft_ms']['mean'] or 0:.0f} ms), {row['failed']} failed",
                      file=sys.stderr, flush=True)
    summary = {}
    for policy in policies:
        rows = [r for r in runs if r["policy"] == policy]
        summary[policy] = {
            "cached_share": _median(rows, "cached_share"),
            "computed_prompt_tokens": _median(rows, "computed_prompt_tokens"),
            "ttft_mean_ms": _median(rows, "ttft_ms", "mean"),
            "ttft_p50_ms": _median(rows, "ttft_ms", "p50"),
            "ttft_p90_ms": _median(rows, "ttft_ms", "p90"),
            "ttft_p99_ms": _median(rows, "ttft_ms", "p99"),
            "follow_up_ttft_mean_ms": _median(rows, "follow_up_ttft_ms", "mean"),
            "follow_up_ttft_p90_ms": _median(rows, "follow_up_ttft_ms", "p90"),
            "e2el_mean_ms": _median(rows, "e2el_ms", "mean"),
            "output_token_throughput": _median(rows, "output_token_throughput"),
            "failed": sum(r["failed"] for r in rows),
        }
    peer = summary[PEER]

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    vs_peer = {p: {"computed_prompt_tokens": ratio(s["computed_prompt_tokens"], peer["computed_prompt_tokens"]),
                   "ttft_mean_speedup": ratio(peer["ttft_mean_ms"], s["ttft_mean_ms"]),
                   "ttft_p90_speedup": ratio(peer["ttft_p90_ms"], s["ttft_p90_ms"]),
                   "follow_up_ttft_mean_speedup": ratio(peer["follow_up_ttft_mean_ms"], s["follow_up_ttft_mean_ms"]),
                   "cached_share_gain": (s["cached_share"] or 0) - (peer["cached_share"] or 0)}
               for p, s in summary.items()}
    doc = {"trace": args.trace, "num_prompts": len(requests), "replicas": args.replicas, "repeats": args.repeats,
           "follow_ups": sum(1 for x in reuse if x >= 0.5),
           "model": args.model or "demo", "scaling": vars(scaling), "peer": PEER,
           "elapsed_s": time.monotonic() - started, "summary": summary, "vs_peer": vs_peer, "runs": runs}
    return publish(doc, args.json, report, args.plot, _plot)


def report(doc: dict[str, Any]) -> str:
    lines = [f"{doc['num_prompts']} requests of {doc['trace']} through {doc['replicas']} replicas, "
             f"median of {doc['repeats']} run(s) per policy",
             f"{'policy':<12} {'cached':>7} {'computed':>9} {'TTFT mean':>10} {'p90':>8} {'follow-ups':>11}"
             f"   vs {PEER}"]
    for p, s in doc["summary"].items():
        v = doc["vs_peer"][p]
        lines.append(f"{p:<12} {s['cached_share']:>7.1%} {s['computed_prompt_tokens']:>9.0f} "
                     f"{s['ttft_mean_ms']:>8.0f}ms {s['ttft_p90_ms']:>6.0f}ms {s['follow_up_ttft_mean_ms'] or 0:>9.0f}ms"
                     f"   TTFT {v['ttft_mean_speedup']:.2f}x (follow-ups {v['follow_up_ttft_mean_speedup'] or 0:.2f}x), "
                     f"computed {v['computed_prompt_tokens']:.2f}x")
    return "\n".join(lines)


def _plot(path: str, doc: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tierlm.bench.plots import _save

    names = list(doc["summary"])
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    panels = [("cached share of prompt tokens", [doc["summary"][n]["cached_share"] * 100 for n in names], "%"),
              ("prompt tokens computed", [doc["summary"][n]["computed_prompt_tokens"] for n in names], "tokens"),
              ("time to first token (bars: mean; marks: p90)", [doc["summary"][n]["ttft_mean_ms"] for n in names], "ms"),
              (f"TTFT of the {doc['follow_ups']} follow-ups (half the prompt seen before)",
               [doc["summary"][n]["follow_up_ttft_mean_ms"] or 0 for n in names], "ms")]
    for ax, (title, vals, unit) in zip(axes, panels):
        ax.bar(range(len(names)), vals, color=["tab:green" if n == "cache_aware" else "tab:gray" for n in names])
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(unit)
        ax.grid(True, axis="y", alpha=0.3)
    for ax, key in ((axes[2], "ttft_p90_ms"), (axes[3], "follow_up_ttft_p90_ms")):
        ax.scatter(range(len(names)), [doc["summary"][n][key] or 0 for n in names], marker="_", s=400, color="black")
    fig.suptitle(f"routing {doc['num_prompts']} requests of {Path(doc['trace']).name} to {doc['replicas']} replicas")
    _save(fig, path)


def add_cli(sub: Any) -> None:
    p = sub.add_parser("router", help="a trace through N replicas behind tierlm router: cache-aware routing vs "
                       "round robin and least load")
    p.add_argument("--trace", required=True, help="Mooncake trace (.jsonl), e.g. ../shared/traces/conversation_trace.jsonl")
    p.add_argument("--num-prompts", type=at_least(1, int), default=600)
    p.add_argument("--trace-start", type=at_least(0, int), default=0)
    p.add_argument("--trace-block-tokens", type=at_least(1, int), default=16,
                   help="tokens per hash_id block (the trace's are 512; fewer fit a CPU)")
    p.add_argument("--trace-time-scale", type=in_range(float, 0, low_open=True), default=0.2,
                   help="multiply trace timestamps (0.2: five times faster)")
    p.add_argument("--trace-max-input", type=at_least(1, int), default=768)
    p.add_argument("--trace-max-output", type=at_least(1, int), default=16)
    p.add_argument("--replicas", type=at_least(2, int), default=2)
    p.add_argument("--policies", default="cache_aware,least_load,round_robin",
                   help="routing policies to compare (round_robin, the peer, is always run)")
    p.add_argument("--repeats", type=at_least(1, int), default=1)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=at_least(16, int), default=1024)
    p.add_argument("--kv-cache-memory", default="64MiB", help="each replica's device KV pool")
    p.add_argument("--threads-per-replica", type=at_least(1, int), default=1, help="OMP_NUM_THREADS of each replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=lambda a: run(a) and 0)
