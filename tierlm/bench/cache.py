"""`tierlm bench cache`: exact offline replay of prefix-block traces through eviction policies.

The simulator drives the same `tierlm.kv.policies` objects the engine's block pool uses, with the
engine's rules: a request hits the longest run of *leading* cached blocks; then its blocks are
accessed in order, pinned while the request is being inserted (it must not evict its own chain)
and unpinned at the end; a full cache evicts `policy.victim()` before each insert. If nothing is
evictable (a request longer than the whole cache), the rest of that request is not cached.

Clock: `now` advances once per *request* (`clock="request"`, the default). Measured on both
Mooncake traces at 1k/4k/16k blocks: TLP's alpha=0.995 per *block reference* decays a block's
history within ~6 requests and is within 0.0007 of LRU in all six cells, while 0.995 per request
lets frequency count (conversation: 0.0486/0.0944/0.2676 vs LRU 0.0445/0.0865/0.2627). Scaling
alpha to the per-block equivalent (0.9998) gives the per-request numbers again (within 0.001), so the unit only
sets alpha's scale; per request is the one that means the same on traces with different prompt
lengths, and a request's blocks are referenced together anyway (per-block ticks would make a
prompt's first blocks look older than its last). LRU/LFU/S3-FIFO/ARC/Belady ignore the unit;
Gittins measured the same under both clocks (its half-life scaled alike).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Hashable, Sequence

from tierlm.bench.outputs import check_outputs, write_json
from tierlm.kv.policies import (
    OFFLINE_POLICIES,
    POLICIES,
    SAMPLED_POLICIES,
    EvictionPolicy,
    make_policy,
)

__all__ = [
    "Trace",
    "SimResult",
    "load_trace",
    "simulate",
    "infinite_hit_bound",
    "run_cache_bench",
    "add_cli",
    "main",
]

DEFAULT_CAPACITIES = [1000, 4000, 16000]
#: How long a request decodes per output token, in the replay, before its output length (the
#: hint `gittins_hint` learns from) reaches the policy: a GPU server's typical time per output
#: token. Prefill time is left out, so the hint still comes a little early.
DEFAULT_DECODE_MS_PER_TOKEN = 20.0


@dataclass
class Trace:
    """A trace's requests as lists of prefix-block ids (one id per block, in prefix order)."""

    name: str
    requests: list[list[int]]
    #: Tokens each request generated (the trace's `output_length`), if the trace has them: the
    #: replay hands them to the policy when the request is done (`EvictionPolicy.finished`).
    output_lengths: list[int] | None = None
    #: Arrival of each request in ms (the trace's `timestamp`), if the trace has them: an output
    #: length is told only once the request would have generated it (`replay`'s `finish_at`).
    arrivals: list[float] | None = None

    @property
    def num_refs(self) -> int:
        return sum(len(r) for r in self.requests)


@dataclass
class SimResult:
    policy: str
    capacity: int
    hits: int
    refs: int
    hit_rate: float
    seconds: float = 0.0


def _block_ids(value: object) -> list[int]:
    """`hash_ids` as block ids, or ValueError saying what is wrong: only a list of integers
    stands for a chain of blocks (a string would replay as one block per character)."""
    if not isinstance(value, list):
        raise ValueError(f"'hash_ids' must be a JSON list of integers, got {json.dumps(value)[:40]}")
    for i, x in enumerate(value):
        if type(x) is not int:  # not bool either; JSON gives int, float, str, bool, None, list, dict
            raise ValueError(f"'hash_ids' must be a JSON list of integers, item {i} is "
                             f"{json.dumps(x)[:40]}")
    return value


def _check_chain(blocks: list[int], parents: dict[int, tuple[int | None, str]], where: str) -> None:
    """Refuse ids that cannot be prefix blocks: a block's id covers its whole prefix, so it has
    one parent throughout the trace and appears once per request. Replayed anyway, such a trace
    lets online policies beat Belady's MIN, which is optimal only over prefix trees."""
    if len(set(blocks)) != len(blocks):
        twice = next(h for i, h in enumerate(blocks) if h in blocks[:i])
        raise ValueError(f"{where}: block {twice} appears twice in one request: 'hash_ids' must be chained "
                         "prefix-block ids (each id stands for its whole prefix)")
    parent = None
    for h in blocks:
        seen = parents.setdefault(h, (parent, where))
        if seen[0] != parent:
            first = "as the first block" if seen[0] is None else f"after block {seen[0]}"
            now = "as the first block" if parent is None else f"after block {parent}"
            raise ValueError(f"{where}: block {h} comes {now}, but {first} at {seen[1]}: 'hash_ids' must "
                             "be chained prefix-block ids (each id stands for its whole prefix)")
        parent = h


