"""`tierlm bench lora`: many adapters on one base model, tierlm vs transformers + peft, same run,
same weights.

The workload is what a multi-tenant server sees: prompts spread over K adapters (round robin),
all arriving together. tierlm runs them as one batch of requests, adapters mixed in every step
(`LLM.generate(lora_request=...)`). The peer is how transformers + peft serve several adapters:
one PeftModel holding all K, and per adapter `set_adapter` then one left-padded batched
`generate` of that adapter's prompts (peft runs one active adapter per forward). The same
prompts on tierlm's base model (no adapter) give what adapters cost tierlm. Reported: output
tokens per second of each, the ratios, and how many answers tierlm and peft agree on token
for token (greedy, float32: they must, bar exact ties).

Adapters are written here in PEFT's format (adapter_config.json + adapter_model.safetensors,
random A and B, rank `--rank` on q, k, v, o, gate, up and down), so the bench needs no training
and tierlm's loader reads exactly what peft's save_pretrained writes.
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

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, config: dict, rank: int, alpha: int, seed: int) -> Path:
    """A random rank-`rank` LoRA on every projection of a Llama-shaped model, as peft saves one."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    shapes = {"q_proj": (h, heads * d), "k_proj": (h, kv_heads * d), "v_proj": (h, kv_heads * d),
              "o_proj": (heads * d, h), "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(TARGETS), "bias": "none",
        "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "inference_mode": True}))
    return out


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_tierlm(model_dir: str, prompts: list[list[int]], adapters: list[Path | None], max_tokens: int,
               device: torch.device, **engine_kw) -> tuple[dict, list[list[int]]]:
    from tierlm import LLM, LoRARequest, SamplingParams
    llm = LLM(model_dir, dtype="float32", device=str(device), load_progress=False, enable_lora=True,
              max_loras=max(1, len({a for a in adapters if a is not None})), max_lora_rank=256, **engine_kw)
    loras = [LoRARequest(a.name, i + 1, str(a)) if a is not None else None for i, a in enumerate(adapters)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2, ignore_eos=True),
                 lora_request=[loras[0]])  # warm-up (and the first adapter's load)
    for lr in {lr for lr in loras if lr is not None}:
        llm.engine.add_lora(lr)  # loading is not serving: every adapter is in before the clock starts
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    _sync(device)
    dt = time.perf_counter() - t0
    del llm
    tokens = [o.outputs[0].token_ids for o in outs]
    return timing(sum(map(len, tokens)), dt), tokens


