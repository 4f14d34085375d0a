"""`tierlm bench sla`: the SLA guard under overload, piece by piece, against the same engine without it.

Requests of two tiers (gold: priority 0 and a tight time-to-first-token target; bronze:
priority 2 and a looser one) arrive as a Poisson stream at `--overload` times what the engine
was just measured to sustain, for `--duration` seconds. The same arrivals are replayed on one
in-process engine, each run with a fresh serving/sla.py `SlaGuard` (the object the server uses):

- `no_guard`: nothing refused, everything queues;
- `guard`: the engine's estimate alone refuses what it says would miss its tier's target;
- `guard_breaker`: the estimate and the per-tier circuit breaker (breaker.py, default settings),
  which refuses a tier for a while once its measured outcomes keep missing the target;
- `guard_breaker_fallback` (with a fallback model, by default the built-in small demo one when
  `--model` is not given): as above, and a request refused on the big model goes through
  `with_fallback` to a second, smaller engine instead, which its own guard may refuse too.

Reported per run and tier: requests served (and by the fallback), shed, the share of served
requests that met their target (wall-clock time to first token, as a client sees it), and
goodput (requests that met their target per second of the run), with the goodput ratios of each
run to no_guard and of each run to the one before it. Each run starts from the estimate's state
after the calibration (its step-time fit; no arrival rates, no learnt factor), so no run inherits
what the one before it taught the estimate, and each run has a cache salt of its own, so no
prompt hits the prefix cache a run before it filled.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import random
import statistics
import time
import uuid
from collections import Counter
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field

from tierlm.cli import at_least, in_range

MODEL = "bench"
FALLBACK = "bench-small"


@dataclass(frozen=True)
class TierSpec:
    name: str
    priority: int
    target_s: float
    share: float  # of the arrivals


@dataclass(frozen=True)
class RunSpec:
    name: str
    label: str  # in the printout and the plot
    targets: bool  # the tiers' targets are given to the guard (else it never refuses)
    breaker: bool
    fallback: bool


RUNS = (RunSpec("no_guard", "no guard", False, False, False),
        RunSpec("guard", "estimate", True, False, False),
        RunSpec("guard_breaker", "estimate+breaker", True, True, False),
        RunSpec("guard_breaker_fallback", "estimate+breaker+fallback", True, True, True))


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


@dataclass
class _Refusals:
    """`with_fallback`'s observer: what the guard refused, and what the fallback took, by (tier, reason)."""

    shed: Counter = field(default_factory=Counter)
    fallback: Counter = field(default_factory=Counter)

    def on_shed(self, model: str, tier: str, reason: str) -> None:
        self.shed[tier, reason] += 1

    def on_fallback(self, model: str, fallback: str, tier: str, reason: str) -> None:
        self.fallback[tier, reason] += 1


async def _replay(engines: dict, arrivals: list[tuple[float, TierSpec, list[int]]], params, spec: RunSpec,
                  guard, refusals: _Refusals) -> list[dict]:
    """Each arrival at its time, through `guard` (and to the fallback engine where it has one),
    as the server does: the breaker and the estimate learn how each admitted request did."""
    from tierlm.serving.auth import RequestContext
    from tierlm.serving.sla import SlaShed, with_fallback
    loop = asyncio.get_running_loop()
    begin = loop.time()

    async def one(at: float, tier: TierSpec, prompt: list[int]) -> dict:
        await asyncio.sleep(max(0.0, begin + at - loop.time()))
        arrived = time.monotonic()
        ctx = RequestContext(request_id=uuid.uuid4().hex, tier=tier.name, priority=tier.priority,
                             ttft_target_s=tier.target_s if spec.targets else None)

        async def start(name: str) -> float:
            """Serve the request on `name`'s engine (SlaShed if its guard refuses it): wall-clock TTFT."""
            engine = engines[name]
            admission = guard.admit(engine, name, ctx, len(prompt))
            # Each run its own cache salt: the runs replay the same prompts, and a prompt an earlier
            # run left in the prefix cache would start sooner in a later one.
            stream = aiter(engine.generate(prompt, params, ctx.request_id, priority=tier.priority,
                                           cache_salt=f"bench-sla-{spec.name}"))
            if admission is not None:
                admission.start()
            first = None
            try:
                async for delta in stream:
                    if first is None and delta.token_ids:
                        first = time.monotonic()
                        if admission is not None:  # as the server does: the breaker and estimate learn
                            admission.first_token(delta.first_token_time - delta.arrival_time)
            except BaseException as exc:
                if admission is not None:
                    admission.failed(exc)
                raise
            return first - arrived

        try:
            served, ttft = await with_fallback(guard, refusals, MODEL, start)
        except SlaShed:
            return {"tier": tier.name, "shed": True}
        return {"tier": tier.name, "shed": False, "model": served, "ttft_s": ttft, "met": ttft <= tier.target_s}

    return list(await asyncio.gather(*(one(*a) for a in arrivals)))


