"""Smoke run of the runtimes benchmark: DataLoader, OverlordLoader local and rpc, each in its own process."""

from _benchmarks import run_quick


def test_runtimes_quick_writes_all_three_runs_and_latency(tmp_path):
    out = tmp_path / "runtimes.json"
    data, proc = run_quick("runtimes", out, "--root", str(tmp_path / "corpus"), "--model-ms", "20,40", timeout=300)
    assert data["benchmark"] == "runtimes" and data["quick"] and data["scale"] == "test"
    assert not data["errors"]
    runs = data["runs"]
    for key in ("dataloader", "local", "rpc"):
        assert runs[key]["samples_per_s"] > 0 and runs[key]["tokens_per_s"] > 0, key
    assert runs["dataloader"]["processes"] == runs["rpc"]["processes"] == 3
    for key in ("local", "rpc"):
        assert runs[key]["samples_per_step_ok"], key
        assert len(runs[key]["latencies"]) == 2 and runs[key]["latency"] == runs[key]["latencies"][0]
        for lat in runs[key]["latencies"]:
            assert lat["steps"] == data["config"]["latency_steps"] and lat["prefetch"] == 2
            assert 0 <= lat["wait_p50_ms"] <= lat["wait_p99_ms"] <= lat["wait_max_ms"], key
            assert lat["model_step_isolated_ms"] > 0 and 0 <= lat["waited_gt_1ms_fraction"] <= 1
            assert 0 <= lat["waited_gt_1ms_queue_empty_fraction"] <= lat["queue_empty_fraction"] <= 1
        assert runs[key]["take"]["samples"] > 0, key
    t = data["transport"]
    assert t["take_rpc_us_per_sample"] > 0 and t["take_local_us_per_sample"] > 0
    assert sum(k.startswith("rpc_") and k.endswith("_meets_target_data_not_ready") for k in data["verdict"]) == 2
    # the ratios to the DataLoader: medians over the main run and the interleaved throughput-only round
    for key in ("local", "rpc"):
        each = data["verdict"][f"ratio_{key}_over_dataloader_each_round"]
        assert len(each) == 2 and all(x > 0 for x in each), key
        assert min(each) <= data["verdict"][f"ratio_{key}_over_dataloader"] <= max(each)
    assert all(len(v) == 2 for v in data["throughput_rounds"].values())
    rate = data["steprate"]
    assert rate["config"]["global_batch"] == 8 and set(rate["runs"]) == {"local", "rpc"}
    assert all(r["steps_per_s"] > 0 for runs in rate["runs"].values() for r in runs)
    assert data["verdict"]["steprate_rpc_over_local"] > 0 and "step rate at global batch 8" in proc.stdout
    m = data["machine"]
    assert m["cores"] >= 1 and m["memory_gib"] > 0 and data["date"]
    assert "samples/s" in proc.stdout and "p99" in proc.stdout