def load_trace(path: str, name: str | None = None) -> Trace:
    """Read a Mooncake-style JSONL trace (`hash_ids` per line) into a `Trace` named `name`
    (default: the file's stem). Refuses what the replay could not mean, naming file and line."""
    requests: list[list[int]] = []
    outputs: list[int] = []
    arrivals: list[float | None] = []
    parents: dict[int, tuple[int | None, str]] = {}  # block id -> (its parent, where first seen)
    try:
        f = open(path, "rb")  # decoded per line, so a bad byte is reported with its line
    except OSError as e:
        raise ValueError(f"cannot read trace {path}: {e.strerror or e}; give a Mooncake JSONL file "
                         "(one request per line, with hash_ids)") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line); "
                                 "give a JSONL trace") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not JSON ({e}); give one JSON object per line") from None
            except RecursionError:
                raise ValueError(f"{where}: JSON nested too deeply; give one flat JSON object per line") from None
            if not isinstance(row, dict) or "hash_ids" not in row:
                raise ValueError(f"{where}: expected a JSON object with 'hash_ids' (a list of "
                                 f"integer block ids), got {line.strip()[:40]}")
            try:
                blocks = _block_ids(row["hash_ids"])
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            _check_chain(blocks, parents, where)
            requests.append(blocks)
            n_out = row.get("output_length", -1)
            if type(n_out) is not int or (n_out < 0 and "output_length" in row):  # not bool, float or str
                raise ValueError(f"{where}: 'output_length' must be a whole number of tokens (>= 0) if "
                                 f"given, got {json.dumps(n_out)[:40]}")
            outputs.append(n_out)
            stamp = row.get("timestamp")
            arrivals.append(float(stamp) if type(stamp) in (int, float) and math.isfinite(stamp) else None)
    if not any(requests):
        raise ValueError(f"no block references in {path}: it has no request with a non-empty "
                         "'hash_ids'; give a trace with block ids to replay")
    in_order = None not in arrivals and all(a <= b for a, b in zip(arrivals, arrivals[1:]))
    return Trace(name=name or os.path.splitext(os.path.basename(path))[0], requests=requests,
                 output_lengths=outputs if all(n >= 0 for n in outputs) else None,
                 arrivals=arrivals if in_order else None)


def _trace_names(paths: Sequence[str]) -> list[str]:
    """One distinct name per trace for the JSON and the table: its file stem, or where stems
    collide the shortest trailing part of its path that tells it apart (x/a/t.jsonl and
    x/b/t.jsonl are a/t.jsonl and b/t.jsonl)."""
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    parts = [os.path.abspath(p).split(os.sep) for p in paths]
    names = []
    for i, stem in enumerate(stems):
        if stems.count(stem) == 1:
            names.append(stem)
            continue
        k = 2  # two parts or more always hold a "/", so never equal another trace's stem
        while k < len(parts[i]) and any(j != i and stems[j] == stem and q[-k:] == parts[i][-k:]
                                        for j, q in enumerate(parts)):
            k += 1
        names.append("/".join(parts[i][-k:]))
    return names


