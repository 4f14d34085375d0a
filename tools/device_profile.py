"""Where a GPU step's time goes: kernels launched and host vs device time per engine step.

    python3 tools/device_profile.py MODEL_DIR [--prefix-len 2000] [--batch 32] [--cuda-graphs]

Profiles three kinds of step on the 0.5B-shaped benchmark model: a batch of 32 decodes, one
2,048-token prefill (cold), and a 48-token prefill whose 2,000-token prefix is cached on the
device (the `bench prefix` device hit). For each it prints wall time, the summed kernel time
(so the share of the step the GPU sat idle waiting for the host), the kernels launched, and
the top operators by host time: the numbers a CUDA-graph or fusion change has to beat. First
it says which fused SDPA kernels accept the cold prefill's attention, and why the others not.
With --cuda-graphs the small steps replay recorded graphs (each shape is seen once, unprofiled,
before it is profiled, so recording is not counted).
"""
from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tierlm import LLM, SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profile_steps(llm: LLM, label: str, steps: int) -> None:
    eng = llm.engine
    _sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        _sync()
        wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / steps
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                         "cuLaunchKernelEx")) / steps
    print(f"\n## {label}: {wall * 1e3:.1f} ms per step, kernels {kernel_us / 1e3:.1f} ms "
          f"(GPU busy {kernel_us / 1e6 / wall:.0%}), {launches:.0f} launches per step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))


def _sdpa_backends(llm: LLM, tokens: int) -> None:
    """Which fused SDPA kernels accept a cold prefill's attention as the engine calls it
    (causal, GQA folded with enable_gqa, the model's compute dtype), and why not: on the H200
    the cold prefill ran SDPA's unfused math path (bmm + softmax), 29 of its 35 ms of kernels."""
    a = llm.engine.runner.args
    shape = (a.num_heads, a.num_kv_heads, a.head_dim)  # read on any device: the CPU test runs this far
    if not torch.cuda.is_available():
        return
    import warnings
    from torch.backends import cuda as bc

    dtype = next(p.dtype for p in llm.engine.runner.model.parameters() if p.is_floating_point())
    q = torch.empty(1, a.num_heads, tokens, a.head_dim, dtype=dtype, device="cuda")
    kv = torch.empty(1, a.num_kv_heads, tokens, a.head_dim, dtype=dtype, device="cuda")
    print(f"\n## SDPA backends for a cold {tokens}-token prefill ({dtype}, {a.num_heads}/"
          f"{a.num_kv_heads} heads, head_dim {a.head_dim}, causal, enable_gqa)")
    for name in ("can_use_flash_attention", "can_use_efficient_attention", "can_use_cudnn_attention"):
        check = getattr(bc, name, None)
        if check is None:
            continue
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                ok = check(bc.SDPAParams(q, kv, kv, None, 0.0, True, True), True)
            except Exception as e:  # the signature moves between torch versions
                ok = f"not asked ({e})"
        reasons = "; ".join(str(w.message).splitlines()[0] for w in said)
        print(f"{name}: {ok}{' - ' + reasons if reasons else ''}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cuda-graphs", action="store_true")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    llm = LLM(args.model, dtype="bfloat16", load_progress=False, cuda_graphs=args.cuda_graphs)
    eng = llm.engine
    vocab = eng.runner.args.vocab_size
    ids = lambda n: [rng.randrange(min(100, vocab // 2), vocab) for _ in range(n)]  # noqa: E731
    _sdpa_backends(llm, args.prefix_len + 48)

    for _ in range(args.batch):
        eng.add_request({"prompt_token_ids": ids(128)}, SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(4):  # prefill and the first decodes, unprofiled
        eng.step()
    _profile_steps(llm, f"decode, batch {args.batch}", 10)
    while eng.has_unfinished():
        eng.step()

    prefix = ids(args.prefix_len)
    eng.add_request({"prompt_token_ids": prefix + ids(48)}, SamplingParams(max_tokens=1, ignore_eos=True))
    _profile_steps(llm, f"prefill, {args.prefix_len + 48:,} tokens cold", 1)
    while eng.has_unfinished():
        eng.step()
    eng.add_request({"prompt_token_ids": prefix + ids(48)}, SamplingParams(max_tokens=1, ignore_eos=True))
    while eng.has_unfinished():  # the hit's shape once unprofiled: a graph, if any, is recorded
        eng.step()
    eng.add_request({"prompt_token_ids": prefix + ids(48)}, SamplingParams(max_tokens=1, ignore_eos=True))
    _profile_steps(llm, f"prefill, 48 tokens after a {args.prefix_len:,}-token device hit", 1)
    while eng.has_unfinished():
        eng.step()


if __name__ == "__main__":
    main()
