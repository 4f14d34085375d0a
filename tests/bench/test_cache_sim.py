"""The offline cache simulator: exactness against a brute-force LRU, bounds, bench output, CLI."""

from __future__ import annotations

import argparse
import functools
import json
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierlm.bench.cache import (
    add_cli,
    infinite_hit_bound,
    load_trace,
    plot_cache_results,
    run_cache_bench,
    simulate,
)
from tierlm.kv.policies import POLICIES, SAMPLED_POLICIES

TRACES = "/work/shared/traces"


@st.composite
def prefix_traces(draw: st.DrawFn, max_nodes: int = 25, max_requests: int = 30) -> list[list[int]]:
    """Requests are root-to-node paths of a random forest, so block ids chain like real hashes."""
    n = draw(st.integers(1, max_nodes))
    parent: list[int | None] = [None]
    for i in range(1, n):
        parent.append(draw(st.one_of(st.none(), st.integers(0, i - 1))))

    def path(i: int) -> list[int]:
        out = []
        node: int | None = i
        while node is not None:
            out.append(node)
            node = parent[node]
        return out[::-1]

    return [path(i) for i in draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=max_requests))]


def brute_force_lru(trace: list[list[int]], capacity: int) -> int:
    """The replay rule written as plainly as possible (lists and scans, O(n^2))."""
    cache: dict[int, tuple[int, int | None]] = {}  # block -> (last access tick, parent)
    hits = tick = 0
    for blocks in trace:
        h = 0
        while h < len(blocks) and blocks[h] in cache:
            h += 1
        hits += h
        pinned: list[int] = []
        parent = None
        for key in blocks:
            if key not in cache and len(cache) >= capacity:
                leaves = [k for k in cache if k not in pinned
                          and all(p != k for _, p in cache.values())]
                if not leaves:
                    break
                del cache[min(leaves, key=lambda k: cache[k][0])]
            cache[key] = (tick, cache[key][1] if key in cache else parent)
            pinned.append(key)
            parent = key
            tick += 1
    return hits


@settings(max_examples=150, deadline=None)
@given(trace=prefix_traces(), capacity=st.integers(1, 12))
def test_lru_matches_brute_force(trace: list[list[int]], capacity: int) -> None:
    expected = brute_force_lru(trace, capacity)
    assert simulate(trace, "lru", capacity, clock="block").hits == expected
    # with one tick per request no two evictable leaves share a tick, so the order is the same
    assert simulate(trace, "lru", capacity, clock="request").hits == expected


@settings(max_examples=60, deadline=None)
@given(trace=prefix_traces(), capacity=st.integers(1, 12))
def test_oldest_candidates_make_an_untrained_sampled_policy_exact_lru(
        trace: list[list[int]], capacity: int) -> None:
    # before its first refit every Gittins index is 0 and ties go to the least recent; one random
    # draw would miss the LRU leaf, the age heap must hand it over every time
    g = simulate(trace, "gittins", capacity, refit_every=10**9, samples=1, oldest=1)
    assert g.hits == simulate(trace, "lru", capacity).hits


@settings(max_examples=60, deadline=None)
@given(trace=prefix_traces(), capacity=st.integers(1, 12))
def test_belady_beats_every_online_policy(trace: list[list[int]], capacity: int) -> None:
    best = simulate(trace, "belady", capacity).hits
    for name in POLICIES:
        assert simulate(trace, name, capacity).hits <= best, name