def _requests(trace: Trace | Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
    return trace.requests if isinstance(trace, Trace) else trace


def infinite_hit_bound(trace: Trace | Sequence[Sequence[int]]) -> tuple[int, int]:
    """(hits, refs) with an infinite cache: every leading block seen before is a hit."""
    seen: set[int] = set()
    hits = refs = 0
    for blocks in _requests(trace):
        h = 0
        while h < len(blocks) and blocks[h] in seen:
            h += 1
        hits += h
        refs += len(blocks)
        seen.update(blocks)
    return hits, refs


def replay(policy: EvictionPolicy, requests: Sequence[Sequence[Hashable]], capacity: int,
           clock: str = "request", output_lengths: Sequence[int] | None = None,
           arrivals: Sequence[float] | None = None,
           finish_at: Sequence[float] | None = None) -> tuple[int, int]:
    """Drive `policy` through `requests` with room for `capacity` blocks; returns (hits, refs).

    A request hits its longest run of leading cached blocks; then each of its blocks is pinned
    and accessed (evicting a victim first when full) and unpinned. The policy hears its output
    length (`finished`), if the trace has them, when the request is done: with `arrivals` and
    `finish_at` (ms), before the first request that arrives at or after `finish_at`, as a
    server would learn it; else at once, before the next request (which flatters the hint).
    """
    per_block = clock == "block"
    contains, access, pin, unpin = policy.__contains__, policy.access, policy.pin, policy.unpin
    victim, remove = policy.victim, policy.remove
    hits = refs = tick = 0
    later = output_lengths is not None and arrivals is not None and finish_at is not None
    pending: list[tuple[float, int, Sequence[Hashable]]] = []  # (done at, request, its blocks cached)
    for req_idx, blocks in enumerate(requests):
        while pending and pending[0][0] <= arrivals[req_idx]:
            _, j, done = heapq.heappop(pending)
            policy.finished(done, output_lengths[j])
        n = len(blocks)
        refs += n
        h = 0
        while h < n and contains(blocks[h]):
            h += 1
        hits += h
        parent = None
        inserted = 0
        for key in blocks:
            if not contains(key) and len(policy) >= capacity:
                v = victim()
                if v is None:
                    break  # everything left is pinned by this request: cannot cache the rest
                remove(v)
            pin(key)
            access(key, parent, tick if per_block else req_idx)
            parent = key
            inserted += 1
            tick += 1
        for key in blocks[:inserted]:
            unpin(key)
        if later:
            heapq.heappush(pending, (finish_at[req_idx], req_idx, blocks[:inserted]))
        elif output_lengths is not None:
            policy.finished(blocks[:inserted], output_lengths[req_idx])
    for _, j, done in sorted(pending):  # the last requests end after the trace does
        policy.finished(done, output_lengths[j])
    return hits, refs


def simulate(trace: Trace | Sequence[Sequence[int]], policy_name: str, capacity: int,
             clock: str = "request", decode_ms_per_token: float = 0.0, **policy_kwargs: object) -> SimResult:
    """Replay `trace` through a fresh policy with room for `capacity` blocks.

    `clock` is "request" (now = request index) or "block" (now = global block-reference index).
    `decode_ms_per_token` > 0: a request's output length reaches the policy when it would be
    done decoding, `output_length` × that many ms after it arrived (needs the trace's
    timestamps); 0: at once.
    """
    if clock not in ("request", "block"):
        raise ValueError(f"clock must be 'request' or 'block', got {clock!r}")
    requests = _requests(trace)
    policy = make_policy(policy_name, **policy_kwargs)
    if policy_name in OFFLINE_POLICIES:
        policy.set_future([k for blocks in requests for k in blocks])  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    outputs = trace.output_lengths if isinstance(trace, Trace) else None
    arrivals = trace.arrivals if isinstance(trace, Trace) and decode_ms_per_token > 0 else None
    finish_at = None
    if outputs is not None and arrivals is not None:
        finish_at = [a + n * decode_ms_per_token for a, n in zip(arrivals, outputs)]
    hits, refs = replay(policy, requests, capacity, clock, outputs, arrivals, finish_at)
    return SimResult(policy=policy_name, capacity=capacity, hits=hits, refs=refs,
                     hit_rate=hits / refs if refs else 0.0,
                     seconds=time.perf_counter() - t0)


def _repeated(values: Sequence[object]) -> int | None:
    """Index of the first value given twice (it would be replayed twice, its JSON rows doubled)."""
    return next((i for i, v in enumerate(values) if v in values[:i]), None)


def _gap_closed(rate: float, lru: float, belady: float) -> float | None:
    return None if belady - lru <= 1e-12 else (rate - lru) / (belady - lru)


def run_cache_bench(trace_paths: list[str], capacities: list[int],
                    policies: list[str] | None = None, json_out: str | None = None,
                    plot_out: str | None = None, clock: str = "request",
                    quiet: bool = False, seed: int = 0,
                    decode_ms_per_token: float = DEFAULT_DECODE_MS_PER_TOKEN) -> dict:
    """Replay every trace × capacity × policy plus the references: lru and the offline
    `OFFLINE_POLICIES` (belady; oracle_pop, the ceiling for popularity scores). The policies
    that sample their victims get `seed`; output lengths reach them `decode_ms_per_token` ms
    per token after the request arrived (`simulate`). Writes JSON and, if asked, the PNG."""
    if isinstance(decode_ms_per_token, bool) or not isinstance(decode_ms_per_token, (int, float)) \
            or not math.isfinite(decode_ms_per_token) or decode_ms_per_token < 0:
        raise ValueError(f"decode_ms_per_token must be a number of ms >= 0, got {decode_ms_per_token!r}")
    if policies is not None and (not policies or not all(policies)):
        raise ValueError(f"empty policy name in {list(policies)}; give policy names from "
                         f"{POLICIES + OFFLINE_POLICIES}, or none for all")
    chosen = list(policies) if policies else list(POLICIES)
    unknown = [p for p in chosen if p not in POLICIES and p not in OFFLINE_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {POLICIES + OFFLINE_POLICIES}")
    if (i := _repeated(chosen)) is not None:
        raise ValueError(f"policy {chosen[i]} is given twice; give each policy once")
    if not capacities or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                             for c in capacities):
        raise ValueError(f"capacities must be block counts of at least 1, got {list(capacities)}")
    if (i := _repeated(capacities)) is not None:
        raise ValueError(f"capacity {capacities[i]} is given twice; give each capacity once")
    if not trace_paths:
        raise ValueError("no trace given; give at least one JSONL trace file")
    real = [os.path.realpath(p) for p in trace_paths]
    if (i := _repeated(real)) is not None:
        first = trace_paths[real.index(real[i])]
        also = "" if first == trace_paths[i] else f" (also as {first})"
        raise ValueError(f"trace file {trace_paths[i]} is given twice{also}; give each trace once")
    order = (["lru"] + [p for p in chosen if p != "lru" and p not in OFFLINE_POLICIES]
             + OFFLINE_POLICIES)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))

    # everything that can be wrong is found before the replay, which takes minutes on real traces
    names = _trace_names(trace_paths)
    traces = [load_trace(path, name) for path, name in zip(trace_paths, names)]
    outs = check_outputs({"--json": json_out, "--plot": plot_out}, inputs=trace_paths)
    json_out, plot_out = outs["--json"], outs["--plot"]

    results: list[dict] = []
    bounds: dict[str, float] = {}
    t_start = time.perf_counter()
    for trace in traces:
        bh, br = infinite_hit_bound(trace)
        bounds[trace.name] = bh / br
        say(f"[cache] {trace.name}: {len(trace.requests)} requests, {br} block refs, "
            f"infinite-cache bound {bounds[trace.name]:.4f}")
        for cap in capacities:
            rows: dict[str, SimResult] = {}
            for name in order:
                r = simulate(trace, name, cap, clock=clock, decode_ms_per_token=decode_ms_per_token,
                             **({"seed": seed} if name in SAMPLED_POLICIES else {}))
                rows[name] = r
                say(f"[cache]   cap={cap:<6} {name:<10} hit_rate={r.hit_rate:.4f} "
                    f"({r.seconds:.1f}s)")
            lru, bel = rows["lru"].hit_rate, rows["belady"].hit_rate
            for name, r in rows.items():
                row = {"trace": trace.name, **asdict(r)}
                row["seconds"] = round(r.seconds, 3)
                row["gap_closed_vs_lru"] = _gap_closed(r.hit_rate, lru, bel)
                results.append(row)
    elapsed = time.perf_counter() - t_start
    out = {
        "trace": names,
        "capacities": list(capacities),
        "clock": clock,
        "seed": seed,
        "decode_ms_per_token": decode_ms_per_token,
        "infinite_cache_bound": bounds,
        "elapsed_s": round(elapsed, 2),
        "results": results,
    }
    if not quiet:
        print(format_table(out))
    if json_out is not None:
        write_json(json_out, out)
    if plot_out is not None:
        plot_cache_results(out, plot_out)
    return out


