"""Smoke run of the transport benchmark: the hand-off at every sample size, in process, socket, shm and lane."""

from _benchmarks import run_quick


def test_transport_quick_measures_every_path_and_size_and_checks_the_bytes(tmp_path):
    out = tmp_path / "transport.json"
    data, proc = run_quick("transport", out, timeout=300)
    assert data["benchmark"] == "transport" and data["quick"] and not data["errors"]
    t = data["table"]
    for path in ("inprocess", "socket", "shm", "lane"):
        assert set(t[path]) == {"4", "52", "1024"}, path
        for row in t[path].values():
            assert row["identical"] and row["handoff_us"] > 0 and row["stream_us"] > 0 and row["cpu_us"] > 0
    v = data["verdict"]
    assert v["all_identical"] and v["shm_used"] and v["socket_used_no_shm"]
    assert v["lane_used"] and v["others_off_lane"]          # the default path, and only it, took the lane
    assert "52 KiB per sample" in proc.stdout
