"""`tierlm bench sla`: the SLA guard under overload, against the same engine without it.

Requests of two tiers (gold: priority 0 and a tight time-to-first-token target; bronze:
priority 2 and a looser one) arrive as a Poisson stream at `--overload` times what the engine
was just measured to sustain, for `--duration` seconds. The same arrivals run twice on one
in-process engine: without the guard (everything queues) and with it (serving/sla.py's
`check_ttft_target`, the function the server calls, refusing what its estimate says would miss
its target). Reported per tier: requests served, shed, the share of served requests that met
their target, and goodput (requests that met their target per second of the run), with the
ratios guard / no guard.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from dataclasses import dataclass

from tierlm.cli import at_least, in_range

MODEL = "bench"


@dataclass(frozen=True)
class TierSpec:
    name: str
    priority: int
    target_s: float
    share: float  # of the arrivals


def _tiers(args: argparse.Namespace) -> list[TierSpec]:
    return [TierSpec("gold", 0, args.gold_target_ms / 1000, args.gold_share),
            TierSpec("bronze", 2, args.bronze_target_ms / 1000, 1 - args.gold_share)]


async def _capacity(engine, prompt: list[int], params, n: int) -> float:
    """Requests per second the engine sustains on this request shape (all n at once)."""
    async def one(i: int) -> None:
        async for _ in engine.generate(prompt, params, f"cal-{i}-{uuid.uuid4().hex}"):
            pass
    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.monotonic() - t0)


async def _replay(engine, arrivals: list[tuple[float, TierSpec, list[int]]], params, guard: bool) -> list[dict]:
    from tierlm.serving.auth import RequestContext
    from tierlm.serving.sla import SlaShed, check_ttft_target
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(at: float, tier: TierSpec, prompt: list[int]) -> dict:
        await asyncio.sleep(max(0.0, start + at - loop.time()))
        arrived = time.monotonic()
        ctx = RequestContext(request_id=uuid.uuid4().hex, tier=tier.name, priority=tier.priority,
                             ttft_target_s=tier.target_s if guard else None)
        try:
            estimate = check_ttft_target(engine, MODEL, ctx, len(prompt))
        except SlaShed:
            return {"tier": tier.name, "shed": True}
        first = None
        async for delta in engine.generate(prompt, params, ctx.request_id, priority=tier.priority):
            if first is None and delta.token_ids:
                first = time.monotonic()
                if estimate is not None:  # as the server does: the estimate learns how it did
                    engine.engine.observe_ttft(tier.priority, estimate, delta.first_token_time - delta.arrival_time)
        ttft = first - arrived
        return {"tier": tier.name, "shed": False, "ttft_s": ttft, "met": ttft <= tier.target_s}

    return list(await asyncio.gather(*(one(*a) for a in arrivals)))


def _summary(records: list[dict], tiers: list[TierSpec], duration: float) -> dict:
    out = {}
    for tier in tiers:
        mine = [r for r in records if r["tier"] == tier.name]
        served = [r for r in mine if not r["shed"]]
        met = sum(r["met"] for r in served)
        out[tier.name] = {
            "arrived": len(mine), "served": len(served), "shed": len(mine) - len(served), "met_target": met,
            "attainment": met / len(served) if served else None,
            "goodput_rps": met / duration,
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in served) if served else None,
            "ttft_p99_s": sorted(r["ttft_s"] for r in served)[max(0, int(0.99 * len(served)) - 1)] if served else None,
        }
    return out


async def _bench(args: argparse.Namespace) -> dict:
    from tierlm import AsyncEngine, SamplingParams
    model = args.model
    if model is None:
        from tierlm.models.demo import ensure_demo_model
        model = str(ensure_demo_model())
    engine = AsyncEngine.from_model(model, dtype=args.dtype, load_progress=False, max_num_seqs=args.max_num_seqs,
                                    served_model_name=MODEL)
    await engine.start()
    try:
        vocab = engine.engine.args.vocab_size
        rng = random.Random(args.seed)

        def prompt() -> list[int]:  # distinct prompts: no prefix hits
            return [rng.randrange(min(5, vocab - 1), vocab) for _ in range(args.prompt_len)]

        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        await _capacity(engine, prompt(), params, args.calibration_requests)  # warm-up: first steps are slow
        capacity = await _capacity(engine, prompt(), params, args.calibration_requests)
        rate = args.overload * capacity
        tiers = _tiers(args)
        arrivals, t = [], 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= args.duration:
                break
            tier = tiers[0] if rng.random() < tiers[0].share else tiers[1]
            arrivals.append((t, tier, prompt()))
        print(f"capacity {capacity:.2f} requests/s; replaying {len(arrivals)} arrivals at {rate:.2f}/s "
              f"({args.overload:g}x) over {args.duration:g} s, without and with the guard")
        runs = {}
        for guard in (False, True):
            records = await _replay(engine, arrivals, params, guard)
            runs["guard" if guard else "no_guard"] = _summary(records, tiers, args.duration)
            for name, s in runs["guard" if guard else "no_guard"].items():
                att = "-" if s["attainment"] is None else f"{s['attainment']:.0%}"
                print(f"{'guard' if guard else 'no guard':>8} {name:>6}: served {s['served']}, shed {s['shed']}, "
                      f"{att} within target, goodput {s['goodput_rps']:.2f}/s, TTFT p50 "
                      f"{(s['ttft_p50_s'] or 0) * 1e3:.0f} ms")
    finally:
        await engine.shutdown()
    ratios = {}
    for tier in tiers:
        off, on = runs["no_guard"][tier.name], runs["guard"][tier.name]
        ratios[f"{tier.name}_goodput_guard_over_no_guard"] = (on["goodput_rps"] / off["goodput_rps"]
                                                             if off["goodput_rps"] else None)
    return {"model": model, "capacity_rps": capacity, "rate_rps": rate, "overload": args.overload,
            "duration_s": args.duration, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "tiers": [t.__dict__ for t in tiers], "results": runs, "ratios": ratios}


def run(args: argparse.Namespace) -> dict:
    from tierlm.bench.outputs import check_outputs, write_json
    outs = check_outputs({"--json": args.json, "--plot": args.plot})
    args.json, args.plot = outs["--json"], outs["--plot"]
    result = asyncio.run(_bench(args))
    for k, v in result["ratios"].items():
        print(f"{k}: {'-' if v is None else f'{v:.2f}x'}")
    write_json(args.json, result)
    if args.plot is not None:
        plot_sla(result, args.plot)
    return result


def plot_sla(result: dict, path: str) -> str:
    from tierlm.bench.plots import bar_plot
    bars = {f"{'guard' if run == 'guard' else 'no guard'}: {tier}": s["goodput_rps"]
            for run, tiers in result["results"].items() for tier, s in tiers.items()}
    return bar_plot(path, bars, title=f"Goodput at {result['overload']:g}x capacity",
                    ylabel="requests/s within their TTFT target")


def add_cli(sub) -> None:
    p = sub.add_parser("sla", help="the SLA guard under overload: goodput per tier with and without it")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--overload", type=in_range(float, 0, low_open=True), default=2.0, help="arrival rate as a multiple of measured capacity")
    p.add_argument("--duration", type=in_range(float, 0, low_open=True), default=10.0, help="seconds of arrivals per run")
    p.add_argument("--gold-share", type=in_range(float, 0, 1), default=0.3, help="share of arrivals in the gold tier")
    p.add_argument("--gold-target-ms", type=at_least(1, int), default=1000)
    p.add_argument("--bronze-target-ms", type=at_least(1, int), default=3000)
    p.add_argument("--prompt-len", type=at_least(1, int), default=256)
    p.add_argument("--max-tokens", type=at_least(1, int), default=32)
    p.add_argument("--max-num-seqs", type=at_least(1, int), default=16)
    p.add_argument("--calibration-requests", type=at_least(1, int), default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=lambda a: run(a) and 0)
