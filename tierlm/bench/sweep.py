"""`tierlm bench sweep`: goodput and p99 latencies across request rates, for one or more servers.

Each server (an URL given with `--server LABEL=URL`, or a `tierlm serve` started and stopped
here with `--spawn LABEL='serve args'`) gets the same workload at every rate in
`--request-rates`, so configurations — chunked prefill on/off, tierlm vs a peer — are compared
in one run. Spawned servers run one at a time, so they never compete for the machine.

Every rate uses fresh prompts (a different seed), so no run is helped by the prefix cache
left behind by the one before. Writes the combined JSON, one JSON per server
(`<json stem>_<label>.json`), a markdown table (`<json stem>.md`) and one PNG
(`<json stem>.png`: goodput, p99 TTFT, p99 TPOT and p99 E2E latency against request rate).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from tierlm.bench.serve import (
    SLO,
    build_requests,
    check_args,
    first_failure,
    make_target,
    request_records,
    run_benchmark,
    summarize,
    to_json,
    token_range_of,
    warmup_requests,
)
from tierlm.bench.serve import add_arguments as add_serve_arguments


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--request-rates expects numbers separated by commas (inf allowed), got '{text}'") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--request-rates needs at least one positive rate, got '{text}'")
    return rates


def _labelled(spec: str, flag: str) -> tuple[str, str]:
    label, sep, value = spec.partition("=")
    if not sep or not label or not value:
        raise ValueError(f"{flag} expects LABEL=VALUE, got '{spec}'")
    return label, value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def spawned_server(serve_args: str, log_path: Path, ready_timeout: float = 900.0) -> Iterator[str]:
    """`tierlm serve SERVE_ARGS` on a free loopback port; yields its URL once /ready says so."""
    port = _free_port()
    cmd = [sys.executable, "-m", "tierlm.cli", "serve", *shlex.split(serve_args), "--host", "127.0.0.1",
           "--port", str(port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + ready_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}; see {log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not become ready in {ready_timeout:.0f}s; see {log_path}")
                try:
                    if httpx.get(url + "/ready", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def sweep_server(args: argparse.Namespace, url: str, rates: list[float], slo: SLO) -> list[dict[str, Any]]:
    target = await make_target(args, url)
    runs = []
    for i, rate in enumerate(rates):
        run_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * (i + 1)})
        requests = build_requests(run_args)
        warmups = warmup_requests(requests, args.num_warmups if i == 0 else 0, args.seed, token_range_of(args))
        results, duration = await run_benchmark(target, requests, request_rate=rate, burstiness=args.burstiness,
                                                max_concurrency=args.max_concurrency, seed=run_args.seed,
                                                warmups=warmups, progress=args.progress)
        summary = summarize(results, duration, slo)
        runs.append({"request_rate": rate, **summary, "requests": request_records(results)})
        print(f"  rate {rate:>6g} req/s: goodput {summary['goodput']:.3f} req/s, "
              f"p99 TTFT {_fmt(summary['ttft_ms']['p99'])} ms, p99 TPOT {_fmt(summary['tpot_ms']['p99'])} ms, "
              f"{summary['failed']} failed", file=sys.stderr, flush=True)
        if (failure := first_failure(results, target.url)) is not None:
            print(f"  error: {failure}", file=sys.stderr, flush=True)
    return runs


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def markdown_table(servers: dict[str, list[dict[str, Any]]], slo: SLO) -> str:
    slo_text = ", ".join(f"{k} ≤ {v:g}" for k, v in vars(slo).items() if v is not None)
    lines = [f"Goodput (requests/s meeting {slo_text}) and p99 latencies (ms) by request rate.", "",
             "| server | rate (req/s) | goodput (req/s) | SLO met | output tok/s | p99 TTFT | p99 TPOT | p99 ITL "
             "| p99 E2E | failed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, runs in servers.items():
        for r in runs:
            lines.append(f"| {label} | {r['request_rate']:g} | {r['goodput']:.3f} | {r['slo_attainment'] * 100:.0f}% "
                         f"| {r['output_token_throughput']:.1f} | {_fmt(r['ttft_ms']['p99'])} "
                         f"| {_fmt(r['tpot_ms']['p99'])} | {_fmt(r['itl_ms']['p99'])} | {_fmt(r['e2el_ms']['p99'])} "
                         f"| {r['failed']} |")
    return "\n".join(lines) + "\n"


def plot(path: str, servers: dict[str, list[dict[str, Any]]], title: str) -> str:
    from tierlm.bench.plots import stacked_plot

    def series(key: str, stat: str | None = None) -> dict[str, tuple[list[float], list[float]]]:
        out = {}
        for label, runs in servers.items():
            pts = [(r["request_rate"], r[key] if stat is None else r[key][stat]) for r in runs
                   if math.isfinite(r["request_rate"])]
            pts = [(x, y) for x, y in pts if y is not None]
            out[label] = ([x for x, _ in pts], [y for _, y in pts])
        return out

    return stacked_plot(path, {
        "goodput": ("req/s", series("goodput")),
        "p99 time to first token": ("ms", series("ttft_ms", "p99")),
        "p99 time per output token": ("ms", series("tpot_ms", "p99")),
        "p99 end-to-end latency": ("ms", series("e2el_ms", "p99")),
    }, title=title, xlabel="request rate (req/s)", markers=True)


async def _servers_run(args: argparse.Namespace, rates: list[float], slo: SLO, out: Path) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    servers: dict[str, list[dict[str, Any]]] = {}
    specs: list[tuple[str, str, str]] = []
    if args.base_url:
        specs.append(("tierlm", "url", args.base_url))
    for flag, kind, values in (("--server", "url", args.server), ("--spawn", "spawn", args.spawn)):
        for spec in values:
            label, value = _labelled(spec, flag)
            specs.append((label, kind, value))
    if not specs:
        raise ValueError("give at least one server: --base-url URL, --server LABEL=URL or --spawn LABEL='serve args'")
    labels = [label for label, _, _ in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"server labels must be unique, got {labels}")
    for label, kind, value in specs:
        print(f"[{label}] {value}", file=sys.stderr, flush=True)
        if kind == "url":
            servers[label] = await sweep_server(args, value, rates, slo)
        else:
            log_path = out.with_name(f"{out.stem}_{label}_server.log")
            with spawned_server(value, log_path) as url:
                servers[label] = await sweep_server(args, url, rates, slo)
        one = {"label": label, "server": value, "runs": servers[label]}
        out.with_name(f"{out.stem}_{label}.json").write_text(to_json(one))
    return {"servers": servers, "specs": [{"label": a, "kind": b, "value": c} for a, b, c in specs]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rates = parse_rates(args.request_rates)
    if not args.slo:
        raise ValueError("bench sweep measures goodput: pass --slo ttft_ms=…,tpot_ms=…")
    slo = SLO.parse(args.slo)
    from tierlm.bench.outputs import check_outputs
    check_outputs({"--json": args.json}, inputs=[args.trace] if args.trace else [])  # before minutes of load
    check_args(args)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(_servers_run(args, rates, slo, out))
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key") and not callable(v)}
    result = {"config": config, "request_rates": rates, "slo": vars(slo), **result}
    table = markdown_table(result["servers"], slo)
    out.with_suffix(".md").write_text(table)
    workload = (f"trace {Path(args.trace).name}" if args.trace
                else f"input {args.input_len} ±{args.range_ratio:.0%}, output {args.output_len}")
    result["plot"] = plot(str(out.with_suffix(".png")), result["servers"], f"Goodput and p99 latency — {workload}")
    out.write_text(to_json(result))
    print(table)
    return result


def _main(args: argparse.Namespace) -> int:
    """Exit status 2 for bad options, 1 when no request at any rate on any server completed (as
    `bench serve`: a script running the sweep saw success), else 0."""
    try:
        result = run(args)
    except (ValueError, OSError, RuntimeError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs = [r for server in result["servers"].values() for r in server]
    return 0 if any(r.get("completed") for r in runs) else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="one server to sweep (labelled 'tierlm')")
    p.add_argument("--server", action="append", default=[], metavar="LABEL=URL", help="a running server (repeat)")
    p.add_argument("--spawn", action="append", default=[], metavar="LABEL=ARGS",
                   help="start `tierlm serve ARGS` for this label, sweep it, stop it (repeat)")
    p.add_argument("--request-rates", default="0.5,1,2,4", help="comma-separated requests/s (inf allowed)")
    add_serve_arguments(p, sweep=True)


def add_cli(sub: Any) -> None:
    p = sub.add_parser("sweep", help="goodput and p99 latencies across request rates (one PNG)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_main, progress=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tierlm.bench.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(_main(parser.parse_args()))
