"""`tierlm bench sla` runs end to end at tiny scale: the same arrivals both ways, nothing shed
without the guard, every arrival either served or shed, the ratios from the figures."""
from __future__ import annotations

import json

from tierlm.cli import main


def test_bench_sla_tiny(llama_dir, tmp_path):
    out = tmp_path / "sla.json"
    rc = main(["bench", "sla", "--model", str(llama_dir), "--dtype", "float32", "--duration", "1.5",
               "--overload", "3", "--calibration-requests", "4", "--prompt-len", "16", "--max-tokens", "4",
               "--gold-target-ms", "50", "--bronze-target-ms", "100", "--json", str(out),
               "--plot", str(tmp_path / "sla.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    off, on = res["results"]["no_guard"], res["results"]["guard"]
    assert res["rate_rps"] == res["overload"] * res["capacity_rps"] > 0
    for tier in ("gold", "bronze"):
        assert off[tier]["arrived"] == on[tier]["arrived"]  # one arrival list, replayed twice
        assert off[tier]["shed"] == 0 and off[tier]["served"] == off[tier]["arrived"]
        assert on[tier]["served"] + on[tier]["shed"] == on[tier]["arrived"]
        assert on[tier]["met_target"] <= on[tier]["served"]
        if off[tier]["goodput_rps"]:
            assert res["ratios"][f"{tier}_goodput_guard_over_no_guard"] == on[tier]["goodput_rps"] / off[tier]["goodput_rps"]
    assert sum(off[t]["arrived"] for t in off) > 0
    assert (tmp_path / "sla.png").stat().st_size > 1000
