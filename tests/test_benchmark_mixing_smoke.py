"""Smoke run of the mixing-accuracy benchmark: the library's mix against torchdata's MultiNodeWeightedSampler."""

import numpy as np

from _benchmarks import run_quick

METHODS = ("library", "rebuild_from_state", "reweight_new_epoch", "recreate_same_seed")


def window_deviation(counts, target, batch, w):
    diff = np.asarray(counts) / batch - np.asarray(target)
    c = np.concatenate([[0.0], np.cumsum(diff)])
    return float(np.max(np.abs(c[w:] - c[:-w])) / w)


def test_mixing_quick_follows_the_curriculum_and_beats_iid(tmp_path):
    out = tmp_path / "mixing.json"
    data, proc = run_quick("mixing_accuracy", out, timeout=120)
    assert data["benchmark"] == "mixing_accuracy" and data["quick"] is True
    assert not data["errors"] and not data["checks_failed"]
    cfg = data["config"]
    steps, windows, seeds = cfg["steps"], cfg["windows"], cfg["seeds"]
    assert windows == [1, 10, 100] and len(seeds) >= 2 and cfg["baseline"]["primary_variant"] == "rebuild_from_state"
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "ratio baseline / library" in proc.stdout

    target = np.asarray(data["series"]["target_fraction_a"])
    assert len(target) == steps and abs(target[0] - 0.8) < 1e-12 and abs(target[-1] - 0.5) < 0.3 / steps + 1e-12
    assert np.all(np.diff(target) < 0)                     # the curriculum moves a from 80% towards 50%

    for b in cfg["global_batches"]:
        B = int(b)
        runs, summary = data["runs"][str(b)], data["summary"][str(b)]
        floor = summary["integer_floor_window_1"]
        assert 0 <= floor <= 0.5 / B + 1e-12
        for m in METHODS:
            assert set(runs[m]) == {str(s) for s in seeds}, m
            for seed, r in runs[m].items():
                # every step a full global batch, every sample taken once, in each source's order
                assert r["every_step_full_batch"] and r["batch_size_min"] == r["batch_size_max"] == B, (m, seed)
                assert r["no_sample_lost_or_repeated"], (m, seed)
                devs = [r[f"window_{w}"] for w in windows]
                assert all(d >= 0 for d in devs) and r["cum_error_max_abs_samples"] >= abs(r["cum_error_final_samples"])
                # a longer window averages whole shorter ones, so its largest deviation cannot be larger
                assert devs[0] >= devs[1] - 1e-12 and devs[1] >= devs[2] - 1e-12, (m, seed, devs)
        # the library: cumulative error under one sample (the design's guarantee), so a W-step window is off by
        # under 2 / (W * B); one step is off by at most one sample beyond the target's own rounding
        for seed, r in runs["library"].items():
            assert r["cum_error_max_abs_samples"] < 1.0, seed
            assert r["window_1"] <= 1.0 / B + floor + 1e-12, seed
            for w in windows:
                assert r[f"window_{w}"] < 2.0 / (w * B), (seed, w)
            assert r["plan_stats_mixture_agrees"] and r["final_max_abs_error_reported"] < 1.0
        assert summary["library_counts_independent_of_seed"] is True

        # the reported figures are what the per-step series give
        series = data["series"]["counts_a_seed0"][str(b)]
        for m in ("library", "rebuild_from_state"):
            counts = np.asarray(series[m])
            assert len(counts) == steps and counts.min() >= 0 and counts.max() <= B
            r = runs[m][str(seeds[0])]
            for w in windows:
                assert abs(window_deviation(counts, target, B, w) - r[f"window_{w}"]) < 1e-9, (m, w)
            cum = np.cumsum(counts) - B * np.cumsum(target)
            assert abs(np.max(np.abs(cum)) - r["cum_error_max_abs_samples"]) < 1e-6

        # i.i.d. draws at 64 samples a step miss a step's target by several samples: far beyond the library
        ratios = data["ratios"][str(b)]
        for v in ("rebuild_from_state", "reweight_new_epoch"):
            assert ratios[v]["window_1"]["min"] > 2, (v, ratios[v])
            assert ratios[v]["cum_error_max_abs_samples"]["min"] > 5, (v, ratios[v])
            lib = runs["library"][str(seeds[0])]
            assert abs(ratios[v]["window_10"]["mean"] * lib["window_10"] - summary[v]["window_10"]["mean"]) < 1e-9

    m = data["machine"]
    assert m["cores"] >= 1 and data["date"] and data["total_s"] > 0
