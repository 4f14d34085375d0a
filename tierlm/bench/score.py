"""`tierlm bench score` and `tierlm bench embed`: work on prompts alone, tierlm vs transformers,
same run, same weights. `score`: every prompt token's logprob (what an evaluation harness's
loglikelihood requests cost); `embed`: each prompt's embedding (the last token's final hidden
state, normalised, as `/v1/embeddings` gives it).

tierlm runs the prompts as one batch of requests (`prompt_logprobs=0`, or `LLM.embed`: chunked
prefill, continuous batching, no padding). transformers runs padded batches of `hf_batch`
prompts sorted by length, its best case (little padding), and takes the same values (log-softmax
at every position, or the base model's last hidden state). Reported: prompt tokens per second,
the ratio, and how far apart the two engines' numbers are (they must agree: a fast wrong score
is no score).
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from tierlm.bench.throughput import DEFAULT_BENCH_MODEL_DIR, _sync, bench_model, resolve_device
from tierlm.cli import in_range

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
TASKS = ("score", "embed")


@dataclass
class PromptWorkload:
    name: str
    prompts: list[list[int]]
    hf_batch: int

    def tokens(self, task: str) -> int:
        """What the task yields per prompt: a logprob at every token but the first (score), or
        one vector from every token (embed, counted by the tokens it reads)."""
        return sum(len(p) - (task == "score") for p in self.prompts)


def make_workload(name: str, vocab: int, seed: int = 0) -> PromptWorkload:
    rng = random.Random(seed)
    if name == "mixed":  # an evaluation set's spread of lengths
        lens, hf_batch = [rng.randint(32, 384) for _ in range(32)], 8
    elif name == "tiny":  # for tests and smoke runs
        lens, hf_batch = [rng.randint(8, 40) for _ in range(6)], 3
    else:
        raise ValueError(f"unknown workload '{name}'; use mixed or tiny")
    return PromptWorkload(name, [[rng.randrange(100, vocab) for _ in range(n)] for n in lens], hf_batch)


def run_tierlm(model_dir: str, wl: PromptWorkload, task: str, dtype: str, device: torch.device,
               **engine_kw) -> tuple[dict, list[list[float]]]:
    from tierlm import LLM, SamplingParams
    llm = LLM(model_dir, dtype=dtype, device=str(device), load_progress=False, **engine_kw)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)  # the one token rides on the last prefill step

    def once(prompts: list[list[int]]) -> list[list[float]]:
        given = [{"prompt_token_ids": p} for p in prompts]
        if task == "embed":
            return [o.outputs.embedding for o in llm.embed(given)]
        return [[lp.logprob for lp in o.prompt_logprobs[1:]] for o in llm.generate(given, params)]

    once([wl.prompts[0][:8]])  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    values = once(wl.prompts)
    _sync(device)
    dt = time.perf_counter() - t0
    del llm
    return _timing(wl.tokens(task), dt), values


def run_transformers(model_dir: str, wl: PromptWorkload, task: str, dtype: str,
                     device: torch.device) -> tuple[dict, list[list[float]]]:
    from transformers import AutoModel, AutoModelForCausalLM
    auto = AutoModel if task == "embed" else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype]).to(device).eval()
    order = sorted(range(len(wl.prompts)), key=lambda i: len(wl.prompts[i]))
    values: list[list[float]] = [[] for _ in wl.prompts]
    with torch.inference_mode():
        model(torch.tensor([wl.prompts[0][:8]], device=device))  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        for at in range(0, len(order), wl.hf_batch):
            rows = order[at:at + wl.hf_batch]
            batch = [wl.prompts[i] for i in rows]
            width = max(map(len, batch))
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(batch):  # right padding: positions start at 0 for every row
                ids[j, :len(p)] = torch.tensor(p)
                mask[j, :len(p)] = 1
            ids, mask = ids.to(device), mask.to(device)
            out = model(ids, attention_mask=mask)
            if task == "embed":
                last = torch.tensor([len(p) - 1 for p in batch], device=device)
                vecs = torch.nn.functional.normalize(out.last_hidden_state[torch.arange(len(batch)), last].float(),
                                                     dim=-1).cpu()
                for j, i in enumerate(rows):
                    values[i] = vecs[j].tolist()
            else:
                logprobs = torch.log_softmax(out.logits.float(), dim=-1)
                picked = logprobs[:, :-1].gather(2, ids[:, 1:, None])[..., 0].cpu()
                for j, i in enumerate(rows):
                    values[i] = picked[j, :len(wl.prompts[i]) - 1].tolist()
        _sync(device)
        dt = time.perf_counter() - t0
    del model
    return _timing(wl.tokens(task), dt), values


def _timing(tokens: int, seconds: float) -> dict:
    return {"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds}


def agreement(ours: list[list[float]], theirs: list[list[float]]) -> dict:
    """How far apart two engines' numbers are, value by value (logprobs, or vector entries)."""
    diffs = [abs(a - b) for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True)]
    return {"max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs), "values": len(diffs)}


def run(args: argparse.Namespace) -> dict:
    from tierlm.bench.outputs import check_outputs, write_json
    outs = check_outputs({"--json": args.json, "--plot": args.plot})  # fails now, not after the run
    task, unit = args.task, "scored" if args.task == "score" else "embedded"
    device = resolve_device(args.device)
    model_dir = bench_model(args)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"task": task, "model": model_dir, "dtype": args.dtype, "device": str(device),
              "threads": torch.get_num_threads(), "workloads": {}}
    for name in args.workload:
        wl = make_workload(name, vocab)
        print(f"[{task} {name}] {len(wl.prompts)} prompts, {wl.tokens(task)} tokens", flush=True)
        ours_runs, theirs_runs = [], []
        for _ in range(args.repeat):  # alternating, so a slow spell on a shared machine hits both alike
            ours_runs.append(run_tierlm(model_dir, wl, task, args.dtype, device, kv_cache_memory=args.kv_cache_memory,
                                        max_num_seqs=max(64, len(wl.prompts)),
                                        max_num_batched_tokens=args.max_num_batched_tokens))
            print(f"  tierlm:       {ours_runs[-1][0]['tok_per_s']:8.1f} {unit} tok/s "
                  f"({ours_runs[-1][0]['seconds']:.1f} s)", flush=True)
            theirs_runs.append(run_transformers(model_dir, wl, task, args.dtype, device))
            print(f"  transformers: {theirs_runs[-1][0]['tok_per_s']:8.1f} {unit} tok/s "
                  f"({theirs_runs[-1][0]['seconds']:.1f} s)", flush=True)
        ours = min((r[0] for r in ours_runs), key=lambda r: r["seconds"])
        theirs = min((r[0] for r in theirs_runs), key=lambda r: r["seconds"])
        agree = agreement(ours_runs[0][1], theirs_runs[0][1])
        ratio = ours["tok_per_s"] / theirs["tok_per_s"]
        print(f"  ratio tierlm/transformers: {ratio:.2f}x; values differ by at most {agree['max_abs_diff']:.2e}",
              flush=True)
        result["workloads"][name] = {
            "prompts": len(wl.prompts), "tierlm": {**ours, "runs_seconds": [r[0]["seconds"] for r in ours_runs]},
            "transformers": {**theirs, "runs_seconds": [r[0]["seconds"] for r in theirs_runs]},
            "ratio": ratio, "agreement": agree, "repeat": args.repeat}
    write_json(outs["--json"], result)
    if outs["--plot"] is not None:
        from tierlm.bench.plots import bar_plot
        values = {f"{n}\n{who}": w[who]["tok_per_s"]
                  for n, w in result["workloads"].items() for who in ("tierlm", "transformers")}
        title = "Prompt scoring" if task == "score" else "Embeddings"
        bar_plot(outs["--plot"], values, title=f"{title} throughput (same run, same weights)",
                 ylabel=f"prompt tokens {unit} / s")
    return result


