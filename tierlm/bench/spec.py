"""`tierlm bench spec`: speculative decoding by n-gram lookup, tierlm vs transformers' prompt
lookup decoding, same run, same weights.

Four runs of the same greedy prompts: tierlm without and with `speculative_config`, and
transformers' `generate` without and with `prompt_lookup_num_tokens` (its own n-gram
speculation; one sequence at a time, as transformers runs it). Reported per batch size: output
tokens per second of each, the speed-ups speculation gives each engine, tierlm's acceptance
(accepted guesses / guesses checked, tokens per step), and how many answers are identical to
the runs without speculation (greedy, float32: all of them, bar exact ties).

Two prompt sets: "repeat" (a random segment written several times: the shape of code edits and
quoted documents, where guesses from the prompt have something to find) and "random" (no
repeats: guesses come only from what the model writes itself). The bench model has random
weights: how often its next tokens repeat earlier ones is its own, not a trained model's, so
the acceptance measured is this model's; what a checked guess costs (one step with k + 1 rows
against one with one) is the model's shape's, and carries over.
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

WORKLOADS = ("repeat", "random")


def make_prompts(kind: str, n: int, vocab: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens: "repeat" writes a random segment of length / 4 four times."""
    rng = random.Random(seed)
    if kind == "random":
        return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]
    seg = max(1, length // 4)
    out = []
    for _ in range(n):
        piece = [rng.randrange(100, vocab) for _ in range(seg)]
        out.append((piece * (length // seg + 1))[:length])
    return out


def run_tierlm(model_dir: str, prompts: list[list[int]], batch: int, max_tokens: int, device: torch.device,
               spec: dict | None, **engine_kw) -> tuple[dict, list[list[int]]]:
    """`prompts` through one engine, `batch` at a time (each batch one `generate`)."""
    from tierlm import LLM, SamplingParams
    llm = LLM(model_dir, dtype="float32", device=str(device), load_progress=False, speculative_config=spec,
              max_num_seqs=max(batch, 1), **engine_kw)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    before = llm.engine.stats()
    _sync(device)
    t0 = time.perf_counter()
    tokens: list[list[int]] = []
    for at in range(0, len(prompts), batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[at:at + batch]], params)
        tokens += [o.outputs[0].token_ids for o in outs]
    _sync(device)
    dt = time.perf_counter() - t0
    after = llm.engine.stats()
    del llm
    figures = timing(sum(map(len, tokens)), dt)
    figures["steps"] = after.steps - before.steps
    figures["draft_tokens"] = after.spec_draft_tokens - before.spec_draft_tokens
    figures["accepted_tokens"] = after.spec_accepted_tokens - before.spec_accepted_tokens
    return figures, tokens


def run_hf(model_dir: str, prompts: list[list[int]], max_tokens: int, device: torch.device,
           lookup: int | None, max_ngram: int) -> tuple[dict, list[list[int]]]:
    """transformers' generate, one prompt at a time (its prompt lookup takes one sequence)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    extra = {} if lookup is None else {"prompt_lookup_num_tokens": lookup, "max_matching_ngram_size": max_ngram}
    tokens = []
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:8]], device=device), max_new_tokens=4, do_sample=False,
                       pad_token_id=0, **extra)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **extra)
            tokens.append(out[0, len(p):].tolist())
        _sync(device)
        dt = time.perf_counter() - t0
    del model
    return timing(sum(map(len, tokens)), dt), tokens


def run(args: argparse.Namespace) -> dict:
    from tierlm.bench.outputs import check_outputs, write_json
    outs = check_outputs({"--json": args.json, "--plot": args.plot})  # fails now, not after the run
    device = resolve_device(args.device)
    model_dir = bench_model(args)
    batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches must list batch sizes of at least 1, e.g. 1,8 (got {args.batches!r})")
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    kw = dict(kv_cache_memory=args.kv_cache_memory)
    results = []
    for kind in WORKLOADS:
        prompts = make_prompts(kind, args.prompts, vocab, args.prompt_len, seed=1)
        hf: dict[str, tuple] = {}
        if not args.no_hf:
            print(f"[spec] {kind}: transformers, {len(prompts)} prompts one at a time", flush=True)
            hf["plain"] = run_hf(model_dir, prompts, args.max_tokens, device, None, args.prompt_lookup_max)
            hf["lookup"] = run_hf(model_dir, prompts, args.max_tokens, device, args.num_speculative_tokens,
                                  args.prompt_lookup_max)
        for batch in batches:
            print(f"[spec] {kind}: tierlm, batch {batch}", flush=True)
            runs: dict[str, list] = {"plain": [], "spec": []}
            for _ in range(args.repeat):  # alternating, so a slow spell on a shared machine hits both alike
                runs["plain"].append(run_tierlm(model_dir, prompts, batch, args.max_tokens, device, None, **kw))
                runs["spec"].append(run_tierlm(model_dir, prompts, batch, args.max_tokens, device, spec, **kw))
            (plain, plain_toks), (fast, fast_toks) = (min(runs[w], key=lambda r: r[0]["seconds"])
                                                      for w in ("plain", "spec"))
            plain["runs_seconds"] = [r[0]["seconds"] for r in runs["plain"]]
            fast["runs_seconds"] = [r[0]["seconds"] for r in runs["spec"]]
            row = {
                "workload": kind, "batch": batch, "tierlm": plain, "tierlm_spec": fast,
                "speedup": fast["tok_per_s"] / plain["tok_per_s"],
                "acceptance_rate": fast["accepted_tokens"] / fast["draft_tokens"] if fast["draft_tokens"] else None,
                "steps_saved": 1 - fast["steps"] / plain["steps"],
                "identical_answers": sum(a == b for a, b in zip(fast_toks, plain_toks)),
            }
            if hf:
                row["hf"], row["hf_lookup"] = hf["plain"][0], hf["lookup"][0]
                row["hf_speedup"] = hf["lookup"][0]["tok_per_s"] / hf["plain"][0]["tok_per_s"]
                row["ratio_vs_hf_lookup"] = fast["tok_per_s"] / hf["lookup"][0]["tok_per_s"]
                row["identical_to_hf"] = sum(a == b for a, b in zip(fast_toks, hf["lookup"][1]))
            results.append(row)
            acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}"
            print(f"  tierlm {plain['tok_per_s']:7.1f} -> {fast['tok_per_s']:7.1f} tok/s with guesses "
                  f"({row['speedup']:.2f}x; {acc} accepted; {row['identical_answers']}/{len(prompts)} identical)"
                  + (f"; transformers {hf['plain'][0]['tok_per_s']:.1f} -> {hf['lookup'][0]['tok_per_s']:.1f} "
                     f"({row['hf_speedup']:.2f}x)" if hf else ""), flush=True)
    result = {"model": model_dir, "device": str(device), "dtype": "float32", "threads": torch.get_num_threads(),
              "repeat": args.repeat, "prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "speculative_config": spec, "results": results}
    write_json(outs["--json"], result)
    if outs["--plot"] is not None:
        from tierlm.bench.plots import grouped_bars
        groups = {f"{r['workload']}\nbatch {r['batch']}": {"tierlm": r["tierlm"]["tok_per_s"],
                                                           "tierlm + ngram": r["tierlm_spec"]["tok_per_s"],
                                                           **({"transformers": r["hf"]["tok_per_s"],
                                                               "transformers + lookup": r["hf_lookup"]["tok_per_s"]}
                                                              if "hf" in r and r["batch"] == 1 else {})}
                  for r in results}
        grouped_bars(outs["--plot"], groups, title="speculative decoding (n-gram lookup), greedy",
                     ylabel="output tokens / s")
    return result


def add_cli(sub) -> None:
    p = sub.add_parser("spec", help="speculative decoding by n-gram lookup: tierlm vs transformers' prompt lookup")
    p.add_argument("--model", default=None, help="a checkpoint dir (default: the 0.5B-shaped bench model)")
    p.add_argument("--bench-model-dir", default=str(DEFAULT_BENCH_MODEL_DIR))
    p.add_argument("--prompts", type=in_range(int, 1), default=8)
    p.add_argument("--prompt-len", type=in_range(int, 4), default=256)
    p.add_argument("--max-tokens", type=in_range(int, 1), default=128)
    p.add_argument("--batches", default="1,8", help="tierlm's batch sizes, comma-separated (default: 1,8)")
    p.add_argument("--num-speculative-tokens", type=in_range(int, 1, 64), default=4)
    p.add_argument("--prompt-lookup-max", type=in_range(int, 1, 64), default=4)
    p.add_argument("--prompt-lookup-min", type=in_range(int, 1, 64), default=2)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers runs")
    p.add_argument("--repeat", type=in_range(int, 1), default=1,
                   help="tierlm's runs per batch size, alternating with and without guesses; the best counts")
    p.add_argument("--kv-cache-memory", default=2 << 30)
    p.add_argument("--threads", type=in_range(int, 1), default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=lambda a: run(a) and 0)
