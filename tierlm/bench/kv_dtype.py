"""`tierlm bench kv-dtype`: an fp8 KV cache against the model's own KV dtype in the same memory,
with transformers on the same prompts as the peer.

The same greedy prompts through tierlm once per `kv_cache_dtype`, every run given the same KV
pool (by default room for `--fit-seqs` whole sequences in the model's own KV dtype), and once
through transformers' `generate` (one batch, its dynamic cache growing without a limit).
Reported per run: the pool's blocks and tokens, the most requests running at once, preemptions,
output tokens per second and the ratio against the model-dtype run and against transformers;
transformers' cache bytes per token against tierlm's pool bytes per token.

Tier copies: with `--tier-prefix-len` > 0, a prompt whose prefix of that many tokens is cached
in host memory, then only on disk, against the same prompt cold, under each KV dtype (one
engine each, with both tiers): time to first token and the bytes promoted per hit. fp8 blocks
are half the bytes to copy, read, checksum and write.

What fp8 costs in answers is measured teacher-forced: `--accuracy-prompts` sequences (a prompt
and the model-dtype run's own continuation) are scored with prompt logprobs under each KV dtype:
how often the model-dtype run's next token is still the most likely one, and the mean absolute
difference of its log-probability. The bench model has random weights, so these figures are
this model's (a trained model's activations, and so its rounding errors, differ); the capacity
and speed figures carry over to any model of the same shape. An entry `DTYPE:SCALES` sets
`kv_cache_scales` too: `fp8:checkpoint` stores fp8 unscaled (vLLM's default without scales),
beside `fp8`'s per-layer scales calibrated at load.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from tierlm.bench.throughput import DEFAULT_BENCH_MODEL_DIR, _sync, bench_model, resolve_device, timing
from tierlm.cli import in_range
from tierlm.models.kv_dtype import KV_CACHE_DTYPES
from tierlm.models.kv_scales import KV_CACHE_SCALES


def kv_settings(name: str) -> dict:
    """A `--kv-dtypes` entry, `DTYPE` or `DTYPE:SCALES` (e.g. fp8:checkpoint, unscaled fp8), as
    engine settings."""
    dtype, _, scales = name.partition(":")
    return {"kv_cache_dtype": dtype, "kv_cache_scales": scales or "auto"}


def _engine(model_dir: str, device: torch.device, kv: str, kv_cache_memory: int, max_num_seqs: int):
    from tierlm import LLM
    return LLM(model_dir, device=str(device), load_progress=False, **kv_settings(kv),
               kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs)


def run_tierlm(model_dir: str, prompts: list[list[int]], max_tokens: int, device: torch.device,
               kv_cache_dtype: str, kv_cache_memory: int) -> tuple[dict, list[list[int]]]:
    """Every prompt queued at once; the pool decides how many run together."""
    from tierlm import SamplingParams
    llm = _engine(model_dir, device, kv_cache_dtype, kv_cache_memory, max_num_seqs=len(prompts))
    eng = llm.engine
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    step, peak = eng.step, [0]

    def counted():
        out = step()
        peak[0] = max(peak[0], len(eng.scheduler.running))
        return out

    eng.step = counted
    preempted = eng.scheduler.num_preemptions
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    _sync(device)
    dt = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    caches = eng.runner.kv_caches
    figures = timing(sum(map(len, tokens)), dt)
    figures.update(kv_dtype=str(caches[0].dtype).replace("torch.", ""), kv_scales=eng.kv_scales,
                   pool_blocks=eng.pool.num_blocks,
                   pool_tokens=eng.pool.num_blocks * eng.config.block_size,
                   pool_bytes=sum(c.nbytes for c in caches),
                   bytes_per_token=sum(c.nbytes for c in caches) / (caches[0].shape[1] * caches[0].shape[2]),
                   peak_running=peak[0], preemptions=eng.scheduler.num_preemptions - preempted)
    llm.close()
    return figures, tokens


def teacher_forced(model_dir: str, device: torch.device, kv_cache_dtype: str, kv_cache_memory: int,
                   seqs: list[list[int]]) -> list[list[tuple[float, int]]]:
    """(logprob, rank) of every token after the first of each sequence, under this KV dtype
    (rank 1: the token is the model's most likely one there)."""
    from tierlm import SamplingParams
    llm = _engine(model_dir, device, kv_cache_dtype, kv_cache_memory, max_num_seqs=1)
    out = []
    for s in seqs:  # one at a time: each fits the pool whatever the dtype
        r = llm.generate({"prompt_token_ids": s}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        out.append([(lp.logprob, lp.rank) for lp in r.prompt_logprobs[1:]])
    llm.close()
    return out


def run_tiers(model_dir: str, device: torch.device, kv_cache_dtype: str, prefix_len: int, suffix_len: int,
              repeats: int) -> dict:
    """Median TTFT (s) with the prefix cold, in host memory and on disk, and bytes per promotion."""
    import statistics
    import tempfile

    from tierlm import LLM
    from tierlm.bench.prefix import _to_disk, _ttft, _warm_token_source
    rows: dict[str, list[float]] = {"cold": [], "host": [], "disk": []}
    cached: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="tierlm-kv-dtype-bench-") as tmp, \
            LLM(model_dir, device=str(device), load_progress=False, **kv_settings(kv_cache_dtype),
                kv_host_capacity="2GiB", kv_disk_dir=tmp, kv_disk_capacity="4GiB") as llm:
        toks = _warm_token_source(llm, random.Random(0))
        promoted = llm.engine.stats().kv_promoted_bytes
        for _ in range(repeats):
            prefix = toks(prefix_len)
            rows["cold"].append(_ttft(llm, prefix + toks(suffix_len), cached, "cold"))
            llm.engine.offload_prefix_cache()  # now only the host tier has it
            rows["host"].append(_ttft(llm, prefix + toks(suffix_len), cached, "host"))
            _to_disk(llm)
            rows["disk"].append(_ttft(llm, prefix + toks(suffix_len), cached, "disk"))
            llm.engine.offload_prefix_cache()
        promoted = llm.engine.stats().kv_promoted_bytes - promoted
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"ttft_s": med, "samples_s": rows, "cached_tokens": cached,
            "promoted_bytes_per_hit": promoted / (2 * repeats),
            "speedup_vs_cold": {k: med["cold"] / med[k] for k in ("host", "disk")}}


