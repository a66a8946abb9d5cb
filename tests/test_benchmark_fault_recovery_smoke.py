"""Smoke run of the fault recovery benchmark (--quick): every scenario runs, the stream survives."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_fault_recovery_quick_runs_every_scenario(tmp_path):
    out = tmp_path / "fault.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fault_recovery.py"), "--quick", "--out", str(out),
                           "--root", str(tmp_path / "corpus")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "fault_recovery" and data["quick"] and not data["errors"]
    res = data["results"]
    assert set(res) == {"planner_p2", "planner_p4", "loaders_p2"}
    for name, r in res.items():
        assert r["same_stream_as_no_failure"] is True, name
        assert len(r["waits_ms"]) == data["config"]["steps"] and r["recoveries"], name
    assert len([e for e in res["loaders_p2"]["recoveries"] if e["how"] == "promoted its shadow"]) == 5
    cost = data["shadow_cost"]
    assert cost["shadows_on"]["shadow_processes"] == 10 and cost["shadows_off"]["shadow_processes"] == 0
    assert cost["shadows_on"]["pss_shadows_mib"] > 0
    assert Path(data["plot"]).exists()
