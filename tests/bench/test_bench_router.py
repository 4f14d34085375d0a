"""`tierlm bench router` end to end at tiny scale: a made-up trace of conversations (each turn
extends the one before), two replica processes per policy, started fresh for each run."""
from __future__ import annotations

import json

import pytest

from tierlm.cli import main

pytestmark = pytest.mark.slow


def _trace(path, conversations: int = 3, turns: int = 4) -> None:
    rows, next_id, t = [], 0, 0
    chains = [[] for _ in range(conversations)]
    for turn in range(turns):
        for c in range(conversations):
            chains[c] = chains[c] + list(range(next_id, next_id + 3))  # three new blocks a turn
            next_id += 3
            rows.append({"timestamp": t, "input_length": 512 * len(chains[c]), "output_length": 2,
                         "hash_ids": list(chains[c])})
            t += 400
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_bench_router_tiny(tmp_path):
    trace = tmp_path / "conv.jsonl"
    _trace(trace)
    out = tmp_path / "router.json"
    rc = main(["bench", "router", "--trace", str(trace), "--num-prompts", "12", "--policies", "cache_aware",
               "--trace-time-scale", "1", "--trace-max-output", "2", "--max-model-len", "512",
               "--kv-cache-memory", "16MiB", "--no-progress", "--json", str(out), "--plot", str(tmp_path / "r.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["policy"] for r in res["runs"]] == ["cache_aware", "round_robin"]  # the peer is always run
    assert (tmp_path / "r.png").stat().st_size > 0
    for r in res["runs"]:
        assert r["completed"] == 12 and r["failed"] == 0
        assert r["computed_prompt_tokens"] == r["prompt_tokens"] - r["total_cached_tokens"]
        assert sum(r["router"]["requests_per_replica"]) == 12
    aware, rr = (res["summary"][p] for p in ("cache_aware", "round_robin"))
    # each conversation stays on one replica and reads its earlier turns from the cache; round
    # robin sends each turn to the other replica than the turn before
    assert aware["cached_share"] > rr["cached_share"]
    assert aware["computed_prompt_tokens"] < rr["computed_prompt_tokens"]
    assert res["vs_peer"]["cache_aware"]["computed_prompt_tokens"] == pytest.approx(
        aware["computed_prompt_tokens"] / rr["computed_prompt_tokens"])
    assert res["runs"][0]["router"]["decisions"].get("affinity", 0) >= 6  # turns 2-4 of 3 conversations
    assert res["follow_ups"] == 9  # turns 2-4: at least half of each prompt is the turn before
    assert all(r["follow_ups"] == 9 and r["follow_up_ttft_ms"]["mean"] > 0 for r in res["runs"])
    assert set(res["summary"]["cache_aware"]) >= {"follow_up_ttft_mean_ms", "ttft_p90_ms", "cached_share"}
