"""Smoke run of the fault recovery benchmark (--quick): every scenario runs, the stream survives."""

from pathlib import Path

import pytest

from _benchmarks import run_quick


@pytest.mark.slow
def test_fault_recovery_quick_runs_every_scenario(tmp_path):
    out = tmp_path / "fault.json"
    data, _ = run_quick("fault_recovery", out, "--root", str(tmp_path / "corpus"), timeout=600)
    assert data["benchmark"] == "fault_recovery" and data["quick"] and not data["errors"]
    res = data["results"]
    assert set(res) == {"planner_p2", "planner_p4", "loaders_p2"}
    for name, r in res.items():
        assert r["same_stream_as_no_failure"] is True, name
        assert len(r["waits_ms"]) == data["config"]["steps"] and r["recoveries"], name
    many = data["config"]["sources_many"]
    assert len([e for e in res["loaders_p2"]["recoveries"] if e["how"] == "promoted its shadow"]) == many // 2
    cost = data["shadow_cost"]
    assert cost["shadows_on"]["shadow_processes"] == many and cost["shadows_off"]["shadow_processes"] == 0
    assert cost["shadows_on"]["pss_shadows_mib"] > 0
    assert Path(data["plot"]).exists()
