"""Issue 13: a launched job (``python -m torchdata_overlord.launch``, two "data nodes" on localhost)
with fault tolerance gets spare processes on every node (``--spares-per-node``, default 1), where the
Planner replaces failed roles; a killed worker no longer ends the job. Here a loader's process and
then the Planner's process are killed (SIGKILL) while two trainers read: both keep receiving the
local runtime's stream, bit for bit, and every process is gone afterwards."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from torchdata_overlord.runtime.local import LocalJob
from torchdata_overlord.sim.corpus import build_demo_corpus
from torchdata_overlord.testing import assert_identical

from test_launch import CONFIG, ROOT, env_for, finish, free_port, kill_left, launcher, trainer, wait_gone
from test_rpc_job import _alive

FT_CONFIG = CONFIG + """
CKPT = {ckpt!r}
_job = job


def job():
    return dict(_job(), checkpoint_dir=CKPT, snapshot_every=3, shadows=False)
"""

# trainer 0: after consuming each step named in KILLS it prints the role to kill and its pid, then
# waits for the test to say it is dead (a line on stdin) before reading on
LEADER = """
import json, sys, torch
import torchdata_overlord as ol
from torchdata_overlord.runtime import faults
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({root!r}, scale="test", seed=0)
rank, steps, out, kills = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
items = []
with ol.OverlordLoader(["web", "caps"], None, ol.ClientPlaceTree(dp=2), rank=rank, global_batch=8, seq_len=None,
                       image_token_id=corpus.image_token_id, runtime="rpc", address={address!r}, timeout=60) as loader:
    for i, item in enumerate(loader):
        items.append(item)
        if str(i) in kills:
            role = kills[str(i)]
            st = loader.stats()
            print("kill", json.dumps({{"role": role, "pid": faults.role_pid(loader, role), "roles": st["roles"],
                                       "recoveries": st["planner"]["recoveries"]}}), flush=True)
            sys.stdin.readline()
        if len(items) == steps:
            break
    st = loader.stats()
    torch.save({{"items": items, "roles": st["roles"], "recoveries": st["planner"]["recoveries"],
                 "client_faults": st["client"]["faults"]}}, out)
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_demo_corpus(tmp_path_factory.mktemp("corpus"), scale="test", seed=0)


def lines_of(stream) -> queue.Queue:
    """Every line ``stream`` prints, as it comes (read on a thread: each wait below has a timeout)."""
    q: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def next_kill(q: queue.Queue, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        line = q.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, "trainer 0 ended before asking for the kill"
        if line.startswith("kill "):
            return json.loads(line[5:])


def worker_pids(stderr: str) -> tuple[list[int], list[int]]:
    """(every worker pid, the spares' pids) from a launcher's start-up log line."""
    m = re.search(r"started workers \[([\d, ]+)\] \(pids \[([\d, ]+)\]\), spares \[([\d, ]*)\]", stderr)
    assert m, stderr[-3000:]
    idx = [int(i) for i in m.group(1).split(",")]
    pids = [int(p) for p in m.group(2).split(",")]
    spares = {int(i) for i in m.group(3).split(",") if i.strip()}
    return pids, [p for i, p in zip(idx, pids) if i in spares]


def _same_as_local(config, module: str, steps: int, outs) -> list[dict]:
    """The trainers' saved items (``outs``), checked step by step against the same config's job run in this
    process by the local runtime (its fault-tolerance settings left out); returns them."""
    spec = importlib.util.spec_from_file_location(module, config)
    ljob = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ljob)
    kw = {k: v for k, v in ljob.job().items()
          if k not in ("constructors", "checkpoint_dir", "snapshot_every", "shadows", "call_timeout")}
    job = LocalJob(**kw)
    try:
        reference = [job.step().outputs for _ in range(steps)]
    finally:
        job.close()
    got = [torch.load(out, weights_only=False) for out in outs]
    for r, g in enumerate(got):
        assert [it["step"] for it in g["items"]] == list(range(steps))
        for k, item in enumerate(g["items"]):
            assert_identical(item["microbatches"], reference[k][r]["microbatches"])
    return got