def optimal_hits(trace: list[list[int]], capacity: int) -> int:
    """The most hits any sequence of eviction choices gets under the replay rule: every
    evictable leaf tried at every eviction, memoized on (request, cached set)."""
    parent = {key: (blocks[i - 1] if i else None) for blocks in trace for i, key in enumerate(blocks)}

    def endings(blocks: list[int], cache: frozenset) -> set[frozenset]:
        """Every cached set the request's insertion loop can leave behind."""
        out: set[frozenset] = set()

        def insert(j: int, cache: frozenset) -> None:
            if j == len(blocks):
                out.add(cache)
                return
            key = blocks[j]
            if key in cache or len(cache) < capacity:
                insert(j + 1, cache | {key})
                return
            parents = {parent[k] for k in cache}
            leaves = [k for k in cache if k not in parents and k not in blocks[:j]]
            if not leaves:
                out.add(cache)  # all pinned by this request: the rest is not cached
            for leaf in leaves:
                insert(j + 1, (cache - {leaf}) | {key})

        insert(0, cache)
        return out

    @functools.cache
    def best(i: int, cache: frozenset) -> int:
        if i == len(trace):
            return 0
        blocks = trace[i]
        h = 0
        while h < len(blocks) and blocks[h] in cache:
            h += 1
        return h + max(best(i + 1, end) for end in endings(blocks, cache))

    return best(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(trace=prefix_traces(max_nodes=9, max_requests=12), capacity=st.integers(1, 5))
def test_belady_equals_an_exhaustive_search(trace: list[list[int]], capacity: int) -> None:
    # the "gap closed" figures are measured against Belady's MIN: under leaf-only eviction the
    # cache stays prefix-closed, so MIN must be the true optimum of the replay rule
    assert simulate(trace, "belady", capacity).hits == optimal_hits(trace, capacity)


@settings(max_examples=40, deadline=None)
@given(trace=prefix_traces())
def test_infinite_capacity_reaches_the_prefix_bound(trace: list[list[int]]) -> None:
    bound, refs = infinite_hit_bound(trace)
    for name in POLICIES + ["belady"]:
        r = simulate(trace, name, capacity=10**9)
        assert (r.hits, r.refs) == (bound, refs), name


def test_gittins_is_lru_until_it_has_learned() -> None:
    trace = [[0, 1, 2], [0, 3], [4, 5], [0, 1, 6], [4, 7], [0, 3, 8], [9], [0, 1, 2], [4, 5]] * 3
    for cap in (2, 3, 4, 6):
        g = simulate(trace, "gittins", cap, refit_every=10**9, samples=10**6)
        assert g.hits == simulate(trace, "lru", cap).hits


def test_request_longer_than_cache_is_partially_cached() -> None:
    r = simulate([[1, 2, 3, 4], [1, 2, 3, 4]], "lru", capacity=2)
    assert (r.hits, r.refs) == (2, 8)


def test_unknown_clock_is_rejected() -> None:
    with pytest.raises(ValueError, match="clock"):
        simulate([[1]], "lru", 1, clock="wall")


@pytest.fixture()
def tiny_trace(tmp_path) -> str:
    path = tmp_path / "tiny.jsonl"
    reqs = [[0, 1, 2], [0, 1, 3], [4, 5], [0, 1, 2, 6], [4, 5, 7], [0, 8], [0, 1, 3]] * 4
    path.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 512 * len(r), "output_length": 1,
                    "hash_ids": r}) + "\n" for i, r in enumerate(reqs)))
    return str(path)


def test_load_trace(tiny_trace: str, tmp_path) -> None:
    t = load_trace(tiny_trace)
    assert t.name == "tiny" and len(t.requests) == 28 and t.requests[0] == [0, 1, 2]
    assert t.output_lengths == [1] * 28
    no_outputs = tmp_path / "no_outputs.jsonl"
    no_outputs.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": [1, 3], "output_length": 4}\n')
    assert load_trace(str(no_outputs)).output_lengths is None  # all or nothing
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(str(bad))