def format_table(out: dict) -> str:
    """Plain-text table: one row per trace × policy, hit rate (gap closed) per capacity."""
    caps = out["capacities"]
    seen: list[tuple[str, str]] = []
    for r in out["results"]:
        if (r["trace"], r["policy"]) not in seen:
            seen.append((r["trace"], r["policy"]))
    w = max([24] + [len(t) for t, _ in seen])  # path-based names of colliding stems run longer
    pw = max([10] + [len(p) for _, p in seen])  # gittins_hint is 12
    head = f"{'trace':<{w}} {'policy':<{pw}} " + " ".join(f"{f'cap={c}':>18}" for c in caps)
    lines = [head, "-" * len(head)]
    by_key = {(r["trace"], r["policy"], r["capacity"]): r for r in out["results"]}
    for trace, policy in seen:
        cells = []
        for c in caps:
            r = by_key.get((trace, policy, c))
            if r is None:
                cells.append(f"{'-':>18}")
                continue
            g = r["gap_closed_vs_lru"]
            gap = "" if g is None or policy in ("lru", "belady") else f" ({100 * g:+.0f}%)"
            cells.append(f"{r['hit_rate']:.4f}{gap}".rjust(18))
        lines.append(f"{trace:<{w}} {policy:<{pw}} " + " ".join(cells))
    lines.append(f"elapsed {out['elapsed_s']}s; (x%) = share of the LRU→Belady gap closed")
    return "\n".join(lines)


