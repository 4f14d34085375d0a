"""`tierlm bench batches` end to end at tiny scale: a fresh demo-model server per mode, background
work that fills its 2 running slots, sent as ordinary requests and as a batch (Anthropic's message
batch; OpenAI's uploaded file and /v1/batches batch)."""
from __future__ import annotations

import json

import pytest

from tierlm.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_bench_batches_tiny(tmp_path, api):
    out = tmp_path / "batches.json"
    rc = main(["bench", "batches", "--api", api, "--background", "12", "--background-tokens", "24", "--concurrency", "4",
               "--max-num-seqs", "2", "--interactive", "4", "--rate", "4", "--warmup", "0.5", "--json", str(out),
               "--plot", str(tmp_path / "b.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["mode"] for r in res["runs"]] == ["plain", "batch"]
    assert (tmp_path / "b.png").stat().st_size > 0
    for r in res["runs"]:
        assert r["background_s"] > 0 and r["ttft_ms"]["mean"] > 0 and r["ttft_ms"]["p90"] >= r["ttft_ms"]["p50"]
    plain, batch = res["summary"]["plain"], res["summary"]["batch"]
    assert res["vs_peer"]["ttft_mean_speedup"] == pytest.approx(plain["ttft_mean_ms"] / batch["ttft_mean_ms"])
    assert res["vs_peer"]["background_time_ratio"] == pytest.approx(batch["background_s"] / plain["background_s"])
    assert res["max_num_seqs"] == 2 and res["background"] == 12 and res["api"] == api  # (the speed-up itself is the benchmark's to
    # report, not a timed assertion here; test_batches.py checks the order on a one-slot engine)