@pytest.mark.parametrize("lines, says", [
    (['{"hash_ids": [1, 2], "output_length": 1e400}'], r":1: 'output_length' must be a whole number .* Infinity"),
    (['{"hash_ids": [1, 2], "output_length": "7"}'], r":1: 'output_length' must be a whole number"),
    (['{"hash_ids": [1, 2], "output_length": 2.9}'], r":1: 'output_length' must be a whole number"),
    (['{"hash_ids": [1, 2], "output_length": true}'], r":1: 'output_length' must be a whole number"),
    (['{"hash_ids": [1, 2], "output_length": -3}'], r":1: 'output_length' must be a whole number"),
    (['{"hash_ids": [4, 3, 3]}'], r":1: block 3 appears twice in one request"),
    (['{"hash_ids": [1, 2]}', '{"hash_ids": [3, 2]}'], r":2: block 2 comes after block 3, but after block 1 at .*:1"),
    (['{"hash_ids": [1, 2]}', '{"hash_ids": [2]}'], r":2: block 2 comes as the first block, but after block 1"),
])
def test_traces_that_cannot_be_prefix_chains_are_refused(tmp_path, lines: list[str], says: str) -> None:
    """Ids that are not chained prefix blocks let online policies beat Belady (optimal only over
    prefix trees) without a word; an output length that is not a token count crashed the replay."""
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=says):
        load_trace(str(path))


def test_run_cache_bench_writes_json_and_png(tiny_trace: str, tmp_path) -> None:
    out_json, out_png = tmp_path / "r" / "cache.json", tmp_path / "r" / "cache.png"
    out = run_cache_bench([tiny_trace], [2, 4], ["lru", "gittins"], str(out_json), str(out_png),
                          quiet=True)
    data = json.loads(out_json.read_text())
    assert data == json.loads(json.dumps(out))
    assert data["trace"] == ["tiny"] and os.path.getsize(out_png) > 0
    rows = {(r["policy"], r["capacity"]): r for r in data["results"]}
    assert set(rows) == {(p, c) for p in ("lru", "gittins", "belady", "oracle_pop")
                         for c in (2, 4)}
    for c in (2, 4):
        lru, bel = rows[("lru", c)]["hit_rate"], rows[("belady", c)]["hit_rate"]
        assert bel >= lru
        if bel > lru:
            assert rows[("lru", c)]["gap_closed_vs_lru"] == 0.0
            assert rows[("belady", c)]["gap_closed_vs_lru"] == pytest.approx(1.0)