def _summary(records: list[dict], tiers: list[TierSpec], duration: float, refusals: _Refusals) -> dict:
    out = {}
    for tier in tiers:
        mine = [r for r in records if r["tier"] == tier.name]
        served = [r for r in mine if not r["shed"]]
        met = sum(r["met"] for r in served)
        out[tier.name] = {
            "arrived": len(mine), "served": len(served), "shed": len(mine) - len(served),
            "shed_by_breaker": refusals.shed[tier.name, "breaker"],
            "served_by_fallback": sum(r["model"] == FALLBACK for r in served), "met_target": met,
            "attainment": met / len(served) if served else None,
            "goodput_rps": met / duration,
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in served) if served else None,
            "ttft_p99_s": sorted(r["ttft_s"] for r in served)[max(0, int(0.99 * len(served)) - 1)] if served else None,
        }
    return out


def _ratios(results: dict, tiers: list[TierSpec]) -> dict:
    """Goodput per tier: each run over no_guard, and each guard piece over the run without it."""
    pairs = [(run, "no_guard") for run in results if run != "no_guard"]
    pairs += [(run, before) for run, before in (("guard_breaker", "guard"),
                                                 ("guard_breaker_fallback", "guard_breaker")) if run in results]
    ratios = {}
    for run, base in pairs:
        for tier in tiers:
            num, den = results[run][tier.name]["goodput_rps"], results[base][tier.name]["goodput_rps"]
            ratios[f"{tier.name}_goodput_{run}_over_{base}"] = num / den if den else None
    return ratios


async def _open_engine(stack: AsyncExitStack, path: str, name: str, args: argparse.Namespace):
    from tierlm import AsyncEngine
    engine = AsyncEngine.from_model(path, dtype=args.dtype, load_progress=False, max_num_seqs=args.max_num_seqs,
                                    served_model_name=name)
    await engine.start()
    stack.push_async_callback(engine.shutdown)
    return engine


def _estimator_state(engine) -> tuple:
    """What the engine's TTFT estimate has learnt that a run changes (engine/load.py)."""
    e = engine.engine
    return copy.deepcopy((e.step_time, e.output_lengths))


def _restore_estimator(engine, state: tuple) -> None:
    """Every run starts from the state the calibration left: the step-time fit and output lengths
    as they were then, no arrival rates and no learnt calibration. Else each run would inherit
    what the one before it learnt (the better tiers' rates, a slowdown's step times) and their
    order would show in their results."""
    from tierlm.engine.load import ArrivalRates, TtftCalibration
    e = engine.engine
    e.step_time, e.output_lengths = copy.deepcopy(state)
    e.arrivals, e.ttft_calibration = ArrivalRates(), TtftCalibration()


@contextmanager
def _slowed(engine, factor: float, from_time: float):
    """From `from_time` (time.monotonic) on, each of `engine`'s model steps takes `factor` times
    as long (it sleeps the difference after computing): a machine that slows down mid-run (a
    noisy neighbour, a throttled device), which the estimate learns only as its step-time fit
    forgets (half-life 200 steps) and the breaker sees in its outcomes."""
    runner = engine.engine.runner
    execute = runner.execute

    def slowed(*args, **kwargs):
        t0 = time.monotonic()
        out = execute(*args, **kwargs)
        if factor > 1 and t0 >= from_time:
            time.sleep((factor - 1) * (time.monotonic() - t0))
        return out

    runner.execute = slowed
    try:
        yield
    finally:
        del runner.execute  # the class's method again


def _fallback_path(args: argparse.Namespace) -> str | None:
    """--fallback-model; by default the small demo checkpoint beside the default demo model."""
    if args.no_fallback:
        return None
    if args.fallback_model is not None:
        return args.fallback_model
    if args.model is None:
        from tierlm.models.demo import ensure_demo_model
        return str(ensure_demo_model("small"))
    return None


