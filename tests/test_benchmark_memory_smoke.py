"""Smoke run of the memory benchmark (--quick): every configuration measured, the derived totals are
the per-unit figures times the counts, the process counts are right and nothing is left running."""

import os
from pathlib import Path

import pytest

from _benchmarks import run_quick
from torchdata_overlord.runtime.procstats import process_running as alive

KEYS = ("peak", "peak_running", "steady")


@pytest.mark.slow
def test_memory_quick_measures_both_sides_and_derives_the_totals(tmp_path):
    data, _ = run_quick("memory", tmp_path / "m.json", "--root", str(tmp_path / "corpus"), timeout=300)
    assert data["benchmark"] == "memory" and data["quick"] and not data["errors"]
    cfg, batch = data["config"], data["config"]["global_batch"]

    # every measured configuration is there, with positive figures and the right processes
    col = {(m["sources"], m["workers"], m["batch"]): m for m in data["colocated_measured"]}
    assert set(col) == {(s, w, batch // d) for s in cfg["sources"] for d, w in cfg["dw"]}
    for (s, w, _), m in col.items():
        assert m["processes"] == 1 + w and len(set(m["pids"])) == 1 + w, m["pids"]
        assert all(m["per_rank_mib"][k] > 0 for k in KEYS)
        assert m["per_rank_mib"]["peak"] >= m["per_rank_mib"]["steady"]
    lib = {(m["sources"], m["dp"]): m for m in data["library_measured"]}
    assert set(lib) == {(s, d) for s in cfg["library_sources"] for d in {d for d, _ in cfg["dw"]}} | \
        {tuple(x) for x in cfg["library_extra"]}
    for (s, d), m in lib.items():
        assert m["counts"]["planner"] == 1 and m["counts"]["loader"] == s and m["counts"]["constructor"] == d
        # the default placement: as many processes as the cores the trainer leaves free, at most one per role
        assert m["role_processes"] == max(1, min(1 + s + d, len(os.sched_getaffinity(0)) - 1)) == \
            len(set(m["roles"].values()))
        assert m["counts"]["helpers"] >= 1                      # the fork server (and the resource tracker)
        assert all(m["plane_mib"][k] > 0 and m["client_mib"][k] > 0 for k in KEYS)
        assert m["total_mib"]["steady"] == pytest.approx(m["plane_mib"]["steady"] + m["client_mib"]["steady"], abs=0.2)
    s_lo, s_hi, d0 = min(cfg["library_sources"]), max(cfg["library_sources"]), cfg["dw"][0][0]
    assert lib[s_hi, d0]["plane_mib"]["steady"] > lib[s_lo, d0]["plane_mib"]["steady"]   # each source holds its reads

    # every (S, D, W, CP, PP) row, derived from the per-unit fields
    rows = {(r["sources"], r["dp"], r["workers"], r["cp"], r["pp"]): r for r in data["rows"]}
    assert set(rows) == {(s, d, w, cp, pp) for s in cfg["sources"] for d, w in cfg["dw"] for cp, pp in cfg["cp_pp"]}
    for (s, d, w, cp, pp), r in rows.items():
        ranks = d * cp * pp
        assert r["ranks"] == ranks and r["colocated_processes"] == ranks * (1 + w)
        unit = col[s, w, batch // d]["per_rank_mib"]
        if (s, d) in lib:
            plane, client = lib[s, d]["plane_mib"], lib[s, d]["client_mib"]
            assert r["library_roles"] == "measured"
        else:
            fit = data["library_fit"]
            line = lambda part, k: sum(v * {"intercept": 1, "per_source": s, "per_dp": d}[n]  # noqa: E731
                                       for n, v in fit[part][k]["coef"].items())
            plane, client = ({k: line(part, k) for k in KEYS} for part in ("plane", "client"))
            assert r["library_roles"] == ("fitted" if s <= max(m for m, _ in lib) else "extrapolated")
        for k in KEYS:
            assert r["colocated_mib"][k] == pytest.approx(ranks * unit[k], abs=0.1)
            assert r["library_mib"][k] == pytest.approx(plane[k] + ranks * client[k], abs=0.2 + 0.1 * ranks)
            assert r["ratio"][k] == pytest.approx(r["colocated_mib"][k] / r["library_mib"][k], abs=0.01)
    assert {(c["dp"], c["workers"], c["cp"], c["pp"]) for c in data["crossover"]} == \
        {(d, w, cp, pp) for d, w in cfg["dw"] for cp, pp in cfg["cp_pp"]}

    # no process of any run is left, and the plot exists
    pids = {p for m in data["colocated_measured"] + data["library_measured"] for p in m["pids_seen"]}
    assert pids and not [p for p in pids if alive(p) and p != os.getpid()]
    assert Path(data["plot"]).exists() and Path(data["plot"]).stat().st_size > 0
