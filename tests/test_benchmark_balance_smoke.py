"""Smoke run of the balance benchmark (--quick): every configuration plans, balancing beats arrival order."""

from pathlib import Path

from _benchmarks import run_quick


def test_balance_quick_writes_figures_that_hold(tmp_path):
    out = tmp_path / "balance.json"
    data, proc = run_quick("balance", out, timeout=300)
    assert data["benchmark"] == "balance" and data["quick"] and not data["errors"]
    assert {"config", "workloads", "simulated", "measured", "summary", "plot", "machine", "date", "total_s"} <= set(data)
    assert Path(data["plot"]).exists() and Path(data["plot"]).stat().st_size > 10_000

    # the workloads have the shapes the issue asks for
    w = data["workloads"]
    assert set(w) == {"captions", "image_text", "long", "pytext"}
    caps = w["captions"]["shape"]
    assert 0.975 <= caps["text_le_64"] <= 0.99 and 0.07 <= caps["text_top_1_62pct_share"] <= 0.12
    assert w["image_text"]["shape"]["patches_max"] > 10 * w["image_text"]["shape"]["patches_median"]
    assert w["long"]["shape"]["top_1pct_share_of_sum_sq"] > 0.5
    # real text (stdlib modules, run-time sentencepiece) with a Pareto tail: a few long documents dominate
    assert 500 <= w["pytext"]["shape"]["median_tokens"] <= 8000 and w["pytext"]["shape"]["max_tokens"] > 65536
    assert w["pytext"]["shape"]["top_1pct_share_of_sum_sq"] > 0.3
    # Karmarkar-Karp is compared with greedy on every configuration
    assert data["summary"]["kk_vs_greedy"]["pairs"]

    # every (workload, DP, context) of the quick grid ran, with every strategy
    cfg = data["config"]
    rows = data["simulated"]
    assert len(rows) == len(w) * len(cfg["dps"]) * len(cfg["contexts"])
    for r in rows:
        strats = r["strategies"]
        assert set(strats) == set(w[r["workload"]]["strategies"]), r["workload"]
        van = strats["vanilla"]
        assert van["sim_speedup"] == 1.0
        where = f"{r['workload']} dp {r['dp']} ctx {r['ctx']}"
        for label, s in strats.items():
            assert s["lockstep_over_bound"] >= 1 - 1e-9, (where, label)
            assert s["step_over_mean"] >= 1 - 1e-9 and s["max_over_mean"] >= 1 - 1e-9, (where, label)
            assert s["max_bin_tokens"] <= s["token_cap"], (where, label)       # no bin over its token budget
            if label == "vanilla":
                continue
            assert s["max_over_mean"] <= van["max_over_mean"] + 1e-9, (where, label)
            assert s["lockstep_over_bound"] < van["lockstep_over_bound"], (where, label)
            assert s["sim_speedup"] > 1.0, (where, label)
            # arrival order opens a microbatch whenever the next sample does not fit; balancing needs no more,
            # and for the VLM workloads fits the 8 asked for (long documents may need one more)
            assert cfg["microbatches"] <= s["microbatches"] <= van["microbatches"], (where, label)
            if w[r["workload"]]["images"]:
                assert s["microbatches"] == cfg["microbatches"], (where, label)
            if s["kind"] == "hybrid":
                assert s["encoder_max_over_mean"] <= van["encoder_max_over_mean"] + 1e-9, (where, label)

    # measured on the CPU: one row per workload, every strategy timed, speedups present and positive
    meas = data["measured"]["rows"]
    assert {m["workload"] for m in meas} == set(w)
    for m in meas:
        assert m["world"] == data["measured"]["config"]["ranks"]
        assert m["strategies"]["vanilla"]["speedup"] == 1.0 and len(m["strategies"]) >= 2
        for label, s in m["strategies"].items():
            assert s["step_s"] > 0 and s["speedup"] > 0 and s["sim_speedup"] > 0, (m["workload"], label)
    assert data["summary"]["by_context"] and set(data["summary"]["measured"]) == set(w)
    assert "lockstep/bound" in proc.stdout and "measured on the CPU" in proc.stdout
