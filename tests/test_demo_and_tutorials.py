"""The main demo, the tutorials and the benchmark smoke runs work as documented."""

import json
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_on_real_files_and_balances(capsys, tmp_path):
    from torchdata_overlord import demo

    out = demo.main(["--steps", "4", "--scale", "test", "--data", str(tmp_path), "--no-progress", "--show-plan",
                     "--mesh", "pp=2,dp=2,cp=2,tp=2", "--global-batch", "16", "--max-tokens", "4096"])
    text = capsys.readouterr().out
    assert out["steps"] == 4 and out["samples_per_s"] > 0 and out["tokens_per_s"] > 0
    for row in out["per_step"]:
        assert 1.0 <= row["balanced_max_mean"] <= row["arrival_max_mean"] + 1e-9
        assert row["mixture"]["max_abs_error"] < 1
    served = sum(s["served"] for s in out["stats"]["sources"].values())
    assert out["stats"]["step"] == 4                          # consumed steps, not prefetched ones
    assert 4 * 16 <= served <= (4 + 2) * 16                   # loaders ran ahead by at most prefetch=2 steps
    png = tmp_path / "demo_balance.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("web", "code", "long", "caps", "throughput", "module encoder:"):
        assert name in text


def test_demo_rejects_a_malformed_mesh_before_building_the_corpus(tmp_path):
    from torchdata_overlord import demo

    try:
        demo.main(["--mesh", "pp2,dp=4", "--data", str(tmp_path / "data")])
    except SystemExit as e:
        assert "--mesh" in str(e)
    else:
        raise AssertionError("a malformed --mesh must be refused")
    assert not (tmp_path / "data").exists()     # refused at once, not after a corpus build


def test_zigzag_tutorial_registers_a_working_balancer():
    ns = runpy.run_path(str(ROOT / "tutorials" / "zigzag_balancer.py"), run_name="tutorial")
    results = ns["main"]()
    assert set(results) == {"arrival", "zigzag", "greedy", "karmarkar_karp"}
    assert results["zigzag"] < results["arrival"]
    assert results["greedy"] <= results["zigzag"] + 1e-9


def test_plan_speed_benchmark_quick_writes_json(tmp_path):
    out = tmp_path / "plan_speed.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_speed.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert {r["method"] for r in data["rows"]} == {"greedy", "karmarkar_karp"}
    assert all(r["seconds_median"] > 0 for r in data["rows"])
