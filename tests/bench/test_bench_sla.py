"""`tierlm bench sla` runs end to end at tiny scale: one arrival list replayed in every run,
nothing shed without the guard, every arrival either served (by the big model or, in the
fallback run only, the small one) or shed, the ratios from the figures; `--no-fallback` skips
the fallback run. The small demo checkpoint it falls back to by default shares the demo vocabulary."""
from __future__ import annotations

import json
import os

import pytest

from tierlm.cli import main

ALL_RUNS = ["no_guard", "guard", "guard_breaker", "guard_breaker_fallback"]


def _bench(tmp_path, llama_dir, *extra: str) -> dict:
    out = tmp_path / "sla.json"
    rc = main(["bench", "sla", "--model", str(llama_dir), "--dtype", "float32", "--overload", "3",
               "--calibration-requests", "4", "--prompt-len", "16", "--max-tokens", "4",
               "--gold-target-ms", "50", "--bronze-target-ms", "100", "--json", str(out),
               "--plot", str(tmp_path / "sla.png"), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def _check_runs(res: dict) -> None:
    results, ratios = res["results"], res["ratios"]
    assert list(results) == res["runs"] == list(res["breaker_trips"])
    assert res["rate_rps"] == res["overload"] * res["capacity_rps"] > 0
    off = results["no_guard"]
    assert sum(off[t]["arrived"] for t in off) > 0
    for run, tiers in results.items():
        assert set(tiers) == {"gold", "bronze"}
        if "breaker" not in run:
            assert res["breaker_trips"][run] == 0
        for tier, s in tiers.items():
            assert s["arrived"] == off[tier]["arrived"]  # one arrival list, replayed in every run
            assert s["served"] + s["shed"] == s["arrived"]
            assert s["met_target"] <= s["served"]
            assert 0 <= s["served_by_fallback"] <= s["served"]
            assert 0 <= s["shed_by_breaker"] <= s["shed"]
            if "fallback" not in run:
                assert s["served_by_fallback"] == 0
            if "breaker" not in run:
                assert s["shed_by_breaker"] == 0
            assert s["goodput_rps"] == s["met_target"] / res["duration_s"]
    for tier in ("gold", "bronze"):
        assert off[tier]["shed"] == 0 and off[tier]["served"] == off[tier]["arrived"]
    pairs = [(run, "no_guard") for run in res["runs"][1:]] + list(zip(res["runs"][2:], res["runs"][1:]))
    expected = {}
    for run, base in pairs:
        for tier in ("gold", "bronze"):
            den = results[base][tier]["goodput_rps"]
            expected[f"{tier}_goodput_{run}_over_{base}"] = results[run][tier]["goodput_rps"] / den if den else None
    assert ratios == expected
    assert "gold_goodput_guard_over_no_guard" in ratios and "bronze_goodput_guard_breaker_over_guard" in ratios


def test_bench_sla_tiny_with_fallback(llama_dir, tmp_path):
    res = _bench(tmp_path, llama_dir, "--duration", "1.5", "--fallback-model", str(llama_dir))
    assert res["runs"] == ALL_RUNS
    assert res["fallback_model"] == str(llama_dir)
    assert "gold_goodput_guard_breaker_fallback_over_guard_breaker" in res["ratios"]
    _check_runs(res)
    assert (tmp_path / "sla.png").stat().st_size > 1000


def test_bench_sla_no_fallback_with_a_slowdown(llama_dir, tmp_path):
    res = _bench(tmp_path, llama_dir, "--duration", "0.5", "--no-fallback", "--slowdown", "2")
    assert res["runs"] == ALL_RUNS[:3] and res["fallback_model"] is None
    assert res["slowdown"] == 2 and res["slowdown_at_s"] == 0.25
    assert not any("fallback" in k for k in res["ratios"])
    _check_runs(res)
    assert (tmp_path / "sla.png").stat().st_size > 1000


def test_fallback_flags_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "sla", "--no-fallback", "--fallback-model", str(tmp_path), "--json", str(tmp_path / "x.json")])
    assert "not allowed with" in capsys.readouterr().err


def test_small_demo_model_shares_the_demo_vocabulary(tmp_path):
    from tierlm.models.demo import build_demo_model
    small = json.loads((build_demo_model(tmp_path / "small", "small") / "config.json").read_text())
    dense = json.loads((build_demo_model(tmp_path / "dense", "dense") / "config.json").read_text())
    assert (small["num_hidden_layers"], small["hidden_size"], small["intermediate_size"]) == (2, 128, 384)
    assert small["vocab_size"] == dense["vocab_size"]
    assert os.path.getsize(tmp_path / "small" / "model.safetensors") < os.path.getsize(tmp_path / "dense" / "model.safetensors")
