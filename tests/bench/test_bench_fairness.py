"""`tierlm bench fairness` runs end to end at tiny scale; its step counts are deterministic."""
from __future__ import annotations

import json

from tierlm.cli import main


def test_bench_fairness_tiny(llama_dir, tmp_path):
    out = tmp_path / "fair.json"
    rc = main(["bench", "fairness", "--model", str(llama_dir), "--dtype", "float32", "--flood", "12",
               "--light-tenants", "2", "--light-requests", "1", "--prompt-len", "16", "--max-tokens", "4",
               "--max-num-seqs", "2", "--repeats", "1", "--json", str(out), "--plot", str(tmp_path / "fair.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    fcfs, fair = res["results"]
    assert (fcfs["policy"], fair["policy"]) == ("fcfs", "fair")
    # The same work in the same number of steps; only who goes first changes.
    assert fcfs["steps"] == fair["steps"] and res["ratios"]["steps_fair_over_fcfs"] == 1.0
    # First come first served: the light tenants' first tokens wait for all twelve flood requests
    # (six waves of two, four steps each: a prefill and three decodes); fair shares start one light
    # request in the first wave (first token in step 1) and the other in the second (step 5).
    assert fcfs["light_ttft_mean_steps"] > 6 * 4
    assert fair["light_ttft_mean_steps"] == (1 + 5) / 2
    assert res["ratios"]["light_ttft_steps_fcfs_over_fair"] == fcfs["light_ttft_mean_steps"] / fair["light_ttft_mean_steps"]
    assert fcfs["max_service_gap"] > fair["max_service_gap"]
    assert len(res["samples"]["fair"]) == 1
    assert (tmp_path / "fair.png").stat().st_size > 1000
