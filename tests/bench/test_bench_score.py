"""`tierlm bench score` runs end to end at tiny scale: both engines score the same prompts, agree
on every logprob, and the ratio is what the two timings say."""
from __future__ import annotations

import json

from tierlm.cli import main


def test_bench_score_tiny(llama_dir, tmp_path):
    out, plot = tmp_path / "score.json", tmp_path / "score.png"
    rc = main(["bench", "score", "--model", str(llama_dir), "--workload", "tiny", "--kv-cache-memory", str(4 << 20),
               "--repeat", "2", "--device", "cpu", "--json", str(out), "--plot", str(plot)])
    assert rc == 0
    res = json.loads(out.read_text())
    wl = res["workloads"]["tiny"]
    assert res["device"] == "cpu" and res["dtype"] == "float32" and wl["prompts"] == 6
    assert wl["tierlm"]["scored_tokens"] == wl["transformers"]["scored_tokens"] == wl["agreement"]["positions"] > 0
    assert wl["agreement"]["max_abs_diff"] < 1e-3  # the same scores, not just the same speed
    assert wl["ratio"] == wl["tierlm"]["scored_tok_per_s"] / wl["transformers"]["scored_tok_per_s"]
    for who in ("tierlm", "transformers"):  # best of the two alternating runs is the one reported
        assert len(wl[who]["runs_seconds"]) == 2 and wl[who]["seconds"] == min(wl[who]["runs_seconds"])
    assert plot.stat().st_size > 1000
