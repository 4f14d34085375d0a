"""`tierlm bench prefix`: time to first token with a cached prefix (device / host / disk, and
Redis with `--kv-remote`) vs cold.

The peer here is tierlm itself without the cache (cold prefill of the same prompt), measured in
the same run; the ratios are what the cache buys.

Second part, the stall: requests are decoding when one arrives whose prefix is on disk. With
`kv_prefetch` its blocks are read on a background thread while the decodes go on, and the step
that admits it only copies them in; without, that step reads the disk itself. Reported: the
longest step the running decodes see from the arrival to the newcomer's first token, both ways.

Third part, with `--kv-remote`: the prefix held only in Redis, read several blocks per round trip
(the default) against one block per round trip, optionally behind a proxy that adds latency.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from tierlm.cli import at_least


def _ttft(llm, prompt: list[int], cached: dict | None = None, key: str = "") -> float:
    from tierlm import SamplingParams
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, ignore_eos=True))
    dt = time.perf_counter() - t
    if cached is not None:
        cached.setdefault(key, []).append(out[0].num_cached_tokens)
    return dt


def _to_disk(llm) -> None:
    llm.engine.offload_prefix_cache()
    llm.engine.store.spill(0)  # push the host copies down to disk


def _stall(llm, prompt: list[int], decoders: list[list[int]], prefetch: bool) -> dict:
    """Steps seen by running decodes while a request with a disk-cached prefix arrives."""
    from tierlm import SamplingParams
    eng = llm.engine
    was, eng.kv.prefetching = eng.kv.prefetching, prefetch
    running = [eng.add_request({"prompt_token_ids": d},
                               SamplingParams(max_tokens=eng.max_model_len - len(d), ignore_eos=True))
               for d in decoders]
    while any(not r.output_token_ids for r in running):
        eng.step()
    before = []
    for _ in range(3):
        t = time.perf_counter()
        eng.step()
        before.append(time.perf_counter() - t)
    late = eng.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, ignore_eos=True))
    steps = []
    while not late.output_token_ids:
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    for r in running:
        eng.abort(r.request_id)
    eng.kv.prefetching = was
    return {"decode_step_s": statistics.median(before), "max_step_s": max(steps), "steps": len(steps),
            "ttft_s": sum(steps), "cached_tokens": late.num_cached_tokens}


def _warm_token_source(llm, rng: random.Random) -> Callable[[int], list[int]]:
    """`toks(n)`: n random token ids from `rng`; one short request first warms the engine up."""
    vocab = llm.engine.args.vocab_size

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    _ttft(llm, toks(32))
    return toks


def _measure(llm, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """TTFT samples per place the prefix sits (cold, device, host, disk), and the stall runs.
    The first `args.warmup` rounds are run the same way and dropped: on a GPU they pay for the
    first use of each step shape (kernel choice; with CUDA graphs, recording one per shape),
    which a serving engine pays once, not per request."""
    toks = _warm_token_source(llm, random.Random(0))
    rows: dict[str, list[float]] = {"cold": [], "device": [], "host": [], "disk": []}
    cached: dict[str, list[int]] = {}
    stalls: dict[str, list[dict]] = {"prefetch": [], "no_prefetch": []}
    for i in range(-args.warmup, args.repeats):
        keep = i >= 0
        got: dict[str, float] = {}
        seen: dict[str, list[int]] = {}
        prefix = toks(args.prefix_len)
        got["cold"] = _ttft(llm, prefix + toks(args.suffix_len), seen, "cold")
        got["device"] = _ttft(llm, prefix + toks(args.suffix_len), seen, "device")
        llm.engine.offload_prefix_cache()  # now only the host tier has it
        got["host"] = _ttft(llm, prefix + toks(args.suffix_len), seen, "host")
        _to_disk(llm)
        got["disk"] = _ttft(llm, prefix + toks(args.suffix_len), seen, "disk")
        for prefetch in (True, False):
            _to_disk(llm)
            decoders = [toks(64) for _ in range(args.decoders)]
            stall = _stall(llm, prefix + toks(args.suffix_len), decoders, prefetch)
            if keep:
                stalls["prefetch" if prefetch else "no_prefetch"].append(stall)
        llm.engine.offload_prefix_cache()
        label = f"repeat {i + 1}/{args.repeats}" if keep else f"warm-up {i + args.warmup + 1}/{args.warmup} (dropped)"
        print(f"  {label}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in got.items()), flush=True)
        if keep:
            for k, v in got.items():
                rows[k].append(v)
            for k, v in seen.items():
                cached.setdefault(k, []).extend(v)
    return rows, cached, stalls


def _rtt_ms(client) -> float:
    samples = []
    for _ in range(50):
        t = time.perf_counter()
        client.ping()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3


def _measure_remote(model: str, args: argparse.Namespace) -> dict:
    """TTFT with the prefix only in Redis: read ahead `remote_batch` blocks per round trip (the
    default) and, as the peer, one round trip per block. With delays, Redis is reached through a
    proxy that adds each delay in turn (0 = the proxy alone), as if it were across a network."""
    import contextlib

    import redis

    from tierlm import LLM
    from tierlm.bench.netdelay import DelayProxy

    url, delays, proxy = args.kv_remote, args.kv_remote_delay_ms, None
    with contextlib.ExitStack() as stack:
        if delays:
            parts = urlsplit(url)
            proxy = DelayProxy(parts.hostname or "127.0.0.1", parts.port or 6379, delays[0] / 1e3)
            port = stack.enter_context(proxy)
            creds = parts.netloc.rpartition("@")[0]  # keep a password, if the URL has one
            url = urlunsplit(parts._replace(netloc=f"{creds + '@' if creds else ''}127.0.0.1:{port}"))
        client = redis.Redis.from_url(url)
        stack.callback(client.close)
        llm = stack.enter_context(LLM(model, dtype=args.dtype, load_progress=False, kv_cache_memory=args.kv_cache_memory,
                                      max_num_batched_tokens=args.max_num_batched_tokens, kv_remote=url,
                                      kv_remote_write_through=False))
        toks = _warm_token_source(llm, random.Random())  # prompts new to this Redis (it may hold old runs')
        store = llm.engine.store
        batched = store.remote_batch
        cold: list[float] = []
        points = []
        for delay in delays or [None]:
            if proxy is not None:
                proxy.delay_s = delay / 1e3
            rows: dict[str, list[float]] = {"redis": [], "redis_per_block": []}
            cached: dict[str, list[int]] = {}
            for i in range(args.repeats):
                prefix = toks(args.prefix_len)
                cold.append(_ttft(llm, prefix + toks(args.suffix_len), cached, "cold"))
                order = [("redis", batched), ("redis_per_block", 1)]
                for key, batch in order if i % 2 == 0 else order[::-1]:
                    llm.engine.offload_prefix_cache()  # device -> Redis, the only lower tier
                    store.flush()
                    store.remote_batch = batch
                    rows[key].append(_ttft(llm, prefix + toks(args.suffix_len), cached, key))
                store.remote_batch = batched
            med = {k: statistics.median(v) for k, v in rows.items()}
            points.append({"delay_ms_each_way": delay, "rtt_ms": _rtt_ms(client), "ttft_s": med, "samples_s": rows,
                           "cached_tokens": cached, "per_block_vs_batched": med["redis_per_block"] / med["redis"]})
            p = points[-1]
            print(f"  Redis RTT {p['rtt_ms']:.2f} ms: TTFT {med['redis'] * 1e3:.0f} ms reading {batched} blocks per "
                  f"round trip, {med['redis_per_block'] * 1e3:.0f} ms one per round trip "
                  f"({p['per_block_vs_batched']:.2f}x)", flush=True)
    return {"blocks_per_round_trip": batched, "cold_ttft_s": statistics.median(cold), "cold_samples_s": cold,
            "by_delay": points}


def run(args: argparse.Namespace) -> dict:
    from tierlm import LLM
    from tierlm.bench.outputs import check_outputs
    outs = check_outputs({"--json": args.json, "--plot": args.plot})  # fails now, not after the run
    args.json, args.plot = outs["--json"], outs["--plot"]
    from tierlm.bench.throughput import ensure_bench_model
    from tierlm.bench.throughput import DEFAULT_BENCH_MODEL_DIR
    model = args.model or str(ensure_bench_model(Path(args.bench_model_dir or DEFAULT_BENCH_MODEL_DIR)))
    # The disk tier's files (GBs) go with the temporary directory when the run ends.
    with tempfile.TemporaryDirectory(prefix="tierlm-prefix-bench-") as tmp, \
            LLM(model, dtype=args.dtype, load_progress=False, kv_cache_memory=args.kv_cache_memory,
                max_num_batched_tokens=args.max_num_batched_tokens, kv_host_capacity="4GiB",
                kv_disk_dir=tmp, kv_disk_capacity="8GiB", cuda_graphs=args.cuda_graphs) as llm:
        rows, cached, stalls = _measure(llm, args)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {"model": model, "dtype": args.dtype, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
              "cuda_graphs": args.cuda_graphs, "warmup_rounds": args.warmup,
              "ttft_s": med, "speedup_vs_cold": {k: med["cold"] / med[k] for k in ("device", "host", "disk")},
              "cached_tokens": cached, "samples_s": rows}
    stall = {k: {f: statistics.median(x[f] for x in v) for f in ("decode_step_s", "max_step_s", "ttft_s", "steps")}
             for k, v in stalls.items()}
    result["disk_arrival_during_decode"] = {
        "decoders": args.decoders, "median_over_repeats": stall, "samples": stalls,
        "max_step_ratio_no_prefetch_vs_prefetch": stall["no_prefetch"]["max_step_s"] / stall["prefetch"]["max_step_s"]}
    if args.kv_remote:
        result["redis"] = _measure_remote(model, args)
    for k, v in result["speedup_vs_cold"].items():
        print(f"TTFT with the {args.prefix_len}-token prefix on {k}: {med[k] * 1e3:.0f} ms, {v:.1f}x lower than cold "
              f"({med['cold'] * 1e3:.0f} ms)")
    for k, v in stall.items():
        print(f"{args.decoders} decodes running, a disk-prefixed request arrives ({k}): longest step "
              f"{v['max_step_s'] * 1e3:.0f} ms (decode step {v['decode_step_s'] * 1e3:.0f} ms), "
              f"its TTFT {v['ttft_s'] * 1e3:.0f} ms over {v['steps']:.0f} steps")
    from tierlm.bench.outputs import write_json
    write_json(args.json, result)
    if args.plot is not None:
        plot_prefix(result, args.plot)
    return result


def plot_prefix(result: dict, path: str) -> str:
    """TTFT per place the prefix sits (log scale: cold is 50x the rest)."""
    from tierlm.bench.plots import bar_plot
    bars = {k: v * 1e3 for k, v in result["ttft_s"].items()}
    for point in result.get("redis", {}).get("by_delay", []):
        rtt = f"{point['rtt_ms']:.1f} ms RTT" if point["delay_ms_each_way"] is not None else "direct"
        bars[f"redis, {rtt}"] = point["ttft_s"]["redis"] * 1e3
        bars[f"redis, {rtt}, 1 block/trip"] = point["ttft_s"]["redis_per_block"] * 1e3
    return bar_plot(path, bars, title=f"TTFT, {result['prefix_len']}-token cached prefix + {result['suffix_len']} "
                    "new tokens", ylabel="ms (log scale)", logy=True)


def _delays(text: str) -> list[float]:
    try:
        delays = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, e.g. 0,0.25,1; got {text!r}") from None
    if any(d < 0 for d in delays):
        raise argparse.ArgumentTypeError(f"delays cannot be negative: {text!r}")
    return delays


def add_cli(sub) -> None:
    p = sub.add_parser("prefix", help="TTFT with a cached prefix on device / host / disk vs cold")
    p.add_argument("--model", default=None)
    p.add_argument("--bench-model-dir", default=None,
                   help="where the 0.5B-shaped benchmark model is built (default: tierlm's cache)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefix-len", type=at_least(1, int), default=2000)
    p.add_argument("--suffix-len", type=at_least(1, int), default=32)
    p.add_argument("--repeats", type=at_least(1, int), default=3)
    p.add_argument("--warmup", type=at_least(0, int), default=1,
                   help="rounds run first and dropped (first use of each step shape; CUDA graph recording)")
    p.add_argument("--decoders", type=at_least(0, int), default=4,
                   help="requests decoding when the disk-prefixed one arrives (the stall measurement)")
    p.add_argument("--kv-cache-memory", default=1 << 30,
                   help="device KV pool: a size ('8GiB'), a count ('2000 blocks') or bytes")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-remote", default=None, metavar="URL",
                   help="also measure a prefix held only in this Redis (a second engine, Redis its only tier)")
    p.add_argument("--kv-remote-delay-ms", type=_delays, default=[],
                   help="one-way latencies (ms, comma-separated, e.g. 0,0.25,1) a local proxy adds in front of "
                        "--kv-remote in turn, as if Redis were across a network")
    p.add_argument("--cuda-graphs", action="store_true", help="record small steps as CUDA graphs")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=lambda a: run(a) and 0)