@pytest.mark.slow
def test_a_launched_job_recovers_a_killed_loader_and_planner_on_its_nodes_spares(corpus, tmp_path):
    port, steps, kills = free_port(), 14, {"3": "loader:caps", "7": "planner"}
    config = tmp_path / "ljob.py"
    config.write_text(FT_CONFIG.format(root=str(corpus.root), constructors=None, mesh={"dp": 2}, web=None,
                                       ckpt=str(tmp_path / "ckpt")))
    # 2 nodes x 2 role workers: planner+constructor:1 on worker 0, web 1 (node 0); caps 2, constructor:0 3
    # (node 1); one spare on each node (workers 4 and 5)
    nodes = [launcher(config, port, "--interface", "lo", "--workers-per-node", "2", "--ping-every", "0.5",
                      nodes=2, node_rank=r) for r in (0, 1)]
    out0, err0 = tmp_path / "trainer-0.pt", tmp_path / "trainer-0.err"
    with open(err0, "w") as err:
        lead = subprocess.Popen([sys.executable, "-c", LEADER.format(root=str(corpus.root),
                                                                     address=f"127.0.0.1:{port}"),
                                 "0", str(steps), str(out0), json.dumps(kills)], env=env_for(port), cwd=str(ROOT),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    other, out1 = trainer(tmp_path, corpus, port, 1, steps)
    procs = [lead, other] + nodes
    killed = []
    try:
        said = lines_of(lead.stdout)
        for step in sorted(kills, key=int):
            ask = next_kill(said, 120)
            assert ask["role"] == kills[step], ask
            assert list(ask["roles"].values()).count(ask["pid"]) == (2 if ask["role"] == "planner" else 1), ask
            os.kill(ask["pid"], signal.SIGKILL)
            assert not wait_gone([ask["pid"]], 10)
            killed.append(ask)
            lead.stdin.write("dead\n")
            lead.stdin.flush()
        try:
            lead.wait(timeout=180)
        except subprocess.TimeoutExpired:
            lead.kill()
        results = [(lead.returncode, err0.read_text())] + finish([other] + nodes, 60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for i, (rc, err) in enumerate(results):
        (tmp_path / f"stderr-{i}.txt").write_text(f"exit code {rc}\n{err}")
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]   # the job went on, and ended well

    got = _same_as_local(config, "ljob_faults", steps, (out0, out1))

    pids, spares = [], []
    for _, err in results[2:]:
        p, s = worker_pids(err)
        pids, spares = pids + p, spares + s
    assert len(spares) == 2                                    # one per node
    # the loader: restored on a spare from the checkpoint (no shadows); the Planner's successor there too
    loader, planner = killed[1]["recoveries"], got[0]["recoveries"]
    print("recoveries:", [(r["kind"], r["role"], r["seconds"], r["how"]) for r in loader + planner])
    assert [(r["kind"], r["role"]) for r in loader] == [("loader", "loader:caps")], loader
    assert loader[0]["how"].startswith("restored on a spare process (snapshot of step "), loader
    assert killed[1]["roles"]["loader:caps"] in spares
    assert "planner" in [r["kind"] for r in planner], planner
    roles = got[0]["roles"]
    assert not {k["pid"] for k in killed} & set(roles.values())
    assert roles["loader:caps"] in spares and roles["planner"] in spares and roles["constructor:1"] in spares
    assert got[0]["client_faults"]["recoveries"], got[0]["client_faults"]
    assert not wait_gone(pids + [k["pid"] for k in killed])


# trainer 0 of the freeze test: freezes (SIGSTOP) the process of the role argv[4] after step 2 and reads on, its
# next() waiting at most 30 s
FREEZER = """
import sys, torch
import torchdata_overlord as ol
from torchdata_overlord.runtime import faults
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({root!r}, scale="test", seed=0)
rank, steps, out, role = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
items, frozen = [], None
with ol.OverlordLoader(["web", "caps"], None, ol.ClientPlaceTree(dp=2), rank=rank, global_batch=8, seq_len=None,
                       image_token_id=corpus.image_token_id, runtime="rpc", address={address!r}, timeout=45) as loader:
    for i, item in enumerate(loader):
        items.append(item)
        if i == 2:
            frozen = faults.freeze_role(loader, role)
            print("frozen", frozen, flush=True)
        if len(items) == steps:
            break
    torch.save({{"items": items, "frozen": frozen, "call_timeout": loader._job.timeout,
                 "recoveries": loader.stats()["planner"]["recoveries"]}}, out)
"""


@pytest.mark.slow
@pytest.mark.parametrize("role", ["loader:caps", "constructor:0"])
def test_a_launched_job_replaces_a_frozen_role_within_its_config_call_timeout(corpus, tmp_path, role):
    """A launched job's roles called each other with ``--rpc-timeout`` (60 s) and its trainers with their own
    ``min(timeout, 60)``, and its config could not say otherwise: a frozen role was found only after a few
    minutes' call timeouts, past the trainers' ``next()`` timeout (a trial: TimeoutError at step 6 with
    timeout=200). The config's ``call_timeout`` is now every role's and trainer's call timeout (30 s by default
    with fault tolerance, as ``FaultTolerance``'s): here 6 s, and a frozen Source Loader (found by the Planner) or
    Data Constructor (replaced by the Planner; trainer 0's fetch to it waits four call timeouts: before, the
    trainer's own, 80 s, and next() raised TimeoutError after 20 s, measured with --rpc-timeout 4) is replaced while
    the trainers read on, with ``next()`` waiting at most 45 s, and receive the local runtime's stream."""
    port, steps = free_port(), 8
    config = tmp_path / "ljob.py"
    config.write_text(FT_CONFIG.format(root=str(corpus.root), constructors=None, mesh={"dp": 2}, web=None,
                                       ckpt=str(tmp_path / "ckpt"))
                      + "\n\n_ft_job = job\n\n\ndef job():\n    return dict(_ft_job(), call_timeout=6.0)\n")
    node = launcher(config, port, "--ping-every", "0.5")
    out0 = tmp_path / "trainer-0.pt"
    lead = subprocess.Popen([sys.executable, "-c", FREEZER.format(root=str(corpus.root), address=f"127.0.0.1:{port}"),
                             "0", str(steps), str(out0), role], env=env_for(port), cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    other, out1 = trainer(tmp_path, corpus, port, 1, steps)
    frozen = None
    try:
        said = lines_of(lead.stdout)
        deadline = time.monotonic() + 120
        while frozen is None:
            line = said.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "trainer 0 ended before it froze the loader"
            if line.startswith("frozen "):
                frozen = int(line.split()[1])
        results = finish([lead, other, node], 120)
    finally:
        kill_left([lead, other, node])
        if frozen is not None and _alive(frozen):
            os.kill(frozen, signal.SIGKILL)              # (SIGKILL ends a stopped process too)
    for i, (rc, err) in enumerate(results):
        (tmp_path / f"stderr-{i}.txt").write_text(f"exit code {rc}\n{err}")
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]

    got = _same_as_local(config, "ljob_freeze", steps, (out0, out1))
    assert got[0]["call_timeout"] == 6.0
    # (on a loaded machine a 6 s call timeout may also replace a role that was only slow: the stream is the same)
    recovered = [r for r in got[0]["recoveries"] if (r["kind"], r["role"]) == (role.split(":")[0], role)]
    assert len(recovered) == 1 and recovered[0]["seconds"] < 45, got[0]["recoveries"]
    pids, _ = worker_pids(results[2][1])
    assert frozen in pids and not wait_gone(pids)
