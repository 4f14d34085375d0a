"""`tierlm bench throughput`: offline output-token throughput, tierlm vs transformers, same run.

Both run the same requests on the same weights, dtype, device and thread count; the result is
the ratio. Also measures batch-1 decode speed against the memory-bandwidth bound
(model bytes / measured read bandwidth), the ceiling for single-stream decode.
"""
from __future__ import annotations

import argparse
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tierlm.cli import in_range
from tierlm.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_BENCH_MODEL_DIR = Path.home() / ".cache" / "tierlm" / "models" / "bench-llama-0.5b-v2"

BENCH_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-6,
                   tie_word_embeddings=True, rope_theta=1000000.0)


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    hf_batch: int

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(name: str, vocab: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    if name == "uniform":
        prompts = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(32)]
        return Workload(name, prompts, [128] * 32, hf_batch=32)
    if name == "mixed":
        lens = [rng.randint(32, 512) for _ in range(64)]
        outs = [rng.randint(16, 256) for _ in range(64)]
        return Workload(name, [[rng.randrange(100, vocab) for _ in range(L)] for L in lens], outs, hf_batch=16)
    if name == "tiny":  # for tests and smoke runs
        prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(8, 40))] for _ in range(6)]
        return Workload(name, prompts, [rng.randint(4, 12) for _ in range(6)], hf_batch=3)
    raise ValueError(f"unknown workload '{name}'; use uniform, mixed or tiny")


def bench_model(args) -> str:
    """`--model`, or the bench model (built on first use) from `--bench-model-dir`; refused by name
    before transformers reads a path without config.json as a hub repo id."""
    model_dir = args.model or str(ensure_bench_model(Path(args.bench_model_dir)))
    if not Path(model_dir, "config.json").is_file():
        raise ModelLoadError(f"{model_dir} is not a Hugging Face checkpoint directory (no config.json); "
                             "give --model a local checkpoint, or leave it out for the built-in bench model")
    return model_dir


def timing(tokens: int, seconds: float) -> dict:
    """A timed run's figures as the bench JSONs hold them."""
    return {"seconds": seconds, "output_tokens": tokens, "tok_per_s": tokens / seconds}


def ensure_bench_model(path: Path) -> Path:
    """The 0.5B-shaped random-weight Llama (bf16) used by the speed benchmarks."""
    if (path / "config.json").is_file():
        return path
    from transformers import LlamaConfig, LlamaForCausalLM
    from tierlm.models.demo import build_tokenizer
    log.info("building the 0.5B-shaped benchmark model in %s (random weights, once)", path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path, vocab_size=BENCH_SHAPE["vocab_size"])  # every id decodes to text
    assert len(tok) <= BENCH_SHAPE["vocab_size"], len(tok)
    torch.manual_seed(0)
    cfg = LlamaConfig(**BENCH_SHAPE, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(path))
    return path


@dataclass
class Sampling:
    """How both engines pick tokens: greedy (temperature 0, the default) or sampled, with the
    same temperature and nucleus on each side (transformers' default top-k of 50 switched off)."""

    temperature: float = 0.0
    top_p: float = 1.0

    def validate(self) -> None:
        if not (self.temperature >= 0 and self.temperature == self.temperature):  # NaN fails too
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")

    def tierlm(self, max_tokens: int):
        from tierlm import SamplingParams
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, ignore_eos=True)

    def transformers(self) -> dict:
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}


def run_tierlm(model_dir: str, wl: Workload, dtype: str, sampling: Sampling = Sampling(), **engine_kw) -> dict:
    """Engine kwargs may include compute_dtype (auto | the dtype itself)."""
    from tierlm import LLM, SamplingParams
    llm = LLM(model_dir, dtype=dtype, load_progress=False, **engine_kw)
    params = [sampling.tierlm(n) for n in wl.output_lens]
    llm.generate([{"prompt_token_ids": wl.prompts[0][:8]}], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params)
    dt = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == wl.output_tokens, (produced, wl.output_tokens)
    del llm
    return {"seconds": dt, "output_tokens": produced, "output_tok_per_s": produced / dt}