def add_cli(sub) -> None:
    for task, what in (("score", "prompt scoring (every prompt token's logprob)"),
                       ("embed", "embeddings (last-token pooling)")):
        p = sub.add_parser(task, help=f"{what}: tierlm vs transformers in the same run")
        p.add_argument("--model", default=None, help="checkpoint dir (default: the 0.5B-shaped random-weight Llama)")
        p.add_argument("--bench-model-dir", default=str(DEFAULT_BENCH_MODEL_DIR))
        p.add_argument("--workload", action="append", choices=["mixed", "tiny"], default=None)
        p.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES),
                       help="weights and compute of both engines (float32: their numbers can be compared closely)")
        p.add_argument("--kv-cache-memory", default=2 << 30,
                       help="device KV pool: a size ('8GiB'), a count ('2000 blocks') or bytes")
        p.add_argument("--max-num-batched-tokens", type=int, default=None)
        p.add_argument("--repeat", type=in_range(int, 1), default=1,
                       help="run each engine N times, alternating; report the best run of each")
        p.add_argument("--threads", type=in_range(int, 1), default=None, help="torch threads for both engines")
        p.add_argument("--device", default="auto",
                       help="where both engines run: auto (CUDA if present) | cpu | cuda[:N]")
        p.add_argument("--json", required=True)
        p.add_argument("--plot", default=None)
        p.set_defaults(task=task, func=lambda a: (setattr(a, "workload", a.workload or ["mixed"]), run(a)) and 0)
