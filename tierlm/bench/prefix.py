"""`tierlm bench prefix`: time to first token with a cached prefix (device / host / disk) vs cold.

The peer here is tierlm itself without the cache (cold prefill of the same prompt), measured in
the same run; the ratios are what the cache buys.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path


def _ttft(llm, prompt: list[int], cached: dict | None = None, key: str = "") -> float:
    from tierlm import SamplingParams
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, ignore_eos=True))
    dt = time.perf_counter() - t
    if cached is not None:
        cached.setdefault(key, []).append(out[0].num_cached_tokens)
    return dt


def run(args: argparse.Namespace) -> dict:
    from tierlm import LLM
    from tierlm.bench.throughput import ensure_bench_model
    from tierlm.bench.throughput import DEFAULT_BENCH_MODEL_DIR
    model = args.model or str(ensure_bench_model(Path(args.bench_model_dir or DEFAULT_BENCH_MODEL_DIR)))
    rng = random.Random(0)
    tmp = tempfile.mkdtemp(prefix="tierlm-prefix-bench-")
    llm = LLM(model, dtype=args.dtype, load_progress=False, kv_cache_memory=args.kv_cache_memory,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_host_capacity="4GiB",
              kv_disk_dir=tmp, kv_disk_capacity="8GiB")
    vocab = llm.engine.args.vocab_size

    def toks(n):
        return [rng.randrange(100, vocab) for _ in range(n)]

    _ttft(llm, toks(32))  # warm-up
    rows = {"cold": [], "device": [], "host": [], "disk": []}
    cached: dict[str, list[int]] = {}
    for i in range(args.repeats):
        prefix = toks(args.prefix_len)
        rows["cold"].append(_ttft(llm, prefix + toks(args.suffix_len), cached, "cold"))
        rows["device"].append(_ttft(llm, prefix + toks(args.suffix_len), cached, "device"))
        llm.engine.offload_prefix_cache()  # now only the host tier has it
        rows["host"].append(_ttft(llm, prefix + toks(args.suffix_len), cached, "host"))
        llm.engine.offload_prefix_cache()
        llm.engine.store.spill(0)  # push the host copies down to disk
        rows["disk"].append(_ttft(llm, prefix + toks(args.suffix_len), cached, "disk"))
        llm.engine.offload_prefix_cache()
        print(f"  repeat {i + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in rows.items()),
              flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {"model": model, "dtype": args.dtype, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
              "ttft_s": med, "speedup_vs_cold": {k: med["cold"] / med[k] for k in ("device", "host", "disk")},
              "cached_tokens": cached, "samples_s": rows}
    for k, v in result["speedup_vs_cold"].items():
        print(f"TTFT with the {args.prefix_len}-token prefix on {k}: {med[k] * 1e3:.0f} ms, {v:.1f}x lower than cold "
              f"({med['cold'] * 1e3:.0f} ms)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        from tierlm.bench.plots import bar_plot
        bar_plot(args.plot, {k: v * 1e3 for k, v in med.items()},
                 title=f"TTFT, {args.prefix_len}-token cached prefix + {args.suffix_len} new tokens", ylabel="ms")
    return result


def add_cli(sub) -> None:
    p = sub.add_parser("prefix", help="TTFT with a cached prefix on device / host / disk vs cold")
    p.add_argument("--model", default=None)
    p.add_argument("--bench-model-dir", default=None,
                   help="where the 0.5B-shaped benchmark model is built (default: tierlm's cache)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=lambda a: run(a) and 0)
