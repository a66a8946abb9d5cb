"""Smoke run of the memory benchmark (--quick): every configuration measured at every row-group size,
the derived totals are the per-unit figures times the counts, the process counts and the default
placement are right, larger row groups cost more, and nothing is left running."""

import os
from pathlib import Path

import pytest

from _benchmarks import run_quick
from torchdata_overlord.runtime.procstats import process_running as alive

KEYS = ("peak", "peak_running", "steady")


@pytest.mark.slow
def test_memory_quick_measures_both_sides_and_derives_the_totals(tmp_path):
    data, _ = run_quick("memory", tmp_path / "m.json", "--root", str(tmp_path / "corpus"), timeout=480)
    assert data["benchmark"] == "memory" and data["quick"] and not data["errors"] and not data["skipped"]
    batch, sizes = data["config"]["global_batch"], data["sizes"]
    assert [z["row_group_mib"] for z in sizes] == data["config"]["row_group_mib"] and len(sizes) == 2
    for z in sizes:
        check_size(z, batch)

    # a row group 4x larger: 4x the rows, more held by the library's sources and by a colocated rank
    small, large = sizes
    assert large["config"]["rows_per_row_group"] > 3 * small["config"]["rows_per_row_group"]
    s = min(large["config"]["library_sources"])
    lib = {z["row_group_mib"]: next(m for m in z["library_measured"] if m["sources"] == s) for z in sizes}
    assert lib[large["row_group_mib"]]["held_by_sources_mib"] > 2 * lib[small["row_group_mib"]]["held_by_sources_mib"]
    col = {z["row_group_mib"]: next(m for m in z["colocated_measured"] if m["sources"] == s) for z in sizes}
    assert col[large["row_group_mib"]]["per_rank_mib"]["steady"] > col[small["row_group_mib"]]["per_rank_mib"]["steady"]

    # the quick sizes are not the issue's: no target is checked on them
    assert data["targets"] == []
    # no process of any run is left, and the plot exists
    pids = {p for z in sizes for m in z["colocated_measured"] + z["library_measured"] for p in m["pids_seen"]}
    assert pids and not [p for p in pids if alive(p) and p != os.getpid()]
    assert Path(data["plot"]).exists() and Path(data["plot"]).stat().st_size > 0


