"""`tierlm bench fairness`: what one flooding tenant costs the other tenants of its tier.

One tenant ("flood") queues many requests at once; a few light tenants queue a couple each right
behind them, all at one priority. The same burst runs on the same model twice in one process:
first come first served (the peer: vLLM's and TGI's order within a priority) and tierlm's fair
shares (engine/fairness.py). Reported per policy: each tenant's time to first token, the
throughput, and the largest gap in service (prompt tokens x1, generated x2) between the flood
and a light tenant while both had requests waiting; then the ratios fcfs / fair (medians over
`--repeats` alternated runs).

Second part, KV quotas (engine/quotas.py): a "hog" tenant's long requests fill a small KV pool;
light tenants arrive once it is full. The peer is the same run without a quota; with the hog's
`kv_share` set, the light tenants find room at once. Reported: the light tenants' time to first
token (from their arrival) and the hog's throughput, both ways.

Third part, cache partitions (kv/block_pool.py): a "gold" tenant cycles through a few long
prompt prefixes, one request per round, while a "flood" tenant sends several new prompts per
round, enough to turn the device pool over between two uses of a gold prefix. The peer is the
same run without a partition, under each eviction policy given (LRU, as vLLM evicts, and
tierlm's default); with gold's `kv_cache_share` set, its prefixes stay on the device. Reported:
gold's share of prompt tokens served from the cache, its time to first token, and the flood's
(whose cache the partition shrinks), both ways.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from tierlm.cli import at_least, in_range
from tierlm.kv.policies import DEFAULT_POLICY


def _burst(args: argparse.Namespace, vocab: int) -> list[tuple[str, list[int]]]:
    """(tenant, prompt) in arrival order: the flood's first, then each light tenant's."""
    rng = random.Random(args.seed)

    def prompt() -> list[int]:  # distinct prompts: no prefix hits, the schedule is the subject
        return [rng.randrange(min(5, vocab - 1), vocab) for _ in range(args.prompt_len)]

    burst = [("flood", prompt()) for _ in range(args.flood)]
    for t in range(args.light_tenants):
        burst += [(f"light{t}", prompt()) for _ in range(args.light_requests)]
    return burst


def _served(reqs) -> dict[str, float]:
    from tierlm.engine.fairness import DECODE_COST, PROMPT_COST
    out: dict[str, float] = {}
    for r in reqs:
        out[r.tenant_id] = out.get(r.tenant_id, 0.0) + PROMPT_COST * min(r.num_computed_tokens, r.num_prompt_tokens) \
            + DECODE_COST * r.num_output_tokens
    return out


def _run_policy(model: str, policy: str, args: argparse.Namespace) -> dict:
    from tierlm import LLM, SamplingParams
    with LLM(model, dtype=args.dtype, load_progress=False, max_num_seqs=args.max_num_seqs,
             max_num_batched_tokens=args.max_num_batched_tokens, scheduling_policy=policy) as llm:
        eng = llm.engine
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        t0 = time.monotonic()
        reqs = [eng.add_request({"prompt_token_ids": p}, params, tenant_id=tenant) for tenant, p in _burst(args, eng.args.vocab_size)]
        gap, step, first_step = 0.0, 0, {}
        while eng.has_unfinished():
            eng.step()
            step += 1
            for r in reqs:
                if r not in first_step and r.first_token_time is not None:
                    first_step[r] = step
            waiting = {r.tenant_id for r in eng.scheduler.waiting}
            if "flood" in waiting and len(waiting) > 1:
                served = _served(reqs)
                gap = max(gap, max(abs(served["flood"] - served.get(t, 0.0)) for t in waiting if t != "flood"))
        wall = time.monotonic() - t0
    ttft: dict[str, list[float]] = {}
    ttft_steps: dict[str, list[int]] = {}
    for r in reqs:
        who = "flood" if r.tenant_id == "flood" else "light"
        ttft.setdefault(who, []).append(r.first_token_time - r.arrival_time)
        ttft_steps.setdefault(who, []).append(first_step[r])
    tokens = sum(r.num_output_tokens for r in reqs)
    row = {"policy": policy, "wall_s": wall, "steps": step, "output_tokens_per_s": tokens / wall,
           "max_service_gap": gap}
    for who, xs in ttft.items():
        row[f"{who}_ttft_mean_s"] = statistics.fmean(xs)
        row[f"{who}_ttft_max_s"] = max(xs)
        # In engine steps: the same on any machine (the schedule is deterministic), unlike seconds.
        row[f"{who}_ttft_mean_steps"] = statistics.fmean(ttft_steps[who])
    print(f"{policy:>4}: light tenants' TTFT mean {row['light_ttft_mean_s'] * 1e3:.0f} ms (max "
          f"{row['light_ttft_max_s'] * 1e3:.0f}; {row['light_ttft_mean_steps']:.1f} steps), flood's mean {row['flood_ttft_mean_s'] * 1e3:.0f} ms, "
          f"{row['output_tokens_per_s']:.0f} output tok/s, largest service gap {gap:.0f}")
    return row


def _run_kv(model: str, share: float | None, args: argparse.Namespace) -> dict:
    from tierlm import LLM, SamplingParams
    with LLM(model, dtype=args.dtype, load_progress=False, max_num_seqs=args.max_num_seqs,
             max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=f"{args.kv_blocks} blocks") as llm:
        eng = llm.engine
        vocab, rng = eng.args.vocab_size, random.Random(args.seed)

        def add(tenant: str, prompt_len: int, max_tokens: int, kv_share: float | None):
            prompt = [rng.randrange(min(5, vocab - 1), vocab) for _ in range(prompt_len)]
            return eng.add_request({"prompt_token_ids": prompt},
                                   SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                   tenant_id=tenant, kv_share=kv_share)

        t0 = time.monotonic()
        hog = [add("hog", args.hog_prompt_len, args.hog_max_tokens, share) for _ in range(args.hog)]
        light, first_step, step, peak = [], {}, 0, 0
        while eng.has_unfinished():
            if step == args.light_arrival_step:
                light = [add(f"light{t}", args.prompt_len, args.max_tokens, None)
                         for t in range(args.light_tenants) for _ in range(args.light_requests)]
            eng.step()
            step += 1
            peak = max(peak, sum(len(r.blocks) for r in eng.scheduler.running if r.tenant_id == "hog"))
            for r in light:
                if r not in first_step and r.first_token_time is not None:
                    first_step[r] = step - args.light_arrival_step
        wall = time.monotonic() - t0
    hog_tokens = sum(r.num_output_tokens for r in hog)
    row = {"kv_share": share, "wall_s": wall, "steps": step, "hog_peak_blocks": peak,
           "pool_blocks": eng.pool.num_blocks, "hog_output_tokens_per_s": hog_tokens / wall,
           "preemptions": eng.scheduler.num_preemptions,
           "light_ttft_mean_s": statistics.fmean(r.first_token_time - r.arrival_time for r in light),
           "light_ttft_mean_steps": statistics.fmean(first_step.values())}
    print(f"kv_share {share}: light tenants' TTFT mean {row['light_ttft_mean_s'] * 1e3:.0f} ms "
          f"({row['light_ttft_mean_steps']:.1f} steps), the hog held at most {peak}/{row['pool_blocks']} blocks, "
          f"{row['hog_output_tokens_per_s']:.0f} hog tok/s, {row['preemptions']} preemptions")
    return row


def _run_cache(model: str, share: float | None, policy: str, args: argparse.Namespace) -> dict:
    from tierlm import LLM, SamplingParams
    with LLM(model, dtype=args.dtype, load_progress=False, max_num_seqs=args.max_num_seqs,
             max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=f"{args.kv_blocks} blocks",
             eviction_policy=policy) as llm:
        eng = llm.engine
        vocab, rng = eng.args.vocab_size, random.Random(args.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(min(5, vocab - 1), vocab) for _ in range(n)]

        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        prefixes = [tokens(args.gold_prefix_len) for _ in range(args.gold_prefixes)]
        gold, flood = [], []
        t0 = time.monotonic()
        for i in range(args.rounds):  # a round's requests all arrive together; rounds one after another
            gold.append(eng.add_request({"prompt_token_ids": prefixes[i % len(prefixes)] + tokens(16)}, params,
                                        tenant_id="gold", cache_salt="gold", kv_cache_share=share))
            flood += [eng.add_request({"prompt_token_ids": tokens(args.flood_prompt_len)}, params,
                                      tenant_id="flood", cache_salt="flood") for _ in range(args.flood_per_round)]
            while eng.has_unfinished():
                eng.step()
        wall = time.monotonic() - t0
    warm = gold[len(prefixes):]  # each prefix's first use is cold whatever the cache does

    def hit(reqs) -> float:
        return sum(r.num_cached_tokens for r in reqs) / sum(r.num_prompt_tokens for r in reqs)

    row = {"policy": policy, "kv_cache_share": share, "wall_s": wall, "pool_blocks": eng.pool.num_blocks,
           "gold_hit_share": hit(warm), "flood_hit_share": hit(flood),
           "gold_ttft_mean_s": statistics.fmean(r.first_token_time - r.arrival_time for r in warm),
           "flood_ttft_mean_s": statistics.fmean(r.first_token_time - r.arrival_time for r in flood),
           "evictions": eng.pool.evictions}
    print(f"{policy}, kv_cache_share {share}: gold's prompts {row['gold_hit_share']:.0%} from the cache, its TTFT "
          f"mean {row['gold_ttft_mean_s'] * 1e3:.0f} ms; flood's TTFT mean {row['flood_ttft_mean_s'] * 1e3:.0f} ms")
    return row


def _medians(rows: list[dict]) -> dict:
    """Per figure, its median over alternated runs; the rest (a policy's name, a share: the same
    in every run, None included) as the first run has it."""
    return {k: statistics.median(r[k] for r in rows) if isinstance(rows[0][k], (int, float)) and
            not isinstance(rows[0][k], bool) else rows[0][k] for k in rows[0]}


PARTS = ("fairness", "kv", "cache")


def _fairness_part(model: str, args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {"fcfs": [], "fair": []}
    for _ in range(args.repeats):  # alternated, so a drift in the machine's speed hits both alike
        for policy in runs:
            runs[policy].append(_run_policy(model, policy, args))
    fcfs, fair = (_medians(rows) for rows in runs.values())
    r = {
        "light_ttft_fcfs_over_fair": fcfs["light_ttft_mean_s"] / fair["light_ttft_mean_s"],
        "flood_ttft_fair_over_fcfs": fair["flood_ttft_mean_s"] / fcfs["flood_ttft_mean_s"],
        "light_ttft_steps_fcfs_over_fair": fcfs["light_ttft_mean_steps"] / fair["light_ttft_mean_steps"],
        "flood_ttft_steps_fair_over_fcfs": fair["flood_ttft_mean_steps"] / fcfs["flood_ttft_mean_steps"],
        "steps_fair_over_fcfs": fair["steps"] / fcfs["steps"],
        "throughput_fair_over_fcfs": fair["output_tokens_per_s"] / fcfs["output_tokens_per_s"],
        "service_gap_fcfs_over_fair": fcfs["max_service_gap"] / max(fair["max_service_gap"], 1.0),
    }
    print(f"fair shares: the light tenants' first tokens come {r['light_ttft_fcfs_over_fair']:.1f}x sooner "
          f"({r['light_ttft_steps_fcfs_over_fair']:.1f}x in steps), the flood's {r['flood_ttft_fair_over_fcfs']:.2f}x "
          f"later ({r['flood_ttft_steps_fair_over_fcfs']:.2f}x in steps), at {r['throughput_fair_over_fcfs']:.2f}x "
          f"the throughput and {r['steps_fair_over_fcfs']:.2f}x the steps of first come first served")
    return {"flood": args.flood, "light_tenants": args.light_tenants, "light_requests": args.light_requests,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
            "results": [fcfs, fair], "samples": runs, "ratios": r}


def _kv_part(model: str, args: argparse.Namespace) -> dict:
    kv_runs: dict[str, list[dict]] = {"none": [], "quota": []}
    for _ in range(args.repeats):
        for name, share in (("none", None), ("quota", args.hog_kv_share)):
            kv_runs[name].append(_run_kv(model, share, args))
    no_quota, quota = (_medians(rows) for rows in kv_runs.values())
    k = {
        "light_ttft_none_over_quota": no_quota["light_ttft_mean_s"] / quota["light_ttft_mean_s"],
        "light_ttft_steps_none_over_quota": no_quota["light_ttft_mean_steps"] / quota["light_ttft_mean_steps"],
        "hog_throughput_quota_over_none": quota["hog_output_tokens_per_s"] / no_quota["hog_output_tokens_per_s"],
    }
    print(f"KV quota {args.hog_kv_share} on the hog: light tenants' first tokens {k['light_ttft_none_over_quota']:.1f}x "
          f"sooner ({k['light_ttft_steps_none_over_quota']:.1f}x in steps), the hog at "
          f"{k['hog_throughput_quota_over_none']:.2f}x its throughput without one")
    return {"hog": args.hog, "hog_prompt_len": args.hog_prompt_len, "hog_max_tokens": args.hog_max_tokens,
            "kv_blocks": args.kv_blocks, "light_arrival_step": args.light_arrival_step,
            "results": [no_quota, quota], "samples": kv_runs, "ratios": k}


def _cache_part(model: str, args: argparse.Namespace) -> dict:
    cache: list[dict] = []
    for policy in args.eviction_policies:
        cache_runs: dict[str, list[dict]] = {"none": [], "partition": []}
        for _ in range(args.repeats):
            for name, share in (("none", None), ("partition", args.gold_cache_share)):
                cache_runs[name].append(_run_cache(model, share, policy, args))
        none, part = (_medians(rows) for rows in cache_runs.values())
        c_r = {"gold_ttft_none_over_partition": none["gold_ttft_mean_s"] / part["gold_ttft_mean_s"],
               "gold_hit_share_partition_minus_none": part["gold_hit_share"] - none["gold_hit_share"],
               "flood_ttft_partition_over_none": part["flood_ttft_mean_s"] / none["flood_ttft_mean_s"]}
        cache.append({"policy": policy, "results": [none, part], "samples": cache_runs, "ratios": c_r})
        print(f"cache partition {args.gold_cache_share} for gold ({policy}): its prompts "
              f"{none['gold_hit_share']:.0%} -> {part['gold_hit_share']:.0%} from the cache, first tokens "
              f"{c_r['gold_ttft_none_over_partition']:.1f}x sooner; the flood's "
              f"{c_r['flood_ttft_partition_over_none']:.2f}x its TTFT without one")
    return {"gold_prefixes": args.gold_prefixes, "gold_prefix_len": args.gold_prefix_len, "rounds": args.rounds,
            "flood_per_round": args.flood_per_round, "flood_prompt_len": args.flood_prompt_len,
            "kv_blocks": args.kv_blocks, "gold_cache_share": args.gold_cache_share, "by_policy": cache}


def run(args: argparse.Namespace) -> dict:
    """The parts `args.parts` names, each its peer in the same run; the fairness part's figures
    at the top level of the JSON (as before the other parts existed), the others under their keys."""
    from tierlm.bench.outputs import check_outputs, write_json
    outs = check_outputs({"--json": args.json, "--plot": args.plot})
    args.json, args.plot = outs["--json"], outs["--plot"]
    if args.model is None:
        from tierlm.models.demo import ensure_demo_model
        model = str(ensure_demo_model())
    else:
        model = args.model
    result: dict = {"model": model, "repeats": args.repeats, "parts": list(args.parts)}
    if "fairness" in args.parts:
        result |= _fairness_part(model, args)
    if "kv" in args.parts:
        result["kv_quota"] = _kv_part(model, args)
    if "cache" in args.parts:
        result["cache_partition"] = _cache_part(model, args)
    write_json(args.json, result)
    if args.plot is not None:
        plot_fairness(result, args.plot)
    return result


def plot_fairness(result: dict, path: str) -> str:
    """Mean TTFT per configuration; for the cache part alone, gold's share of prompt tokens
    from the cache instead (what a partition changes; its TTFT on a small model is noise)."""
    from tierlm.bench.plots import bar_plot
    if result.get("parts") == ["cache"]:
        shares = {f"{c['policy']}, {'no partition' if row['kv_cache_share'] is None else 'kv_cache_share ' + str(row['kv_cache_share'])}":
                  100 * row["gold_hit_share"] for c in result["cache_partition"]["by_policy"] for row in c["results"]}
        return bar_plot(path, shares, title="Gold's prompt tokens from the cache under a flood",
                        ylabel="% of gold's prompt tokens")
    bars = {f"{row['policy']}: {who}": row[f"{who}_ttft_mean_s"] * 1e3
            for row in result.get("results", []) for who in ("light", "flood")}
    titles = [f"{result['flood']} flood requests vs {result['light_tenants']}x{result['light_requests']} light"] \
        if "results" in result else []
    for row in result.get("kv_quota", {}).get("results", []):
        quota = "no quota" if row["kv_share"] is None else f"kv_share {row['kv_share']}"
        bars[f"KV hog, {quota}: light"] = row["light_ttft_mean_s"] * 1e3
    titles += ["a KV hog vs light"] if "kv_quota" in result else []
    for c in result.get("cache_partition", {}).get("by_policy", []):
        for row in c["results"]:
            part = "no partition" if row["kv_cache_share"] is None else f"kv_cache_share {row['kv_cache_share']}"
            bars[f"cache flood ({c['policy']}), {part}: gold"] = row["gold_ttft_mean_s"] * 1e3
    titles += ["a cache flood vs gold's prefixes"] if "cache_partition" in result else []
    return bar_plot(path, bars, title=f"Mean TTFT: {'; '.join(titles)}", ylabel="ms (log scale)", logy=True)


def add_cli(sub) -> None:
    p = sub.add_parser("fairness", help="a flooding tenant against light tenants of its tier: fcfs vs fair shares")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--flood", type=at_least(1, int), default=48, help="requests the flooding tenant queues")
    p.add_argument("--light-tenants", type=at_least(1, int), default=3)
    p.add_argument("--light-requests", type=at_least(1, int), default=2, help="requests each light tenant queues")
    p.add_argument("--prompt-len", type=at_least(1, int), default=128)
    p.add_argument("--max-tokens", type=at_least(1, int), default=32)
    p.add_argument("--max-num-seqs", type=at_least(1, int), default=8)
    p.add_argument("--max-num-batched-tokens", type=at_least(1, int), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=at_least(1, int), default=3, help="runs of each policy, alternated")
    q = p.add_argument_group("KV quota part")
    q.add_argument("--hog", type=at_least(1, int), default=12, help="long requests the KV hog queues")
    q.add_argument("--hog-prompt-len", type=at_least(1, int), default=512)
    q.add_argument("--hog-max-tokens", type=at_least(1, int), default=128)
    q.add_argument("--hog-kv-share", type=in_range(float, 0, 1, low_open=True), default=0.5, help="the hog's quota, a fraction of the pool")
    q.add_argument("--kv-blocks", type=at_least(4, int), default=256, help="device KV pool size, in blocks")
    q.add_argument("--light-arrival-step", type=at_least(0, int), default=40,
                   help="the step at which the light tenants' requests arrive (the pool full by then)")
    c = p.add_argument_group("cache partition part (the KV pool of --kv-blocks)")
    c.add_argument("--gold-prefixes", type=at_least(1, int), default=4, help="long prompt prefixes gold cycles through")
    c.add_argument("--gold-prefix-len", type=at_least(1, int), default=256)
    c.add_argument("--rounds", type=at_least(1, int), default=12, help="rounds: one gold request and the flood's each")
    c.add_argument("--flood-per-round", type=at_least(1, int), default=4, help="new prompts the flood sends per round")
    c.add_argument("--flood-prompt-len", type=at_least(1, int), default=512)
    c.add_argument("--gold-cache-share", type=in_range(float, 0, 1, low_open=True), default=0.3,
                   help="gold's kv_cache_share, a fraction of the pool")
    c.add_argument("--eviction-policies", type=_policies, default=["lru", DEFAULT_POLICY],
                   help="comma-separated device eviction policies, each run with and without the partition")
    p.add_argument("--parts", type=_parts, default=list(PARTS),
                   help=f"comma-separated parts to run (default all: {','.join(PARTS)})")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=lambda a: run(a) and 0)


def _parts(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or any(n not in PARTS for n in names):
        raise argparse.ArgumentTypeError(f"give parts from {', '.join(PARTS)} (got {text!r})")
    return [p for p in PARTS if p in names]


def _policies(text: str) -> list[str]:
    from tierlm.kv.policies import POLICIES
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in POLICIES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"give eviction policies from {', '.join(sorted(POLICIES))} (got {text!r})")
    return list(dict.fromkeys(names))
