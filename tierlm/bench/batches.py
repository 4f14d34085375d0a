"""`tierlm bench batches`: what background work costs interactive requests, sent as a message
batch or as ordinary requests.

One server (the demo model unless `--model`) gets the same two workloads twice, on a fresh
server each time: interactive requests arriving at `--rate` per second (streamed, their time to
first token measured), and `--background` longer requests that nobody waits on. The peer sends
the background work as ordinary /v1/messages requests, `--concurrency` at a time (what a client
without a batch API does); tierlm's way sends it as one message batch, which runs below every
interactive tier's priority. The server runs at most `--max-num-seqs` requests at once and the
background work alone fills that, so requests queue: the case a batch's priority is for (with
room to spare, every request joins the running batch at once either way). Reported per mode:
the interactive requests' time to first token and how long the background work took in all;
then the ratios. `--api openai` sends the background work through OpenAI's routes instead: the
peer as /v1/chat/completions requests, tierlm's way as a JSONL file uploaded to /v1/files and
run as one /v1/batches batch (the interactive requests stay /v1/messages, streamed).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tierlm.cli import at_least, in_range

MODES = ("plain", "batch")  # the peer first


async def _ttft(client: Any, url: str, model: str, text: str, max_tokens: int) -> float:
    """Seconds to the first streamed text of one interactive request."""
    started = time.monotonic()
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "messages": [{"role": "user", "content": text}]}
    async with client.stream("POST", url + "/v1/messages", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"an interactive request got {r.status_code}: {(await r.aread())[:300]!r}")
        first = None
        async for line in r.aiter_lines():
            if first is None and "content_block_delta" in line:
                first = time.monotonic() - started
        if first is None:
            raise RuntimeError("an interactive request streamed no text")
        return first


async def _workload(url: str, mode: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        params = [{"model": model, "max_tokens": args.background_tokens,
                   "messages": [{"role": "user", "content": f"{tag} background job {i}: " + "summarise this " * 20}]}
                  for i in range(args.background)]
        started = time.monotonic()

        async def background() -> float:
            if mode == "batch" and args.api == "openai":
                return await _openai_batch(client, url, params, started, args.background)
            if mode == "batch":
                batch = (await client.post(url + "/v1/messages/batches", json={"requests": [
                    {"custom_id": f"job-{i}", "params": p} for i, p in enumerate(params)]})).json()
                while True:
                    await asyncio.sleep(0.1)
                    state = (await client.get(f"{url}/v1/messages/batches/{batch['id']}")).json()
                    if state["processing_status"] == "ended":
                        counts = state["request_counts"]
                        if counts["succeeded"] != args.background:
                            raise RuntimeError(f"the batch ended with {counts}")
                        return time.monotonic() - started
            queue = list(params)
            route = "/v1/chat/completions" if args.api == "openai" else "/v1/messages"

            async def worker() -> None:
                while queue:
                    r = await client.post(url + route, json=queue.pop())
                    if r.status_code != 200:
                        raise RuntimeError(f"a background request got {r.status_code}: {r.text[:300]}")

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return time.monotonic() - started

        async def interactive() -> list[float]:
            await asyncio.sleep(args.warmup)  # the background work has filled the engine
            tasks = []
            for i in range(args.interactive):
                tasks.append(asyncio.ensure_future(_ttft(client, url, model, f"{tag} question {i}?",
                                                         args.interactive_tokens)))
                await asyncio.sleep(1.0 / args.rate)
            return list(await asyncio.gather(*tasks))

        makespan, ttfts = await asyncio.gather(background(), interactive())
    return {"background_s": makespan, "ttft_s": ttfts}


async def _openai_batch(client: Any, url: str, params: list[dict[str, Any]], started: float, n: int) -> float:
    """Upload the requests as a JSONL file, run them as one OpenAI batch: seconds until it completed."""
    import json

    rows = "".join(json.dumps({"custom_id": f"job-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": p}) + "\n" for i, p in enumerate(params))
    upload = (await client.post(url + "/v1/files", data={"purpose": "batch"},
                                files={"file": ("jobs.jsonl", rows.encode())})).json()
    batch = (await client.post(url + "/v1/batches", json={"input_file_id": upload["id"], "completion_window": "24h",
                                                          "endpoint": "/v1/chat/completions"})).json()
    while True:
        await asyncio.sleep(0.1)
        state = (await client.get(f"{url}/v1/batches/{batch['id']}")).json()
        if state["status"] in ("completed", "failed", "cancelled", "expired"):
            if state["status"] != "completed" or state["request_counts"]["completed"] != n:
                raise RuntimeError(f"the batch ended {state['status']} with {state['request_counts']} "
                                   f"{state.get('errors')}")
            return time.monotonic() - started


def run_mode(args: argparse.Namespace, mode: str, workdir: Path, run_no: int) -> dict[str, Any]:
    from tierlm.bench.serve import latency_stats
    from tierlm.dist.ray_serve import ServerProcess

    serve = ["--log-level", "warning", "serve", "--no-request-log", "--device", args.device, "--no-auth",
             "--max-num-seqs", str(args.max_num_seqs)]
    if args.model:
        serve[3:3] = [args.model]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    server = ServerProcess(serve, "127.0.0.1", env=env, log=str(workdir / f"server-{run_no}.log"))
    print(f"  starting a server for {mode} (log: {server.log})", file=sys.stderr, flush=True)
    try:
        server.start(ready_timeout=600)
        out = asyncio.run(_workload(server.url, mode, args, uuid.uuid4().hex[:8]))
    finally:
        server.stop()
    return {"mode": mode, "run": run_no, "background_s": out["background_s"], "ttft_ms": latency_stats(out["ttft_s"])}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import statistics

    from tierlm.bench.outputs import check_outputs, publish

    check_outputs({"--json": args.json, "--plot": args.plot})
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tierlm-bench-batches-") as tmp:
        for rep in range(args.repeats):
            for mode in (MODES if rep % 2 == 0 else tuple(reversed(MODES))):
                print(f"run {len(runs) + 1}/{args.repeats * len(MODES)}: {mode}", file=sys.stderr, flush=True)
                row = run_mode(args, mode, Path(tmp), len(runs))
                runs.append(row)
                print(f"  interactive TTFT mean {row['ttft_ms']['mean']:.0f} ms, p90 {row['ttft_ms']['p90']:.0f} ms; "
                      f"background work {row['background_s']:.1f} s", file=sys.stderr, flush=True)
    summary = {m: {key: statistics.median(r["ttft_ms"][key[5:-3]] for r in runs if r["mode"] == m)
                   for key in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")}
               | {"background_s": statistics.median(r["background_s"] for r in runs if r["mode"] == m)}
               for m in MODES}
    peer, batch = summary["plain"], summary["batch"]
    vs_peer = {"ttft_mean_speedup": peer["ttft_mean_ms"] / batch["ttft_mean_ms"],
               "ttft_p90_speedup": peer["ttft_p90_ms"] / batch["ttft_p90_ms"],
               "background_time_ratio": batch["background_s"] / peer["background_s"]}
    settings = {k: getattr(args, k) for k in ("api", "max_num_seqs", "background", "background_tokens", "concurrency",
                                              "interactive", "interactive_tokens", "rate", "repeats")}
    doc = {"model": args.model or "demo", **settings, "peer": "plain", "elapsed_s": time.monotonic() - started,
           "summary": summary, "vs_peer": vs_peer, "runs": runs}
    return publish(doc, args.json, report, args.plot, _plot)


def report(doc: dict[str, Any]) -> str:
    s, v = doc["summary"], doc["vs_peer"]
    lines = [f"{doc['interactive']} interactive requests at {doc['rate']:g}/s beside {doc['background']} background "
             f"requests of {doc['background_tokens']} tokens (median of {doc['repeats']} run(s) per mode)",
             f"{'mode':<7} {'TTFT mean':>10} {'p50':>8} {'p90':>8} {'background':>11}"]
    for m in MODES:
        lines.append(f"{m:<7} {s[m]['ttft_mean_ms']:>8.0f}ms {s[m]['ttft_p50_ms']:>6.0f}ms {s[m]['ttft_p90_ms']:>6.0f}ms "
                     f"{s[m]['background_s']:>10.1f}s")
    lines.append(f"as {_labels(doc)[1]}: interactive TTFT {v['ttft_mean_speedup']:.2f}x faster (p90 {v['ttft_p90_speedup']:.2f}x); "
                 f"the background work took {v['background_time_ratio']:.2f}x as long")
    return "\n".join(lines)


def _labels(doc: dict[str, Any]) -> tuple[str, str]:
    """What the two modes sent, in words."""
    if doc.get("api", "anthropic") == "openai":
        return "/v1/chat/completions requests (peer)", "an OpenAI batch"
    return "ordinary requests (peer)", "a message batch"


def _plot(path: str, doc: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tierlm.bench.plots import _save

    s = doc["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    colors = ["tab:gray", "tab:green"]
    axes[0].bar(range(2), [s[m]["ttft_mean_ms"] for m in MODES], color=colors)
    axes[0].scatter(range(2), [s[m]["ttft_p90_ms"] for m in MODES], marker="_", s=400, color="black")
    axes[0].set_title("interactive time to first token (bars: mean; marks: p90)", fontsize=9)
    axes[0].set_ylabel("ms")
    axes[1].bar(range(2), [s[m]["background_s"] for m in MODES], color=colors)
    axes[1].set_title(f"{doc['background']} background requests, all done", fontsize=9)
    axes[1].set_ylabel("s")
    for ax in axes:
        ax.set_xticks(range(2), [label.replace(" requests", "\nrequests") for label in _labels(doc)])
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("background work beside interactive requests: sent as ordinary requests vs as a batch")
    _save(fig, path)


def add_cli(sub: Any) -> None:
    p = sub.add_parser("batches", help="interactive TTFT beside background work sent as ordinary requests vs as a "
                       "message batch")
    p.add_argument("--api", choices=("anthropic", "openai"), default="anthropic",
                   help="the background work as /v1/messages requests vs a message batch (anthropic), or as "
                        "/v1/chat/completions requests vs an uploaded file run as a /v1/batches batch (openai)")
    p.add_argument("--background", type=at_least(1, int), default=48, help="background requests")
    p.add_argument("--background-tokens", type=at_least(1, int), default=48, help="max_tokens of each")
    p.add_argument("--concurrency", type=at_least(1, int), default=16,
                   help="background requests in flight at once when sent as ordinary requests (a batch runs 16)")
    p.add_argument("--interactive", type=at_least(1, int), default=20, help="interactive requests")
    p.add_argument("--interactive-tokens", type=at_least(1, int), default=8)
    p.add_argument("--rate", type=in_range(float, 0, low_open=True), default=2.0,
                   help="interactive requests per second")
    p.add_argument("--warmup", type=at_least(0, float), default=1.0,
                   help="seconds the background work runs before the first interactive request")
    p.add_argument("--max-num-seqs", type=at_least(1, int), default=8,
                   help="the server's running requests at most: the background work alone fills it, so new "
                        "requests queue (where the order they are served in matters)")
    p.add_argument("--repeats", type=at_least(1, int), default=1)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=at_least(1, int), default=2, help="OMP_NUM_THREADS of the server")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=lambda a: run(a) and 0)
