"""`tierlm bench score` and `bench embed` run end to end at tiny scale: both engines work on the
same prompts, agree on every value, and the ratio is what the two timings say."""
from __future__ import annotations

import json

import pytest

from tierlm.cli import main


@pytest.mark.parametrize("task, tokens", [("score", lambda lens: sum(lens) - len(lens)), ("embed", sum)])
def test_bench_score_and_embed_tiny(task, tokens, llama_dir, tmp_path):
    out, plot = tmp_path / f"{task}.json", tmp_path / f"{task}.png"
    rc = main(["bench", task, "--model", str(llama_dir), "--workload", "tiny", "--kv-cache-memory", str(4 << 20),
               "--repeat", "2", "--device", "cpu", "--json", str(out), "--plot", str(plot)])
    assert rc == 0
    res = json.loads(out.read_text())
    wl = res["workloads"]["tiny"]
    assert res["task"] == task and res["device"] == "cpu" and res["dtype"] == "float32" and wl["prompts"] == 6
    from tierlm.bench.score import make_workload
    lens = [len(p) for p in make_workload("tiny", 500).prompts]
    assert wl["tierlm"]["tokens"] == wl["transformers"]["tokens"] == tokens(lens)
    assert wl["agreement"]["values"] > 0 and wl["agreement"]["max_abs_diff"] < 1e-3  # the same numbers
    assert wl["ratio"] == wl["tierlm"]["tok_per_s"] / wl["transformers"]["tok_per_s"]
    for who in ("tierlm", "transformers"):  # best of the two alternating runs is the one reported
        assert len(wl[who]["runs_seconds"]) == 2 and wl[who]["seconds"] == min(wl[who]["runs_seconds"])
    assert plot.stat().st_size > 1000
