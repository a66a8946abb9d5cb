"""Smoke run of the elastic-resume benchmark (--quick): both runtimes resume at another mesh, and the
figures are there."""

import pytest

from _benchmarks import run_quick


@pytest.mark.slow
def test_elastic_quick_resumes_at_another_mesh_in_both_runtimes(tmp_path):
    data, proc = run_quick("elastic", tmp_path / "e.json", "--root", str(tmp_path / "corpus"), timeout=400)
    assert data["benchmark"] == "elastic" and data["quick"] and not data["errors"]
    s = data["config"]["sources"][0]
    assert set(data["runs"]) == {f"local_{s}", f"rpc_{s}"}
    for r in data["runs"].values():
        e, same = r["elastic"], r["same"]
        assert e["step"] == same["step"] == data["config"]["steps"]            # both continue at the saved step
        assert any(c.startswith("mesh: saved pp=1 dp=4") for c in e["changes"]) and same["changes"] == []
        assert any(c.startswith("global_batch: saved 64, now 48") for c in e["changes"])
        assert 0 <= e["load_s"] < e["total_s"] and same["total_s"] > 0 and r["state_bytes"] > 0
    assert "elastic" in proc.stdout and data["machine"]["cores"] >= 1
