"""`tierlm bench limits` end to end at tiny scale: two real servers per mode, a tenant of 60
requests a minute asked as fast as 6 clients can, through a redis-server the benchmark starts."""
from __future__ import annotations

import json

import pytest

from tierlm.cli import main

pytestmark = pytest.mark.slow


def test_bench_limits_tiny(tmp_path, redis_server):
    out = tmp_path / "limits.json"
    rc = main(["bench", "limits", "--servers", "2", "--seconds", "2", "--workers", "6", "--overhead-requests", "12",
               "--admissions", "50", "--limits-store", redis_server.url, "--json", str(out),
               "--plot", str(tmp_path / "l.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["mode"] for r in res["runs"]] == ["per_server", "shared"]
    assert (tmp_path / "l.png").stat().st_size > 0
    per_server, shared = res["runs"]
    for r in res["runs"]:
        assert r["errors"] == 0 and r["overhead_requests"] == 12 and r["refused"] > 0
        assert r["allowed"] == pytest.approx(60 * (1 + r["elapsed_s"] / 60))
    # each server alone lets its own 60 (and the refill) through; together they hold the one bound
    assert per_server["admitted"] > 1.5 * per_server["allowed"]
    assert min(per_server["admitted_per_server"]) >= 60
    assert 60 <= shared["admitted"] <= shared["allowed"] + 1
    assert res["vs_peer"]["over_admission_shared"] == pytest.approx(shared["admitted_over_allowed"])
    assert res["summary"]["shared"]["admission_us"] > 0 and res["summary"]["per_server"]["admission_us"] > 0


def test_bench_limits_refuses_a_bad_store_url(tmp_path, capsys):
    assert main(["bench", "limits", "--limits-store", "redis://h:1/x", "--json", str(tmp_path / "l.json")]) == 2
    err = capsys.readouterr().err
    assert "error: --limits-store 'redis://h:1/x': the path names the database and must be a number" in err