def check_size(z: dict, batch: int) -> None:
    cfg = z["config"]
    # every measured configuration is there, with positive figures and the right processes
    col = {(m["sources"], m["workers"], m["batch"]): m for m in z["colocated_measured"]}
    assert set(col) == {(s, w, batch // d) for s in cfg["sources"] for d, w in cfg["dw"]}
    for (s, w, _), m in col.items():
        assert m["how"] == "rank measured" and m["measured_workers"] == w
        assert m["processes"] == 1 + w and len(set(m["pids"])) == 1 + w, m["pids"]
        assert all(m["per_rank_mib"][k] > 0 for k in KEYS)
        assert m["per_rank_mib"]["peak"] >= m["per_rank_mib"]["steady"]
        assert set(m["anon_breakdown"]) == {str(p) for p in m["pids"]}
    lib = {(m["sources"], m["dp"]): m for m in z["library_measured"]}
    assert set(lib) == {(s, d) for s in cfg["library_sources"] for d in {d for d, _ in cfg["dw"]}} | \
        {tuple(x) for x in cfg["library_extra"]}
    for (s, d), m in lib.items():
        assert m["counts"]["planner"] == 1 and m["counts"]["loader"] == s and m["counts"]["constructor"] == d
        # the default placement: as many processes as the cores the trainer leaves free, at most one per role
        assert m["role_processes"] == max(1, min(1 + s + d, len(os.sched_getaffinity(0)) - 1)) == \
            len(set(m["roles"].values())) == m["placement"]["processes"]
        assert m["placement"]["method"] == "auto"
        assert set(m["placement"]["sources"]) == {f"s{i:03d}" for i in range(s)}
        assert m["counts"]["helpers"] >= 1                      # the fork server (and the resource tracker)
        assert all(m["plane_mib"][k] > 0 and m["client_mib"][k] > 0 for k in KEYS)
        assert m["total_mib"]["steady"] == pytest.approx(m["plane_mib"]["steady"] + m["client_mib"]["steady"], abs=0.2)
        # profiled beforehand into the journal the job read; the start-up to the first batch
        assert m["profile"]["sources"] == s and m["journal_entries_before"] == s
        assert 0 < m["startup_s"] < m["seconds"]
        # every process of the job, by what it hosts: the role processes host every actor
        hosted = {k: sum(p["actors"][k] for p in m["by_process"] if p["what"] == "roles") for k in m["counts"]
                  if k != "helpers"}
        assert hosted == {k: m["counts"][k] for k in hosted}
        assert all(p["anon_breakdown"]["threads"] >= 1 for p in m["by_process"] if p["what"] == "roles")
        assert m["buffered_samples"] > 0 and m["held_by_sources_mib"] > 0
    if len(cfg["library_sources"]) > 1:
        s_lo, s_hi, d0 = min(cfg["library_sources"]), max(cfg["library_sources"]), cfg["dw"][0][0]
        assert lib[s_hi, d0]["plane_mib"]["steady"] > lib[s_lo, d0]["plane_mib"]["steady"]   # each source holds its reads

    # every (S, D, W, CP, PP) row, derived from the per-unit fields
    rows = {(r["sources"], r["dp"], r["workers"], r["cp"], r["pp"]): r for r in z["rows"]}
    assert set(rows) == {(s, d, w, cp, pp) for s in cfg["sources"] for d, w in cfg["dw"] for cp, pp in cfg["cp_pp"]}
    for (s, d, w, cp, pp), r in rows.items():
        ranks = d * cp * pp
        assert r["ranks"] == ranks and r["colocated_processes"] == ranks * (1 + w)
        unit = col[s, w, batch // d]["per_rank_mib"]
        if (s, d) in lib:
            plane, client = lib[s, d]["plane_mib"], lib[s, d]["client_mib"]
            assert r["library_roles"] == "measured"
        else:
            fit = z["library_fit"]
            line = lambda part, k: sum(v * {"intercept": 1, "per_source": s, "per_dp": d}[n]  # noqa: E731
                                       for n, v in fit[part][k]["coef"].items())
            plane, client = ({k: line(part, k) for k in KEYS} for part in ("plane", "client"))
            assert r["library_roles"] == ("fitted" if s <= max(m for m, _ in lib) else "extrapolated")
        for k in KEYS:
            assert r["colocated_mib"][k] == pytest.approx(ranks * unit[k], abs=0.1)
            assert r["library_mib"][k] == pytest.approx(plane[k] + ranks * client[k], abs=0.2 + 0.1 * ranks)
            assert r["ratio"][k] == pytest.approx(r["colocated_mib"][k] / r["library_mib"][k], abs=0.01)
    assert {(c["dp"], c["workers"], c["cp"], c["pp"]) for c in z["crossover"]} == \
        {(d, w, cp, pp) for d, w in cfg["dw"] for cp, pp in cfg["cp_pp"]}


@pytest.mark.parametrize("free_gib, fits", [(3.8, True), (0.0001, False)])
def test_corpus_fits_a_small_disk_and_names_the_root_when_it_does_not(tmp_path, monkeypatch, free_gib, fits):
    """The benchmarks' corpus leaves 4 GiB free, or half a small disk: CI's disk had 3.8 GiB free and a
    fixed 4 GiB margin refused a 256 KiB corpus. A disk that truly cannot hold it is named, with --root."""
    import collections
    import shutil
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import memory

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(8 << 30, 0, int(free_gib * 2**30)))
    root = tmp_path / "corpus"
    if fits:
        manifest = memory.build_corpus(root, 2, 64 / 1024, 2, 2)
        assert len(manifest["files"]) == 2 and all(Path(root, f).is_file() for fs in manifest["files"] for f in fs)
    else:
        import re
        with pytest.raises(RuntimeError, match=re.escape(str(tmp_path)) + r": 2 row groups of 64 KiB do not fit .*"
                                               r"pass another --root"):
            memory.build_corpus(root, 2, 64 / 1024, 2, 2)