def plot_cache_results(out: dict, path: str) -> str:
    """Hit rate vs capacity, one line per policy, one panel per trace."""
    from tierlm.bench.plots import panels_plot

    panels: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for r in out["results"]:
        series = panels.setdefault(r["trace"], {})
        xs, ys = series.setdefault(r["policy"], ([], []))
        xs.append(r["capacity"])
        ys.append(r["hit_rate"])
    for trace, bound in out.get("infinite_cache_bound", {}).items():
        if trace in panels:
            caps = sorted({c for xs, _ in panels[trace].values() for c in xs})
            panels[trace]["∞ cache"] = (caps, [bound] * len(caps))
    # A short dash at each capacity, so one capacity alone still shows the bound (a one-point
    # line without a marker draws nothing).
    styles = {"∞ cache": {"linestyle": ":", "color": "gray", "marker": "_", "markersize": 12},
              "belady": {"linestyle": "--", "color": "black"},
              "oracle_pop": {"linestyle": "--", "color": "darkred"}}
    return panels_plot(path, panels, title="prefix-cache hit rate vs capacity (blocks)",
                       xlabel="capacity (blocks)", ylabel="block hit rate", logx=True,
                       styles=styles)


def _int_list(text: str) -> list[int]:
    try:  # an empty item ("10,,20": a typo, or an unset variable) is refused, not skipped
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated block counts of at least 1, got {text!r}")
    if (i := _repeated(values)) is not None:
        raise argparse.ArgumentTypeError(f"capacity {values[i]} is given twice in {text!r}; give each once")
    return values


def _name_list(text: str) -> list[str]:
    """Policy names; an empty list or name is refused rather than read as "all policies"."""
    names = [x.strip() for x in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated policy names, got {text!r}; choose from "
            f"{','.join(POLICIES + OFFLINE_POLICIES)}, or leave --policies out for all")
    if (i := _repeated(names)) is not None:
        raise argparse.ArgumentTypeError(f"policy {names[i]} is given twice in {text!r}; give each once")
    return names


def _ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of milliseconds >= 0, got {text!r}")
    return value


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--trace", action="append", required=True, metavar="FILE",
                   help="JSONL trace with hash_ids per request (repeat for several traces)")
    p.add_argument("--capacities", type=_int_list, default=DEFAULT_CAPACITIES,
                   help="comma-separated cache sizes in blocks (default 1000,4000,16000)")
    p.add_argument("--policies", type=_name_list, default=None,
                   help=f"comma-separated subset of {','.join(POLICIES)} (default: all); "
                        "lru, belady and oracle_pop are always run as references")
    p.add_argument("--clock", choices=["request", "block"], default="request",
                   help="logical time unit passed to policies (default: request)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed of the policies that sample their victims "
                        f"({', '.join(SAMPLED_POLICIES)}); the others are deterministic")
    p.add_argument("--decode-ms-per-token", type=_ms, default=DEFAULT_DECODE_MS_PER_TOKEN, metavar="MS",
                   help="a request's output length reaches the policies (gittins_hint learns from it) "
                        "output_length x MS after it arrived, as a server learns it when the request ends "
                        f"(default {DEFAULT_DECODE_MS_PER_TOKEN:g}; 0: at once)")
    p.add_argument("--json", dest="json_out", default="bench_results/cache.json")
    p.add_argument("--plot", dest="plot_out", default=None, help="PNG path (optional)")
    p.set_defaults(func=main)
    return p


def add_cli(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register `cache` under an existing `bench` subparser group."""
    return _configure(subparsers.add_parser(
        "cache", help="replay prefix-block traces through eviction policies (offline)"))


def main(args: argparse.Namespace) -> int:
    run_cache_bench(args.trace, args.capacities, args.policies, args.json_out, args.plot_out,
                    clock=args.clock, seed=args.seed, decode_ms_per_token=args.decode_ms_per_token)
    return 0


if __name__ == "__main__":
    from tierlm.cli import run_command
    parser = _configure(argparse.ArgumentParser(prog="python -m tierlm.bench.cache",
                                                description=__doc__.splitlines()[0]))
    sys.exit(run_command(parser.parse_args()))
