"""`tierlm bench kv-dtype` end to end at tiny scale: the same prompts under the model's KV dtype
and fp8 in one pool size, and through transformers; fp8 holds twice the bf16 tokens, so more
requests run at once and none is preempted where the bf16 pool had to."""
from __future__ import annotations

import json
import shutil

import pytest

from tierlm.cli import main


@pytest.fixture
def bf16_llama_dir(llama_dir, tmp_path):
    """The tiny Llama, declared bf16 (loaded as bf16; its KV cache bf16 under "auto")."""
    path = tmp_path / "llama-bf16"
    shutil.copytree(llama_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_bench_kv_dtype_tiny(bf16_llama_dir, tmp_path):
    out, plot = tmp_path / "kv.json", tmp_path / "kv.png"
    rc = main(["bench", "kv-dtype", "--model", str(bf16_llama_dir), "--prompts", "6", "--prompt-len", "40",
               "--max-tokens", "8", "--fit-seqs", "2", "--accuracy-prompts", "2", "--tier-prefix-len", "40",
               "--tier-repeats", "1", "--repeat", "2", "--device", "cpu", "--kv-dtypes", "auto,fp8,fp8:checkpoint",
               "--json", str(out), "--plot", str(plot)])
    assert rc == 0
    res = json.loads(out.read_text())
    auto, fp8, unscaled = res["results"]
    assert unscaled["kv_cache_dtype"] == "fp8:checkpoint" and unscaled["kv_scales"] is None
    assert auto["kv_scales"] is None and len(fp8["kv_scales"]) == 2  # calibrated, per layer
    assert unscaled["pool_tokens"] == fp8["pool_tokens"] and unscaled["top1_agreement_vs_auto"] <= 1
    assert (auto["kv_cache_dtype"], auto["kv_dtype"], fp8["kv_dtype"]) == ("auto", "bfloat16", "float8_e4m3fn")
    assert fp8["pool_tokens"] == 2 * auto["pool_tokens"] and fp8["capacity_vs_auto"] == 2
    assert auto["pool_bytes"] == fp8["pool_bytes"] <= res["kv_cache_memory"]
    assert fp8["bytes_per_token"] * 2 == auto["bytes_per_token"]
    assert auto["peak_running"] == 2 and fp8["peak_running"] == 4  # 3 blocks each: 6 blocks, or 12 in fp8
    for r in (auto, fp8):
        assert r["output_tokens"] == 6 * 8
        assert r["ratio_vs_auto"] == r["tok_per_s"] / auto["tok_per_s"]
        assert r["ratio_vs_hf"] == r["tok_per_s"] / res["hf"]["tok_per_s"]
        assert r["teacher_forced_positions"] == 2 * (40 + 8 - 1)
        assert r["seconds"] == min(r["runs_seconds"]) and len(r["runs_seconds"]) == 2
    assert auto["identical_to_auto"] == 6 and auto["top1_agreement_vs_auto"] == 1.0
    assert auto["mean_abs_logprob_diff_vs_auto"] == 0.0
    assert 0 <= fp8["top1_agreement_vs_auto"] <= 1 and fp8["mean_abs_logprob_diff_vs_auto"] > 0
    for r in (auto, fp8):  # 40 + 32 tokens, the prefix's 2 full blocks of 16 from host memory, then disk
        assert r["tiers"]["cached_tokens"] == {"cold": [0], "host": [32], "disk": [32]}
        assert r["tier_ttft_vs_auto"]["disk"] == r["tiers"]["ttft_s"]["disk"] / auto["tiers"]["ttft_s"]["disk"]
    assert fp8["tiers"]["promoted_bytes_per_hit"] * 2 == auto["tiers"]["promoted_bytes_per_hit"] > 0
    assert res["hf"]["output_tokens"] == 6 * 8 and res["hf"]["bytes_per_token"] > 0
    assert plot.stat().st_size > 1000


@pytest.mark.parametrize("bad", ["fp8,auto", "auto,fp8:none", "auto,int8"])
def test_bench_kv_dtype_refuses_a_list_without_auto_first_or_with_unknown_names(llama_dir, tmp_path, capsys, bad):
    rc = main(["bench", "kv-dtype", "--model", str(llama_dir), "--kv-dtypes", bad, "--json",
               str(tmp_path / "x.json")])
    assert rc == 2 and "--kv-dtypes must start with auto" in capsys.readouterr().err