def run_peft(model_dir: str, prompts: list[list[int]], adapters: list[Path], max_tokens: int,
             device: torch.device, batch: int) -> tuple[dict, list[list[int]]]:
    try:
        from peft import PeftModel
    except ImportError:
        raise SystemExit("tierlm bench lora compares against transformers + peft: pip install peft") from None
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    names = sorted({a.name: a for a in adapters}.items())
    peft_model = PeftModel.from_pretrained(model, str(names[0][1]), adapter_name=names[0][0])
    for name, path in names[1:]:
        peft_model.load_adapter(str(path), adapter_name=name)
    peft_model.eval()
    by_adapter: dict[str, list[int]] = {}
    for i, a in enumerate(adapters):
        by_adapter.setdefault(a.name, []).append(i)
    tokens: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        peft_model.set_adapter(names[0][0])
        peft_model.generate(torch.tensor([prompts[0][:8]], device=device), max_new_tokens=2, do_sample=False,
                            pad_token_id=0)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        for name, rows in by_adapter.items():
            peft_model.set_adapter(name)
            for at in range(0, len(rows), batch):
                chunk = rows[at:at + batch]
                width = max(len(prompts[i]) for i in chunk)
                ids = torch.zeros((len(chunk), width), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for j, i in enumerate(chunk):  # left padding, as generation needs
                    ids[j, width - len(prompts[i]):] = torch.tensor(prompts[i])
                    mask[j, width - len(prompts[i]):] = 1
                out = peft_model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
                                          min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
                for j, i in enumerate(chunk):
                    tokens[i] = out[j, width:].tolist()
        _sync(device)
        dt = time.perf_counter() - t0
    del peft_model, model
    return timing(sum(map(len, tokens)), dt), tokens


def run(args: argparse.Namespace) -> dict:
    from tierlm.bench.outputs import check_outputs, write_json
    outs = check_outputs({"--json": args.json, "--plot": args.plot})  # fails now, not after the run
    device = resolve_device(args.device)
    model_dir = bench_model(args)
    if args.min_prompt > args.max_prompt:
        raise ValueError(f"--min-prompt {args.min_prompt} is above --max-prompt {args.max_prompt}")
    config = json.loads(Path(model_dir, "config.json").read_text())
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.adapter_dir)
    paths = [write_adapter(work / f"adapter-{k}", config, args.rank, 2 * args.rank, seed=k)
             for k in range(args.adapters)]
    prompts = make_prompts(args.prompts, config["vocab_size"], args.min_prompt, args.max_prompt)
    adapters = [paths[i % len(paths)] for i in range(len(prompts))]
    kw = dict(kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(64, len(prompts)))
    print(f"[lora] {len(prompts)} prompts over {len(paths)} adapters of rank {args.rank}, {args.max_tokens} tokens "
          "each", flush=True)
    runs: dict[str, list] = {"tierlm": [], "tierlm_base": [], "peft": []}
    for _ in range(args.repeat):  # alternating, so a slow spell on a shared machine hits all alike
        runs["tierlm"].append(run_tierlm(model_dir, prompts, adapters, args.max_tokens, device, **kw))
        runs["tierlm_base"].append(run_tierlm(model_dir, prompts, [None] * len(prompts), args.max_tokens, device,
                                              **kw))
        runs["peft"].append(run_peft(model_dir, prompts, adapters, args.max_tokens, device, args.hf_batch))
        for who in runs:
            print(f"  {who:12s} {runs[who][-1][0]['tok_per_s']:8.1f} output tok/s "
                  f"({runs[who][-1][0]['seconds']:.1f} s)", flush=True)
    best = {who: min((r[0] for r in rs), key=lambda r: r["seconds"]) for who, rs in runs.items()}
    same = sum(a == b for a, b in zip(runs["tierlm"][0][1], runs["peft"][0][1]))
    result = {
        "model": model_dir, "device": str(device), "dtype": "float32", "threads": torch.get_num_threads(),
        "prompts": len(prompts), "adapters": len(paths), "rank": args.rank, "max_tokens": args.max_tokens,
        "hf_batch": args.hf_batch, "repeat": args.repeat,
        **{who: {**b, "runs_seconds": [r[0]["seconds"] for r in runs[who]]} for who, b in best.items()},
        "ratio_vs_peft": best["tierlm"]["tok_per_s"] / best["peft"]["tok_per_s"],
        "adapter_cost": best["tierlm"]["tok_per_s"] / best["tierlm_base"]["tok_per_s"],
        "identical_answers": same,
        # answers the adapters changed (tierlm's with adapters vs its base model's): else the
        # agreement above would show nothing
        "changed_by_adapters": sum(a != b for a, b in zip(runs["tierlm"][0][1], runs["tierlm_base"][0][1])),
    }
    print(f"  tierlm/peft: {result['ratio_vs_peft']:.2f}x; with adapters / base model: {result['adapter_cost']:.2f}; "
          f"{same}/{len(prompts)} answers identical to peft's", flush=True)
    write_json(outs["--json"], result)
    if outs["--plot"] is not None:
        from tierlm.bench.plots import bar_plot
        bar_plot(outs["--plot"], {"tierlm\n(mixed adapters)": best["tierlm"]["tok_per_s"],
                                  "tierlm\n(base model)": best["tierlm_base"]["tok_per_s"],
                                  "transformers + peft\n(one adapter a batch)": best["peft"]["tok_per_s"]},
                 title=f"{len(prompts)} requests over {len(paths)} LoRA adapters",
                 ylabel="output tokens / s")
    return result


def add_cli(sub) -> None:
    p = sub.add_parser("lora", help="many LoRA adapters on one base model: tierlm vs transformers + peft")
    p.add_argument("--model", default=None, help="a Llama-shaped checkpoint dir (default: the 0.5B-shaped bench model)")
    p.add_argument("--bench-model-dir", default=str(DEFAULT_BENCH_MODEL_DIR))
    p.add_argument("--adapter-dir", default=str(DEFAULT_BENCH_MODEL_DIR.parent / "lora-adapters"),
                   help="where the bench writes its random adapters")
    p.add_argument("--adapters", type=in_range(int, 1), default=4)
    p.add_argument("--rank", type=in_range(int, 1, 256), default=16)
    p.add_argument("--prompts", type=in_range(int, 1), default=16)
    p.add_argument("--min-prompt", type=in_range(int, 1), default=32)
    p.add_argument("--max-prompt", type=in_range(int, 1), default=128)
    p.add_argument("--max-tokens", type=in_range(int, 1), default=32)
    p.add_argument("--hf-batch", type=in_range(int, 1), default=16, help="peft's batch size (per adapter)")
    p.add_argument("--kv-cache-memory", default=2 << 30)
    p.add_argument("--repeat", type=in_range(int, 1), default=1)
    p.add_argument("--threads", type=in_range(int, 1), default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=lambda a: run(a) and 0)