def resolve_device(name: str) -> torch.device:
    """The device as the engine resolves it (`auto`: CUDA when torch sees one), so both engines
    of the comparison run where tierlm would."""
    from tierlm.config import EngineConfig
    return EngineConfig(device=name).resolve_device()


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer read after it covers that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_transformers(model_dir: str, wl: Workload, torch_dtype: torch.dtype,
                     device: torch.device = torch.device("cpu"), sampling: Sampling = Sampling()) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    pad = 0
    produced = 0
    t0 = None
    with torch.inference_mode():
        model.generate(torch.tensor([wl.prompts[0][:8]], device=device), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad)
        _sync(device)
        t0 = time.perf_counter()
        for i in range(0, len(wl.prompts), wl.hf_batch):
            batch = wl.prompts[i:i + wl.hf_batch]
            n_out = max(wl.output_lens[i:i + wl.hf_batch])
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(batch):  # left padding
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n_out,
                           min_new_tokens=n_out, pad_token_id=pad, **sampling.transformers())
            # Only each request's own output length counts as useful output.
            produced += sum(wl.output_lens[i:i + wl.hf_batch])
        _sync(device)
    dt = time.perf_counter() - t0
    del model
    return {"seconds": dt, "output_tokens": produced, "output_tok_per_s": produced / dt}


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5, device: torch.device = torch.device("cpu")) -> float:
    """Measured memory read bandwidth in bytes/s (sum over a large buffer, best of reps)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # a float32 sum is bound by memory reads
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def batch1_decode(model_dir: str, dtype: str, n: int = 64, device: torch.device = torch.device("cpu"),
                  cuda_graphs: bool = False) -> dict:
    from tierlm import LLM, SamplingParams
    from transformers import AutoModelForCausalLM
    prompt = list(range(100, 116))
    llm = LLM(model_dir, dtype=dtype, load_progress=False, kv_cache_memory=256 << 20, device=str(device),
              cuda_graphs=cuda_graphs)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, ignore_eos=True))
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
    ours = n / (time.perf_counter() - t)
    # The bound counts the checkpoint's bytes in the served dtype (what a bf16 engine must read per
    # token); tierlm's CPU float32-compute path reads twice that, which the ratio shows.
    model_bytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    del llm
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype) if dtype != "auto" else "auto")
    hf = hf.to(device).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device)
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        _sync(device)
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        _sync(device)
        theirs = n / (time.perf_counter() - t)
    del hf
    bw = read_bandwidth(device=device)
    bound = bw / model_bytes
    return {"tierlm_tok_per_s": ours, "transformers_tok_per_s": theirs, "ratio": ours / theirs,
            "model_bytes": model_bytes, "read_bandwidth_gb_s": bw / 1e9, "bandwidth_bound_tok_per_s": bound,
            "tierlm_share_of_bound": ours / bound}


def run(args: argparse.Namespace) -> dict:
    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
    from tierlm.bench.outputs import check_outputs
    outs = check_outputs({"--json": args.json, "--plot": args.plot})  # fails now, not after the run
    args.json, args.plot = outs["--json"], outs["--plot"]
    sampling = Sampling(args.temperature, args.top_p)
    sampling.validate()
    device = resolve_device(args.device)  # before minutes of building the bench model
    model_dir = bench_model(args)
    dtype = args.dtype
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    result = {"model": model_dir, "dtype": dtype, "tierlm_compute_dtype": args.compute_dtype, "threads": threads,
              "cuda_graphs": args.cuda_graphs,
              "device": str(device), "sampling": asdict(sampling), "workloads": {}}
    for name in args.workload:
        wl = make_workload(name, vocab)
        print(f"[{name}] {len(wl.prompts)} requests, {wl.output_tokens} output tokens", flush=True)
        ours_runs, theirs_runs = [], []
        for rep in range(args.repeat):
            # Alternate the two engines, so a slow spell on a shared machine hits both alike.
            tag = f" (run {rep + 1}/{args.repeat})" if args.repeat > 1 else ""
            ours_runs.append(run_tierlm(model_dir, wl, dtype, sampling, compute_dtype=args.compute_dtype,
                                        max_num_seqs=max(64, len(wl.prompts)), kv_cache_memory=args.kv_cache_memory,
                                        max_num_batched_tokens=args.max_num_batched_tokens, device=str(device),
                                        cuda_graphs=args.cuda_graphs))
            print(f"  tierlm:       {ours_runs[-1]['output_tok_per_s']:8.1f} output tok/s "
                  f"({ours_runs[-1]['seconds']:.1f} s){tag}", flush=True)
            theirs_runs.append(run_transformers(model_dir, wl, torch_dtype, device, sampling))
            print(f"  transformers: {theirs_runs[-1]['output_tok_per_s']:8.1f} output tok/s "
                  f"({theirs_runs[-1]['seconds']:.1f} s){tag}", flush=True)
        ours = dict(min(ours_runs, key=lambda r: r["seconds"]), runs_seconds=[r["seconds"] for r in ours_runs])
        theirs = dict(min(theirs_runs, key=lambda r: r["seconds"]),
                      runs_seconds=[r["seconds"] for r in theirs_runs])
        ratio = ours["output_tok_per_s"] / theirs["output_tok_per_s"]
        print(f"  ratio tierlm/transformers{' (best run of each)' if args.repeat > 1 else ''}: {ratio:.2f}x", flush=True)
        result["workloads"][name] = {"tierlm": ours, "transformers": theirs, "ratio": ratio, "repeat": args.repeat}
    if args.batch1:
        b1 = batch1_decode(model_dir, dtype, device=device, cuda_graphs=args.cuda_graphs)
        print(f"[batch-1 decode] tierlm {b1['tierlm_tok_per_s']:.1f} tok/s, transformers {b1['transformers_tok_per_s']:.1f}"
              f" tok/s, bandwidth bound {b1['bandwidth_bound_tok_per_s']:.1f} tok/s "
              f"({b1['read_bandwidth_gb_s']:.1f} GB/s)", flush=True)
        result["batch1_decode"] = b1
    from tierlm.bench.outputs import write_json
    write_json(args.json, result)
    if args.plot is not None:
        from tierlm.bench.plots import bar_plot
        values = {f"{n}\n{who}": w[who]["output_tok_per_s"]
                  for n, w in result["workloads"].items() for who in ("tierlm", "transformers")}
        bar_plot(args.plot, values, title="Output-token throughput (same run, same weights)", ylabel="output tok/s")
    return result


def add_cli(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput: tierlm vs transformers in the same run")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the 0.5B-shaped random-weight Llama)")
    p.add_argument("--bench-model-dir", default=str(DEFAULT_BENCH_MODEL_DIR))
    p.add_argument("--workload", action="append", choices=["uniform", "mixed", "tiny"], default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--kv-cache-memory", default=2 << 30,
                   help="device KV pool: a size ('8GiB'), a count ('2000 blocks') or bytes")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--batch1", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--repeat", type=in_range(int, 1), default=1,
                   help="run each engine N times, alternating; report the best run of each (noisy machines)")
    p.add_argument("--threads", type=in_range(int, 1), default=None,
                   help="torch threads for both engines, at least 1 (default: torch's)")
    p.add_argument("--device", default="auto", help="where both engines run: auto (CUDA if present) | cpu | cuda[:N]")
    p.add_argument("--compute-dtype", default="auto", help="tierlm's compute dtype (auto | bfloat16 | float32 ...)")
    p.add_argument("--temperature", type=in_range(float, 0, 100), default=0.0,
                   help="both engines sample at this temperature (default 0: greedy)")
    p.add_argument("--top-p", type=in_range(float, 0, 1, low_open=True), default=1.0, help="and keep this nucleus when sampling")
    p.add_argument("--cuda-graphs", action="store_true", help="tierlm records small steps as CUDA graphs")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=lambda a: (setattr(a, "workload", a.workload or ["uniform"]), run(a)) and 0)
