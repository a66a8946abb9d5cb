"""A launched job's life as its processes see it: a launcher nobody joins, a trainer whose launcher is
absent, and the sockets of a running job (each ends or listens as promised, with real processes)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from torchdata_overlord.runtime.procstats import listening_addresses
from torchdata_overlord.sim.corpus import build_demo_corpus

from test_launch import ROOT, env_for, finish, free_port, launcher, trainer, wait_gone, write_config

NATIVE = ("terminate called", "frame #", "Traceback", "Exception raised from")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_demo_corpus(tmp_path_factory.mktemp("corpus"), scale="test", seed=0)


@pytest.mark.slow
def test_a_launcher_nobody_joins_ends_with_one_clear_line(corpus, tmp_path):
    """No trainer connects: past --join-timeout the launcher says so in one line and exits 1, without
    a native abort (exit 134, "terminate called...", C++ frames) and without leaving a worker."""
    port = free_port()
    node = launcher(write_config(tmp_path, corpus), port, "--join-timeout", "5")
    (rc, err), = finish([node], 120)
    errors = [line for line in err.splitlines() if line.startswith("torchdata_overlord.launch:")]
    assert rc == 1, err[-3000:]
    assert len(errors) == 1 and "--join-timeout=5 s" in errors[0] and f"127.0.0.1:{port}" in errors[0], err[-3000:]
    assert "2 trainer(s)" in errors[0], errors
    assert not [m for m in NATIVE if m in err], err[-3000:]
    started = re.search(r"pids \[([\d, ]+)\]", err)
    assert started, err[-3000:]
    assert not wait_gone([int(p) for p in started.group(1).split(",")])


TRAINER_ALONE = """
import sys, time
import torchdata_overlord as ol
t0 = time.monotonic()
try:
    ol.OverlordLoader(["web", "caps"], None, ol.ClientPlaceTree(dp=2), rank=0, global_batch=8, seq_len=None,
                      runtime="rpc", address={address!r}, startup_timeout={timeout})
except ol.ConfigError as e:
    print(f"{{time.monotonic() - t0:.3f}}", flush=True)
    print(e, file=sys.stderr, flush=True)
"""


@pytest.mark.slow
def test_a_trainer_without_its_launcher_honours_its_connect_timeout():
    """With no launcher running, a trainer gives up after its own startup_timeout (not ~1.6 times it,
    as c10d's retries took), with one clear error and no native stack frames."""
    address, timeout = f"127.0.0.1:{free_port()}", 4.0
    proc = subprocess.run([sys.executable, "-c", TRAINER_ALONE.format(address=address, timeout=timeout)],
                          capture_output=True, text=True, timeout=120, env=env_for(0), cwd=str(ROOT))
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    took = float(proc.stdout.strip().splitlines()[-1])
    assert timeout <= took < timeout + 1.5, took
    assert f"cannot reach the data plane's store at {address} within 4 s" in proc.stderr, proc.stderr[-3000:]
    assert not [m for m in NATIVE if m in proc.stderr], proc.stderr[-3000:]


@pytest.mark.slow
def test_a_launched_job_listens_on_its_address_only(corpus, tmp_path):
    """MASTER_ADDR=127.0.0.2, --interface lo: the launcher's store listens on 127.0.0.2:port only (not
    on every interface), and every socket of every process (launcher, roles, trainer) is on loopback."""
    port = free_port()
    env = dict(env_for(port), MASTER_ADDR="127.0.0.2")
    config = write_config(tmp_path, corpus, mesh={"dp": 1})
    node = subprocess.Popen([sys.executable, "-m", "torchdata_overlord.launch", "--config", str(config),
                             "--ping-every", "0.5"], env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    client, _ = trainer(tmp_path, corpus, port, 0, 10_000, pause=0.05, mesh={"dp": 1}, host="127.0.0.2")
    try:
        line = client.stdout.readline()                   # the job runs: the trainer consumed a step
        assert line.startswith("roles"), finish([client, node], 10)
        roles = [int(p) for p in line.split(" ", 1)[1].strip("[]\n").split(",")]
        listening = {pid: listening_addresses(pid) for pid in [node.pid, client.pid] + roles}
    finally:
        for p in (client, node):
            p.kill()
        finish([client, node], 30)
    assert listening[node.pid] and f"127.0.0.2:{port}" in listening[node.pid], listening
    everywhere = [a for addrs in listening.values() for a in addrs if not re.match(r"127\.0\.0\.[12]:\d+$", a)]
    assert everywhere == [], listening
    assert all(listening[pid] for pid in roles), listening              # every role listens (on loopback)
    assert not wait_gone(roles)