async def _bench(args: argparse.Namespace) -> dict:
    from tierlm import SamplingParams
    from tierlm.serving.breaker import BreakerSettings
    from tierlm.serving.sla import SlaGuard
    model = args.model
    if model is None:
        from tierlm.models.demo import ensure_demo_model
        model = str(ensure_demo_model())
    fallback = _fallback_path(args)
    specs = [s for s in RUNS if fallback is not None or not s.fallback]
    async with AsyncExitStack() as stack:
        engines = {MODEL: await _open_engine(stack, model, MODEL, args)}
        if fallback is not None:
            engines[FALLBACK] = await _open_engine(stack, fallback, FALLBACK, args)
        vocab = min(e.engine.args.vocab_size for e in engines.values())  # prompts either engine takes
        rng = random.Random(args.seed)

        def prompt() -> list[int]:  # distinct prompts: no prefix hits
            return [rng.randrange(min(5, vocab - 1), vocab) for _ in range(args.prompt_len)]

        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        warm = prompt()
        for engine in engines.values():  # warm-up: first steps are slow
            await _capacity(engine, warm, params, args.calibration_requests)
        capacity = await _capacity(engines[MODEL], prompt(), params, args.calibration_requests)
        learnt = {name: _estimator_state(engine) for name, engine in engines.items()}
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
              f"({args.overload:g}x) over {args.duration:g} s, in {len(specs)} runs: "
              + ", ".join(s.label for s in specs)
              + (f"; the model's steps {args.slowdown:g}x as slow from {args.slowdown_at * args.duration:g} s on"
                 if args.slowdown > 1 else ""))
        results, trips = {}, {}
        for spec in specs:
            guard = SlaGuard(fallbacks={MODEL: FALLBACK} if spec.fallback else {},
                             breaker=BreakerSettings() if spec.breaker else None)
            refusals = _Refusals()
            for name, engine in engines.items():
                _restore_estimator(engine, learnt[name])
            with _slowed(engines[MODEL], args.slowdown, time.monotonic() + args.slowdown_at * args.duration):
                records = await _replay(engines, arrivals, params, spec, guard, refusals)
            results[spec.name] = _summary(records, tiers, args.duration, refusals)
            trips[spec.name] = guard.trips
            for name, s in results[spec.name].items():
                att = "-" if s["attainment"] is None else f"{s['attainment']:.0%}"
                by_fallback = (f" ({s['served_by_fallback'] / s['served'] if s['served'] else 0:.0%} by the fallback)"
                               if spec.fallback else "")
                print(f"{spec.label:>25} {name:>6}: served {s['served']}{by_fallback}, shed {s['shed']}, "
                      f"{att} within target, goodput {s['goodput_rps']:.2f}/s, TTFT p50 "
                      f"{(s['ttft_p50_s'] or 0) * 1e3:.0f} ms")
            if spec.breaker:
                print(f"{spec.label:>25}: breakers opened {trips[spec.name]} times")
    return {"model": model, "fallback_model": fallback, "capacity_rps": capacity, "rate_rps": rate,
            "overload": args.overload, "duration_s": args.duration, "slowdown": args.slowdown,
            "slowdown_at_s": args.slowdown_at * args.duration if args.slowdown > 1 else None, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "tiers": [t.__dict__ for t in tiers], "runs": [s.name for s in specs],
            "results": results, "breaker_trips": trips, "ratios": _ratios(results, tiers)}


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
    """Goodput bars grouped by tier, one per run in run order."""
    from tierlm.bench.plots import bar_plot
    labels = {s.name: s.label for s in RUNS}
    tiers = [t["name"] for t in result["tiers"]]
    bars = {f"{tier}: {labels[run]}": result["results"][run][tier]["goodput_rps"]
            for tier in tiers for run in result["runs"]}
    slow = f", steps {result['slowdown']:g}x slower from {result['slowdown_at_s']:g} s" if result.get("slowdown_at_s") else ""
    return bar_plot(path, bars, title=f"Goodput at {result['overload']:g}x capacity{slow}",
                    ylabel="requests/s within their TTFT target")


def add_cli(sub) -> None:
    p = sub.add_parser("sla", help="the SLA guard under overload: goodput per tier without it, with its "
                                   "estimate, its breaker and a fallback model")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    fb = p.add_mutually_exclusive_group()
    fb.add_argument("--fallback-model", default=None, metavar="DIR",
                    help="checkpoint directory of the model that serves what the guard refuses, in a last run "
                         "(default: the built-in small demo model when --model is not given, else no such run)")
    fb.add_argument("--no-fallback", action="store_true", help="skip the fallback run")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--overload", type=in_range(float, 0, low_open=True), default=2.0, help="arrival rate as a multiple of measured capacity")
    p.add_argument("--duration", type=in_range(float, 0, low_open=True), default=10.0, help="seconds of arrivals per run")
    p.add_argument("--slowdown", type=at_least(1, float), default=1.0,
                   help="from --slowdown-at on, the model's steps take this many times as long (1: never)")
    p.add_argument("--slowdown-at", type=in_range(float, 0, 1), default=0.5,
                   help="when the slowdown starts, as a fraction of --duration")
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
