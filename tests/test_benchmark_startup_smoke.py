"""Smoke run of the start-up benchmark (--quick): every figure is there, and a warm start reads no footer."""

import pytest

from _benchmarks import run_quick

FIRST = [f"first_{r}_{t}" for r in ("local", "rpc") for t in ("cold", "warm")]


@pytest.mark.slow
def test_startup_quick_measures_every_figure_and_warm_starts_read_no_footer(tmp_path):
    data, proc = run_quick("startup", tmp_path / "s.json", "--root", str(tmp_path / "corpus"), "--files", "1000",
                           timeout=300)
    assert data["benchmark"] == "startup" and data["quick"] and not data["errors"]
    runs, files = data["runs"], data["config"]["files"]
    many = [f"many_{r}_{s}" for r in ("local", "rpc") for s in data["config"]["sources"]]
    assert files == 1000 and set(runs) == {"construct_cold", "construct_warm", *FIRST, *many,
                                           *(f"many_rpc_{s}_cold" for s in data["config"]["sources"])}
    cold, warm, spec = runs["construct_cold"], runs["construct_warm"], runs["construct_warm"]["spec"]
    assert cold["files"] == warm["files"] == files and cold["footers_read"] == files
    assert warm["footers_read"] == 0 and spec["footers_read"] == 0             # the journal, then the spec
    assert cold["seconds"] > 0 and warm["seconds"] > 0 and warm["state_dict_s"] >= 0
    assert spec["spec_mib"] > spec["file_table_mib"] > 0 and spec["rebuild_s"] > 0 and spec["pickle_s"] > 0
    for name in FIRST:
        r = runs[name]
        assert r["files"] == files and r["footers_read"] == (files if name.endswith("cold") else 0), name
        assert 0 < r["open_s"] < r["total_s"] and r["loader_s"] >= r["construct_s"] > 0, name
        assert (r["processes"] == 1) if "local" in name else (r["processes"] >= 2), name
    for s in data["config"]["sources"]:
        assert runs[f"many_local_{s}"]["sources"] == runs[f"many_rpc_{s}"]["sources"] == s
        assert runs[f"many_rpc_{s}_cold"]["sources"] == s and runs[f"many_rpc_{s}_cold"]["processes"] >= 2
    assert set(data["verdict"]) == {"local_warm_meets_target", "rpc_warm_meets_target"}
    assert "footers read" in proc.stdout and data["machine"]["cores"] >= 1