def run_hf(model_dir: str, prompts: list[list[int]], max_tokens: int, device: torch.device) -> tuple[dict, list]:
    """transformers' generate, all prompts in one batch (equal lengths: no padding)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:8]], device=device), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)  # warm-up
        ids = torch.tensor(prompts, device=device)
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
        _sync(device)
        dt = time.perf_counter() - t0
    cache = out.past_key_values
    layers = getattr(cache, "layers", [])
    kv_bytes = sum(t.nbytes for layer in layers for t in (layer.keys, layer.values) if t is not None)
    tokens = out.sequences[:, ids.shape[1]:].tolist()
    figures = timing(sum(map(len, tokens)), dt)
    figures.update(kv_dtype=str(layers[0].keys.dtype).replace("torch.", "") if layers else None,
                   cache_bytes=kv_bytes,
                   bytes_per_token=kv_bytes / (len(prompts) * out.sequences.shape[1]) if kv_bytes else None)
    del model
    return figures, tokens


def default_pool(model_dir: str, fit_seqs: int, seq_len: int, block_size: int = 16) -> int:
    """Bytes for `fit_seqs` sequences of `seq_len` tokens in the model's own KV dtype."""
    from tierlm.engine.runner import kv_bytes_per_block
    from tierlm.models.config import load_config_dict, parse_config
    from tierlm.models.registry import resolve_architecture
    cfg = load_config_dict(Path(model_dir))
    args = parse_config(cfg, resolve_architecture(cfg))
    dtype = KV_CACHE_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype"))) or torch.float32
    return fit_seqs * -(-seq_len // block_size) * kv_bytes_per_block(args, dtype, block_size)


def run(args: argparse.Namespace) -> dict:
    from tierlm.bench.outputs import check_outputs, write_json
    outs = check_outputs({"--json": args.json, "--plot": args.plot})  # fails now, not after the run
    device = resolve_device(args.device)
    model_dir = bench_model(args)
    dtypes = [d.strip() for d in str(args.kv_dtypes).split(",") if d.strip()]
    settings = [kv_settings(d) for d in dtypes]
    if not dtypes or dtypes[0] != "auto" or any(
            kv["kv_cache_dtype"] not in KV_CACHE_DTYPES or kv["kv_cache_scales"] not in KV_CACHE_SCALES
            for kv in settings):
        raise ValueError(f"--kv-dtypes must start with auto (the reference) and list kv_cache_dtype names "
                         f"({', '.join(KV_CACHE_DTYPES)}), each optionally with :kv_cache_scales "
                         f"({', '.join(KV_CACHE_SCALES)}), e.g. auto,fp8,fp8:checkpoint (got {args.kv_dtypes!r})")
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    rng = random.Random(1)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    seq_len = args.prompt_len + args.max_tokens
    pool = args.kv_cache_memory or default_pool(model_dir, args.fit_seqs, seq_len)
    tries: dict[str, list[tuple[dict, list]]] = {name: [] for name in dtypes}
    for i in range(args.repeat):  # alternating, so a slow spell on a shared machine hits every dtype alike
        for name in dtypes:
            print(f"[kv-dtype] tierlm, kv_cache_dtype={name}: {len(prompts)} prompts in a {pool / 2**20:.1f} MiB "
                  f"pool (run {i + 1}/{args.repeat})", flush=True)
            tries[name].append(run_tierlm(model_dir, prompts, args.max_tokens, device, name, pool))
    runs = {name: min(t, key=lambda r: r[0]["seconds"]) for name, t in tries.items()}  # the best counts
    for name, t in tries.items():
        runs[name][0]["runs_seconds"] = [r[0]["seconds"] for r in t]
    hf = None
    if not args.no_hf:
        print(f"[kv-dtype] transformers: {len(prompts)} prompts in one batch", flush=True)
        hf = run_hf(model_dir, prompts, args.max_tokens, device)
    tiers = {}
    if args.tier_prefix_len:
        for name in dtypes:
            print(f"[kv-dtype] tier copies, kv_cache_dtype={name}: a {args.tier_prefix_len}-token prefix from host "
                  "memory and from disk", flush=True)
            tiers[name] = run_tiers(model_dir, device, name, args.tier_prefix_len, 32, args.tier_repeats)
    base, base_tokens = runs["auto"]
    seqs = [p + t for p, t in zip(prompts[:args.accuracy_prompts], base_tokens)]
    scores = {name: teacher_forced(model_dir, device, name, pool, seqs) for name in dtypes} if seqs else {}
    results = []
    for name in dtypes:
        figures, tokens = runs[name]
        row = {"kv_cache_dtype": name, **figures, "ratio_vs_auto": figures["tok_per_s"] / base["tok_per_s"],
               "capacity_vs_auto": figures["pool_tokens"] / base["pool_tokens"],
               "identical_to_auto": sum(a == b for a, b in zip(tokens, base_tokens))}
        if hf is not None:
            row["ratio_vs_hf"] = figures["tok_per_s"] / hf[0]["tok_per_s"]
            row["identical_to_hf"] = sum(a == b for a, b in zip(tokens, hf[1]))
        if scores:
            # Every position's log-probability; the top-1 agreement over the continuations, where
            # the auto run's token is its own most likely one by construction (greedy).
            ref = [x for s in scores["auto"] for x in s]
            got = [x for s in scores[name] for x in s]
            cont = [x for s in scores[name] for x in s[-args.max_tokens:]]
            row["teacher_forced_positions"] = len(got)
            row["top1_agreement_vs_auto"] = sum(rank == 1 for _, rank in cont) / len(cont)
            row["mean_abs_logprob_diff_vs_auto"] = sum(abs(a - b) for (a, _), (b, _) in zip(ref, got)) / len(got)
        if tiers:
            t = tiers[name]
            row["tiers"] = t
            row["tier_ttft_vs_auto"] = {k: t["ttft_s"][k] / tiers["auto"]["ttft_s"][k] for k in ("host", "disk")}
        results.append(row)
        print(f"  {name:14s} {row['pool_tokens']:6d} tokens in the pool, {row['peak_running']:2d} running at most, "
              f"{row['preemptions']} preemptions: {row['tok_per_s']:6.1f} tok/s ({row['ratio_vs_auto']:.2f}x auto"
              + (f", {row['ratio_vs_hf']:.2f}x transformers" if hf else "") + ")"
              + (f"; top-1 agreement {row['top1_agreement_vs_auto']:.1%}" if scores else "")
              + ("; TTFT cold / host / disk " + " / ".join(f"{row['tiers']['ttft_s'][k] * 1e3:.0f}"
                                                         for k in ("cold", "host", "disk")) + " ms" if tiers else ""),
              flush=True)
    result = {"model": model_dir, "device": str(device), "threads": torch.get_num_threads(), "prompts": args.prompts,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeat": args.repeat, "kv_cache_memory": pool,
              "fit_seqs": None if args.kv_cache_memory else args.fit_seqs, "tier_prefix_len": args.tier_prefix_len,
              "results": results,
              "hf": hf[0] if hf else None}
    write_json(outs["--json"], result)
    if outs["--plot"] is not None:
        _plot(outs["--plot"], results, hf[0] if hf else None)
    return result


def _plot(path: str, results: list[dict], hf: dict | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tiers = all("tiers" in r for r in results)
    fig, axes = plt.subplots(1, 3 if tiers else 2, figsize=(15 if tiers else 10, 4))
    names = [r["kv_cache_dtype"] for r in results]
    axes[0].bar(names, [r["pool_tokens"] for r in results], color="tab:blue")
    axes[0].set_title("tokens the same KV memory holds")
    speed = {f"tierlm {n}": r["tok_per_s"] for n, r in zip(names, results)}
    if hf is not None:
        speed["transformers"] = hf["tok_per_s"]
    axes[1].bar(list(speed), list(speed.values()), color=["tab:blue"] * len(names) + ["tab:gray"] * (hf is not None))
    axes[1].set_title("output tokens / s (same prompts)")
    if tiers:
        places = ("cold", "host", "disk")
        width = 0.8 / len(results)
        for i, r in enumerate(results):
            axes[2].bar([j + i * width for j in range(len(places))], [r["tiers"]["ttft_s"][k] * 1e3 for k in places],
                        width, label=r["kv_cache_dtype"])
        axes[2].set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(places))], places)
        axes[2].set_yscale("log")  # cold is ~30x the rest
        axes[2].set_title("TTFT, cached prefix (ms, log scale)")
        axes[2].legend()
    for ax in axes[:2]:
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_cli(sub) -> None:
    p = sub.add_parser("kv-dtype", help="fp8 KV cache vs the model's KV dtype in the same memory, and transformers")
    p.add_argument("--model", default=None, help="a checkpoint dir (default: the 0.5B-shaped bench model)")
    p.add_argument("--bench-model-dir", default=str(DEFAULT_BENCH_MODEL_DIR))
    p.add_argument("--kv-dtypes", default="auto,fp8",
                   help="kv_cache_dtype values, auto first, each optionally :kv_cache_scales (fp8:checkpoint: "
                        "unscaled, as vLLM stores fp8 without scales) (default: auto,fp8)")
    p.add_argument("--prompts", type=in_range(int, 1), default=16)
    p.add_argument("--prompt-len", type=in_range(int, 2), default=128)
    p.add_argument("--max-tokens", type=in_range(int, 1), default=256)
    p.add_argument("--fit-seqs", type=in_range(int, 1), default=4,
                   help="the pool, in whole sequences of the model's own KV dtype (default: 4)")
    p.add_argument("--kv-cache-memory", type=in_range(int, 1), default=None,
                   help="the pool in bytes, instead of --fit-seqs")
    p.add_argument("--accuracy-prompts", type=in_range(int, 0), default=4,
                   help="sequences scored teacher-forced under each KV dtype (default: 4; 0 skips)")
    p.add_argument("--tier-prefix-len", type=in_range(int, 0), default=2000,
                   help="prefix tokens cached in host memory and on disk for the tier-copy part (0 skips it)")
    p.add_argument("--tier-repeats", type=in_range(int, 1), default=3)
    p.add_argument("--repeat", type=in_range(int, 1), default=1,
                   help="throughput runs per KV dtype, alternating; the best counts (default: 1)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers run")
    p.add_argument("--threads", type=in_range(int, 1), default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=lambda a: run(a) and 0)
