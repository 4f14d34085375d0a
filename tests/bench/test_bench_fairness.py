"""`tierlm bench fairness` runs end to end at tiny scale; its step counts are deterministic."""
from __future__ import annotations

import json

from tierlm.cli import main


def test_bench_fairness_tiny(llama_dir, tmp_path):
    out = tmp_path / "fair.json"
    rc = main(["bench", "fairness", "--model", str(llama_dir), "--dtype", "float32", "--flood", "12",
               "--light-tenants", "2", "--light-requests", "1", "--prompt-len", "16", "--max-tokens", "4",
               "--max-num-seqs", "4", "--repeats", "1", "--hog", "6", "--hog-prompt-len", "64",
               "--hog-max-tokens", "64", "--kv-blocks", "32", "--light-arrival-step", "6",
               "--gold-prefixes", "2", "--gold-prefix-len", "32", "--rounds", "8", "--flood-per-round", "4",
               "--flood-prompt-len", "64", "--eviction-policies", "lru,duel",
               "--json", str(out), "--plot", str(tmp_path / "fair.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    fcfs, fair = res["results"]
    assert (fcfs["policy"], fair["policy"]) == ("fcfs", "fair")
    # The same work in the same number of steps; only who goes first changes.
    assert fcfs["steps"] == fair["steps"] and res["ratios"]["steps_fair_over_fcfs"] == 1.0
    # First come first served: the light tenants' first tokens wait for all twelve flood requests
    # (three waves of four, four steps each: a prefill and three decodes); fair shares start both
    # light requests in the first wave, beside the flood's first two.
    assert fcfs["light_ttft_mean_steps"] > 3 * 4
    assert fair["light_ttft_mean_steps"] == 1
    assert res["ratios"]["light_ttft_steps_fcfs_over_fair"] == fcfs["light_ttft_mean_steps"] / fair["light_ttft_mean_steps"]
    assert fcfs["max_service_gap"] > fair["max_service_gap"]
    assert len(res["samples"]["fair"]) == 1
    # The KV hog: without a quota it fills the pool and the light tenants wait for room; with
    # kv_share 0.5 it holds at most half and they start at once.
    none, quota = res["kv_quota"]["results"]
    assert (none["kv_share"], quota["kv_share"]) == (None, 0.5)
    assert none["pool_blocks"] == quota["pool_blocks"] == 32
    assert none["hog_peak_blocks"] > 16 >= quota["hog_peak_blocks"]
    assert quota["light_ttft_mean_steps"] < none["light_ttft_mean_steps"]
    assert (tmp_path / "fair.png").stat().st_size > 1000
    # The cache flood: 4 x 64 new tokens a round turn the 32-block pool over between two uses of a
    # gold prefix, so under LRU gold's prefixes are mostly gone each time; in a partition (0.3: 9 blocks
    # for two 2-block prefixes) every warm gold prompt finds its whole prefix (32 of 48 tokens).
    part = res["cache_partition"]
    assert [c["policy"] for c in part["by_policy"]] == ["lru", "duel"]
    for c in part["by_policy"]:
        none, kept = c["results"]
        assert (none["kv_cache_share"], kept["kv_cache_share"]) == (None, 0.3)
        assert kept["gold_hit_share"] == 32 / 48 and kept["gold_hit_share"] > none["gold_hit_share"]
    assert part["by_policy"][0]["results"][0]["gold_hit_share"] < 0.5 * 32 / 48


def test_bench_fairness_runs_only_the_parts_named(llama_dir, tmp_path, capsys):
    out = tmp_path / "cache.json"
    rc = main(["bench", "fairness", "--model", str(llama_dir), "--dtype", "float32", "--repeats", "1",
               "--parts", "cache", "--kv-blocks", "32", "--gold-prefixes", "2", "--gold-prefix-len", "32",
               "--rounds", "4", "--flood-per-round", "2", "--flood-prompt-len", "64", "--eviction-policies", "lru",
               "--json", str(out), "--plot", str(tmp_path / "cache.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["parts"] == ["cache"] and "results" not in res and "kv_quota" not in res
    assert [c["policy"] for c in res["cache_partition"]["by_policy"]] == ["lru"]
    assert (tmp_path / "cache.png").stat().st_size > 1000
    try:
        main(["bench", "fairness", "--parts", "cache,speed", "--json", str(out)])
    except SystemExit as e:
        assert e.code == 2
    assert "give parts from fairness, kv, cache (got 'cache,speed')" in capsys.readouterr().err
