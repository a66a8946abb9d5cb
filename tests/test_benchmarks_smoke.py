"""Smoke run of the end-to-end throughput benchmark: it runs every side (DataLoader, torchdata.nodes,
OverlordLoader) and writes a complete JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_e2e_throughput_quick_writes_both_sides_and_the_overhead(tmp_path):
    out = tmp_path / "e2e_throughput.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_throughput.py"), "--quick",
                           "--out", str(out), "--root", str(tmp_path / "corpus")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "e2e_throughput" and data["quick"] and data["scale"] == "test"
    assert not data["errors"]
    runs = data["runs"]
    for key in ("dataloader_serial", "dataloader", "torchdata_nodes", "overlord_serial", "overlord"):
        assert runs[key]["samples_per_s"] > 0 and runs[key]["tokens_per_s"] > 0, key
        assert runs[key]["samples"] == data["config"]["steps"] * data["config"]["global_batch"], key
    assert runs["dataloader"]["workers"] == runs["overlord"]["workers"] == data["config"]["workers"] >= 1
    nodes = runs["torchdata_nodes"]
    assert nodes["side"] == "torchdata.nodes" and nodes["workers"] == data["config"]["workers"]
    assert nodes["worker_kind"].startswith("processes")
    assert nodes["transform_s"] > 0 and set(nodes["mixture"]) == set(data["config"]["weights"])
    assert abs(sum(nodes["mixture"].values()) - 1) < 1e-9
    assert data["verdict"]["ratio_overlord_over_torchdata_nodes"] == pytest.approx(
        runs["overlord"]["samples_per_s"] / nodes["samples_per_s"])
    assert "torchdata.nodes" in proc.stdout
    assert runs["overlord"]["samples_per_step_ok"] and runs["overlord_serial"]["samples_per_step_ok"]
    ser = runs["overlord_serial"]
    assert ser["phases_s"]["transform"] > 0 and ser["transformed_samples"] > 0
    v = data["verdict"]
    assert v["overhead_fraction"] == ser["overhead_fraction"] > 0
    assert isinstance(v["meets_target"], bool)
    if not v["meets_target"]:
        assert data["profile"]["top_tottime"], "a missed target comes with its profile"
    m = data["machine"]
    assert m["cores"] >= 1 and m["memory_gib"] > 0 and data["date"]
    assert "overhead" in proc.stdout and "samples/s" in proc.stdout


def test_python_m_benchmarks_runs_the_chosen_scripts_and_reports_failures(tmp_path):
    # --quick writes its results to a new temporary folder, which it names: here, one under tmp_path
    ok = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "plan_speed"], capture_output=True,
                        text=True, timeout=300, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert "=== plan_speed: ok" in ok.stdout and "1/1 benchmarks ran" in ok.stdout
    out = Path(ok.stdout.rsplit("results in ", 1)[1].strip())
    assert out.parent == tmp_path and (out / "plan_speed.json").is_file()
    bad = subprocess.run([sys.executable, "-m", "benchmarks", "--only", "nonexistent"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