def test_seed_reaches_the_sampled_policies_only(tmp_path) -> None:
    rng = random.Random(7)  # many short chains under 40 roots: more leaves than duel samples
    reqs = [[1000 + r] + [rng.randrange(10**6) for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.5 else [1000 + r, 5000 + r]
            for r in (rng.randrange(40) for _ in range(600))]
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": r}) + "\n" for r in reqs))
    runs = {}
    for seed in (0, 1):
        out = run_cache_bench([str(path)], [200], ["lru", "duel"], quiet=True, seed=seed)
        assert out["seed"] == seed
        runs[seed] = {r["policy"]: r["hits"] for r in out["results"]}
        assert runs[seed]["duel"] == simulate(reqs, "duel", 200, seed=seed).hits
    assert runs[0]["lru"] == runs[1]["lru"] and runs[0]["belady"] == runs[1]["belady"]
    assert runs[0]["duel"] != runs[1]["duel"]  # this trace has more leaves than duel samples
    assert "duel" in SAMPLED_POLICIES and "lru" not in SAMPLED_POLICIES


def test_cli_parses_and_runs(tiny_trace: str, tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser(prog="tierlm")
    bench = parser.add_subparsers(dest="cmd").add_parser("bench").add_subparsers(dest="bench")
    add_cli(bench)
    out_json, other = tmp_path / "c.json", tmp_path / "other.jsonl"
    other.write_text(open(tiny_trace).read())
    args = parser.parse_args(["bench", "cache", "--trace", tiny_trace, "--trace", str(other),
                              "--capacities", "2,3", "--policies", "lru,arc", "--seed", "3",
                              "--json", str(out_json)])
    assert args.capacities == [2, 3] and args.policies == ["lru", "arc"] and args.seed == 3
    assert args.func(args) == 0
    assert "belady" in capsys.readouterr().out
    written = json.loads(out_json.read_text())
    assert len(written["results"]) == 2 * 2 * 4 and written["seed"] == 3  # + belady, oracle_pop
    assert written["trace"] == ["tiny", "other"]
    for bad in ("x", "0", "10,-5", ",", "10,,20", "10,", ""):  # an empty item was skipped
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "cache", "--trace", tiny_trace, "--capacities", bad])
        assert "block counts of at least 1" in capsys.readouterr().err
    assert written["decode_ms_per_token"] == 20.0  # output lengths reach the policies 20 ms a token late
    for bad in ("-1", "nan", "inf", "fast"):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "cache", "--trace", tiny_trace, "--decode-ms-per-token", bad])
        assert "milliseconds >= 0" in capsys.readouterr().err


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`tierlm bench cache ...` in-process: exit status, stdout, stderr (argparse exits)."""
    from tierlm.cli import main

    capsys.readouterr()
    try:
        rc = main(["bench", "cache", *argv])
    except SystemExit as e:
        rc = int(e.code)
    out, err = capsys.readouterr()
    return rc, out, err


def _refused(argv: list[str], capsys, *says: str) -> str:
    """Bad input is exit status 2 and one `error:` line naming what is wrong, no traceback."""
    rc, _, err = _cli(argv, capsys)
    assert rc == 2, err
    assert "Traceback" not in err
    line = next(ln for ln in err.splitlines() if "error:" in ln)
    assert len([ln for ln in err.splitlines() if ln and not ln.startswith("see:")]) == 1, err
    for s in says:
        assert s in line, line
    return line


@pytest.mark.parametrize("hash_ids", [[[1], [2]], "abc", {"a": 1}, [1.5, None], [1, True], None])
def test_hash_ids_must_be_a_list_of_integers(tmp_path, capsys, hash_ids: object) -> None:
    # a nested list used to end in a TypeError traceback, a string in one block per character
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"hash_ids": [1, 2]}) + "\n" + json.dumps({"hash_ids": hash_ids}) + "\n")
    out = tmp_path / "out.json"
    _refused(["--trace", str(path), "--capacities", "2", "--policies", "lru", "--json", str(out)],
             capsys, f"{path}:2", "'hash_ids' must be a JSON list of integers")
    assert not out.exists()


@pytest.mark.parametrize("text", ["", "\n\n", '{"hash_ids": []}\n\n{"hash_ids": []}\n'])
def test_trace_without_block_references_is_refused(tmp_path, capsys, text: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    _refused(["--trace", str(path), "--capacities", "2", "--policies", "lru",
              "--json", str(tmp_path / "out.json")], capsys, f"no block references in {path}")
    assert not (tmp_path / "out.json").exists()


def test_binary_trace_names_the_file(tmp_path, capsys) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"hash_ids": [1]}\n\xff\xfe\x00\x81 not text\n')
    _refused(["--trace", str(path), "--capacities", "2", "--json", str(tmp_path / "o.json")],
             capsys, f"{path}:2", "UTF-8")


def test_deeply_nested_and_unreadable_traces_are_refused_in_one_line(tmp_path, capsys) -> None:
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"hash_ids": [1]}\n' + "[" * 100_000 + "\n")  # a RecursionError traceback before
    _refused(["--trace", str(deep), "--capacities", "2", "--json", str(tmp_path / "o.json")],
             capsys, f"{deep}:2", "nested too deeply")
    for path, says in ((tmp_path, "Is a directory"), (tmp_path / "missing.jsonl", "No such file")):
        _refused(["--trace", str(path), "--capacities", "2", "--json", str(tmp_path / "o.json")],
                 capsys, f"cannot read trace {path}: {says}", "give a Mooncake JSONL file")


def test_one_capacity_still_draws_the_infinite_cache_bound(tiny_trace: str, tmp_path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = run_cache_bench([tiny_trace], [3], policies=["lru"], quiet=True)
    shown = []
    real_save = plt.Figure.savefig

    def save(fig, *a, **kw):
        shown.extend(line for ax in fig.axes for line in ax.get_lines() if line.get_label() == "∞ cache")
        return real_save(fig, *a, **kw)

    plt.Figure.savefig = save
    try:
        plot_cache_results(out, str(tmp_path / "one.png"))
    finally:
        plt.Figure.savefig = real_save
    assert len(shown) == 1 and shown[0].get_marker() not in (None, "None", "")
    assert len(shown[0].get_xdata()) == 1


def test_repeated_capacities_policies_and_traces_are_refused(tiny_trace: str, tmp_path,
                                                             capsys) -> None:
    # each repeat used to replay the same cells again and write duplicate JSON rows
    base = ["--trace", tiny_trace, "--json", str(tmp_path / "o.json")]
    _refused(base + ["--capacities", "5,5"], capsys, "--capacities", "capacity 5 is given twice")
    _refused(base + ["--capacities", "5", "--policies", "arc,lru,arc"], capsys,
             "policy arc is given twice")
    _refused(base + ["--capacities", "5", "--trace", tiny_trace], capsys,
             f"trace file {tiny_trace} is given twice")
    with pytest.raises(ValueError, match="capacity 4 is given twice"):
        run_cache_bench([tiny_trace], [4, 2, 4], ["lru"], quiet=True)
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("policies", [",", "", "lru,", ",lru", "lru,,arc"])
def test_empty_policy_list_or_name_is_refused(tiny_trace: str, tmp_path, capsys,
                                              policies: str) -> None:
    # "," used to mean every policy
    _refused(["--trace", tiny_trace, "--capacities", "2", "--policies", policies,
              "--json", str(tmp_path / "o.json")], capsys, "--policies", "policy names")
    with pytest.raises(ValueError, match="empty policy name"):
        run_cache_bench([tiny_trace], [2], [p for p in policies.split(",")], quiet=True)


def test_traces_with_the_same_stem_keep_distinct_names(tmp_path, capsys) -> None:
    for sub, reqs in (("a", [[1, 2], [1, 2]]), ("b", [[3]])):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "t.jsonl").write_text("".join(json.dumps({"hash_ids": r}) + "\n"
                                                        for r in reqs))
    (tmp_path / "u.jsonl").write_text('{"hash_ids": [7]}\n{"hash_ids": [7]}\n')
    out_json = tmp_path / "o.json"
    traces = [str(tmp_path / "a" / "t.jsonl"), str(tmp_path / "b" / "t.jsonl"),
              str(tmp_path / "u.jsonl")]
    rc, table, _ = _cli([arg for t in traces for arg in ("--trace", t)] + [
        "--capacities", "2", "--policies", "lru", "--json", str(out_json)], capsys)
    assert rc == 0
    data = json.loads(out_json.read_text())
    assert data["trace"] == ["a/t.jsonl", "b/t.jsonl", "u"]
    assert data["infinite_cache_bound"] == {"a/t.jsonl": 0.5, "b/t.jsonl": 0.0, "u": 0.5}
    lru = {r["trace"]: r["hit_rate"] for r in data["results"] if r["policy"] == "lru"}
    assert lru == {"a/t.jsonl": 0.5, "b/t.jsonl": 0.0, "u": 0.5}
    assert len(data["results"]) == 3 * 3  # lru, belady, oracle_pop per trace
    for name in data["trace"]:
        assert sum(line.split()[:2] == [name, "lru"] for line in table.splitlines()) == 1


def test_unwritable_outputs_are_refused_before_the_replay(tiny_trace: str, tmp_path, capsys,
                                                          monkeypatch) -> None:
    # found only after the whole replay (minutes on real traces), the results were lost
    import tierlm.bench.cache as cache

    def no_replay(*a: object, **k: object) -> None:
        raise AssertionError("replayed before the output paths were checked")

    monkeypatch.setattr(cache, "simulate", no_replay)
    (tmp_path / "file").write_text("")
    good = tmp_path / "new" / "o.json"
    base = ["--trace", tiny_trace, "--capacities", "2", "--policies", "lru"]
    _refused(base + ["--json", str(tmp_path)], capsys, "--json", "is a directory")
    _refused(base + ["--json", str(good), "--plot", str(tmp_path)], capsys, "--plot",
             "is a directory")
    _refused(base + ["--json", str(tmp_path / "file" / "o.json")], capsys, "--json",
             f"{tmp_path / 'file'} is not a directory")
    _refused(base + ["--json", str(good), "--plot", str(tmp_path / "file" / "d" / "o.png")],
             capsys, "--plot", "is not a directory")
    _refused(base + ["--json", str(good), "--plot", str(good)], capsys, "--json and --plot")
    _refused(base + ["--json", str(good), "--plot", str(tmp_path / "o.xyz")], capsys, "--plot",
             "matplotlib cannot write a figure as .xyz")
    if os.path.isdir("/proc/self"):  # root may write anywhere os.access says, but not here
        _refused(base + ["--json", "/proc/self/no/o.json"], capsys, "--json", "cannot write")
    assert not good.exists()  # the check leaves no file behind


def test_outputs_that_would_overwrite_an_input_or_each_other_are_refused(tiny_trace: str, tmp_path,
                                                                        capsys, monkeypatch) -> None:
    # `--json TRACE` replaced the trace with the results; `--json out.png --plot out` wrote the
    # JSON, then savefig wrote out.png over it; an empty name wrote nothing and said nothing
    import tierlm.bench.cache as cache

    def no_replay(*a: object, **k: object) -> None:
        raise AssertionError("replayed before the output paths were checked")

    monkeypatch.setattr(cache, "simulate", no_replay)
    before = open(tiny_trace).read()
    base = ["--trace", tiny_trace, "--capacities", "2", "--policies", "lru"]
    _refused(base + ["--json", tiny_trace], capsys, "--json", "is the input file", "overwrite")
    _refused(base + ["--json", str(tmp_path / "o.json"), "--plot", tiny_trace], capsys, "--plot",
             "is the input file")
    link = tmp_path / "alias.jsonl"
    link.symlink_to(tiny_trace)
    _refused(base + ["--json", str(link)], capsys, "--json", "is the input file")
    png = tmp_path / "out.png"
    _refused(base + ["--json", str(png), "--plot", str(tmp_path / "out")], capsys,
             "--json and --plot are both")
    _refused(base + ["--json", ""], capsys, "--json is empty")
    _refused(base + ["--json", str(tmp_path / "o.json"), "--plot", " "], capsys, "--plot is empty")
    assert open(tiny_trace).read() == before and not png.exists()


def test_a_plot_name_without_extension_is_the_png_savefig_writes(tiny_trace: str, tmp_path,
                                                                  capsys) -> None:
    # the checks looked at `fig` while savefig wrote `fig.png`: a bad `fig.png` failed only
    # after the whole replay, in a line that did not name --plot
    (tmp_path / "figs" / "fig.png").mkdir(parents=True)
    base = ["--trace", tiny_trace, "--capacities", "2", "--policies", "lru",
            "--json", str(tmp_path / "o.json")]
    _refused(base + ["--plot", str(tmp_path / "figs" / "fig")], capsys, "--plot", "fig.png",
             "is a directory")
    rc, _, err = _cli(base + ["--plot", str(tmp_path / "plain.")], capsys)
    assert rc == 0, err
    assert (tmp_path / "plain.png").stat().st_size > 0 and not (tmp_path / "plain.").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_write_that_fails_after_the_replay_names_its_flag_and_file(tiny_trace: str,
                                                                     capsys) -> None:
    # it said only "[Errno 28] No space left on device"
    rc, table, err = _cli(["--trace", tiny_trace, "--capacities", "2", "--policies", "lru",
                           "--json", "/dev/full"], capsys)
    assert rc == 2 and "Traceback" not in err and "lru" in table  # the results were printed
    assert err.splitlines()[-1] == "error: cannot write --json /dev/full: No space left on device"


def test_the_module_entry_point_gives_one_line_errors(tmp_path) -> None:
    # `python -m tierlm.bench.cache` printed a traceback where `tierlm bench cache` prints a line
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tierlm.bench.cache", "--trace", str(tmp_path / "none.jsonl"),
                        "--json", str(tmp_path / "o.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [
        next(ln for ln in r.stderr.splitlines() if ln.startswith("error:"))]
    assert "none.jsonl" in r.stderr


@pytest.mark.skipif(not os.path.exists(f"{TRACES}/synthetic_trace.jsonl"), reason="no traces")
def test_real_traces_infinite_bounds() -> None:
    """README: at most 36.6% (conversation) and 64.0% (synthetic) of references can hit."""
    for name, expected in [("conversation_trace", 0.366), ("synthetic_trace", 0.640)]:
        hits, refs = infinite_hit_bound(load_trace(f"{TRACES}/{name}.jsonl"))
        assert round(hits / refs, 3) == expected
    syn = load_trace(f"{TRACES}/synthetic_trace.jsonl")
    r = simulate(syn, "lru", capacity=50_000)  # > 43,924 unique blocks: nothing is evicted
    assert round(r.hit_rate, 3) == 0.640


def test_capacity_axis_labels_are_the_capacities_and_do_not_run_together() -> None:
    # within one decade matplotlib labelled minor ticks as well: "3×10²4×10²" ran together
    import matplotlib.pyplot as plt

    from tierlm.bench.plots import _draw_lines

    fig, ax = plt.subplots()
    _draw_lines(ax, {"lru": ([50, 200, 800], [0.1, 0.2, 0.3]), "arc": ([50, 200, 800], [0.1, 0.2, 0.4])},
                "capacity", "hit rate", logx=True, markers=True)
    fig.canvas.draw()
    shown = [t.get_text() for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True)
             if t.get_text()]
    plt.close(fig)
    assert shown == ["50", "200", "800"]


def test_every_plot_with_a_log_axis_draws(tmp_path) -> None:
    # the tick-labelling change reached cdf_plot too, where it named a variable cdf_plot lacks:
    # every `bench serve` (latency CDFs on a log axis) crashed before writing its JSON
    from tierlm.bench.plots import cdf_plot, line_plot

    cdf = cdf_plot(str(tmp_path / "cdf.png"), {"TTFT": [3.0, 40.0, 500.0], "none": []}, title="t", xlabel="ms",
                   logx=True)
    line = line_plot(str(tmp_path / "line.png"), {"a": ([1, 10, 100], [0.1, 0.2, 0.3])}, title="t", xlabel="x",
                     ylabel="y", logx=True)
    assert os.path.getsize(cdf) > 0 and os.path.getsize(line) > 0


def test_an_output_that_is_a_dangling_link_is_written_through_the_link(tiny_trace: str, tmp_path, capsys) -> None:
    # the check opened the link (creating its target empty), then removed the link itself: the
    # JSON landed in a plain file where the link was, and the target stayed empty
    link, target = tmp_path / "latest.json", tmp_path / "runs" / "r1.json"
    target.parent.mkdir()
    link.symlink_to(target)
    rc, _, err = _cli(["--trace", tiny_trace, "--capacities", "2", "--policies", "lru", "--json", str(link)], capsys)
    assert rc == 0, err
    assert link.is_symlink() and json.loads(target.read_text())["capacities"] == [2]
