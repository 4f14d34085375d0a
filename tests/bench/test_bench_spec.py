"""`tierlm bench spec` end to end at tiny scale: tierlm with and without n-gram speculation and
transformers with and without prompt lookup run the same greedy prompts; speculation changes
no answer, and the ratios are what the timings say."""
from __future__ import annotations

import json

from tierlm.cli import main


def test_bench_spec_tiny(llama_dir, tmp_path):
    out, plot = tmp_path / "spec.json", tmp_path / "spec.png"
    rc = main(["bench", "spec", "--model", str(llama_dir), "--prompts", "3", "--prompt-len", "24",
               "--max-tokens", "12", "--batches", "1,3", "--repeat", "2", "--prompt-lookup-min", "1",
               "--kv-cache-memory", str(4 << 20), "--device", "cpu", "--json", str(out), "--plot", str(plot)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [(r["workload"], r["batch"]) for r in res["results"]] == [
        ("repeat", 1), ("repeat", 3), ("random", 1), ("random", 3)]
    for r in res["results"]:
        for who in ("tierlm", "tierlm_spec", "hf", "hf_lookup"):
            assert r[who]["output_tokens"] == 3 * 12
        assert r["identical_answers"] == 3 and r["identical_to_hf"] == 3
        assert r["speedup"] == r["tierlm_spec"]["tok_per_s"] / r["tierlm"]["tok_per_s"]
        assert r["hf_speedup"] == r["hf_lookup"]["tok_per_s"] / r["hf"]["tok_per_s"]
        assert r["tierlm"]["draft_tokens"] == 0 < r["tierlm_spec"]["draft_tokens"]
        assert r["acceptance_rate"] == r["tierlm_spec"]["accepted_tokens"] / r["tierlm_spec"]["draft_tokens"]
        assert r["steps_saved"] == 1 - r["tierlm_spec"]["steps"] / r["tierlm"]["steps"]
        for who in ("tierlm", "tierlm_spec"):  # the best of the two runs
            assert r[who]["seconds"] == min(r[who]["runs_seconds"]) and len(r[who]["runs_seconds"]) == 2
    assert plot.stat().st_size > 1000
