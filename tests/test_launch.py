"""``python -m torchdata_overlord.launch``: roles on "data nodes" (here two launchers on localhost),
trainers as separate processes joining with ``address=``; configuration errors before anything
starts; Ctrl-C of the launcher and a dying trainer end the job without leaving a process behind."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from torchdata_overlord.runtime.local import LocalJob
from torchdata_overlord.sim.corpus import build_demo_corpus
from torchdata_overlord.testing import assert_identical

from test_rpc_job import _alive

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus
from torchdata_overlord.sources import ParquetSource
from torchdata_overlord.transforms import ImageText, Tokenize

ROOT, CONSTRUCTORS, MESH, WEB = {root!r}, {constructors!r}, {mesh!r}, {web!r}


def strategy(g):
    return (g.mix({{"web": 0.6, "caps": 0.4}}).distribute("DP").cost(ol.attention_flops)
            .balance("greedy", microbatches=2, max_tokens=2048, oversize="split"))


def sources(corpus):
    return [ParquetSource("web", WEB or corpus.sources["web"],
                          Tokenize(corpus.spm_model, field=corpus.text_fields["web"])),
            ParquetSource("caps", corpus.sources["caps"],
                          ImageText(corpus.spm_model, image_field="image", text_field="text", patch=14, max_side=112))]


def job():
    corpus = build_demo_corpus(ROOT, scale="test", seed=0)
    return dict(sources=sources(corpus), strategy=strategy, mesh=ol.ClientPlaceTree(**MESH), global_batch=8,
                seq_len=None, image_token_id=corpus.image_token_id, constructors=CONSTRUCTORS)
"""

TRAINER = """
import json, os, sys, time, torch
import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({root!r}, scale="test", seed=0)
rank, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
items = []
with ol.OverlordLoader(["web", "caps"], None, ol.ClientPlaceTree(**{mesh!r}), rank=rank, global_batch=8, seq_len=None,
                       image_token_id=corpus.image_token_id, runtime="rpc", address={address!r}, timeout=60) as loader:
    for i, item in enumerate(loader):
        items.append(item)
        if i == 0:
            print("roles", json.dumps(sorted(set(loader.stats()["roles"].values()))), flush=True)
        if len(items) == steps:
            break
        time.sleep({pause})                       # the trainer's own work between steps
    torch.save({{"items": items, "roles": loader.stats()["roles"]}}, out)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(port: int) -> dict:
    return dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def write_config(tmp_path, corpus, constructors=None, mesh=None, web=None) -> Path:
    path = tmp_path / "ljob.py"
    path.write_text(CONFIG.format(root=str(corpus.root), constructors=constructors, mesh=mesh or {"dp": 2}, web=web))
    return path


def launcher(config, port, *extra, node_rank=0, nodes=1, tmpdir=None):
    env = env_for(port) if tmpdir is None else dict(env_for(port), TMPDIR=str(tmpdir))
    return subprocess.Popen([sys.executable, "-m", "torchdata_overlord.launch", "--config", str(config), "--nodes",
                             str(nodes), "--node-rank", str(node_rank), *extra], env=env, cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def trainer(tmp_path, corpus, port, rank, steps, pause=0.0, mesh=None, host="127.0.0.1"):
    script = TRAINER.format(root=str(corpus.root), mesh=mesh or {"dp": 2}, address=f"{host}:{port}", pause=pause)
    out = tmp_path / f"trainer-{rank}.pt"
    proc = subprocess.Popen([sys.executable, "-c", script, str(rank), str(steps), str(out)], env=env_for(port),
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out


def kill_left(procs) -> None:
    """SIGKILL whichever of ``procs`` still runs (a test that failed midway leaves nothing behind)."""
    for p in procs:
        if p.poll() is None:
            p.kill()


def finish(procs, timeout):
    """Wait for every process (bounded); kill what is left; return (returncode, stderr) per process."""
    deadline, out = time.monotonic() + timeout, []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err = "TIMEOUT\n" + err
        out.append((p.returncode, err))
    return out


def wait_gone(pids, timeout=20.0):
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.1)
    return alive


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_demo_corpus(tmp_path_factory.mktemp("corpus"), scale="test", seed=0)


# ------------------------------------------------------------------------------------ errors before start

def run_launcher(config, port, *extra, nodes=1, node_rank=0, timeout=60):
    t0 = time.monotonic()
    proc = launcher(config, port, *extra, nodes=nodes, node_rank=node_rank)
    (rc, err), = finish([proc], timeout)
    return rc, err, time.monotonic() - t0


@pytest.mark.slow
def test_launcher_reports_configuration_errors_before_starting(corpus, tmp_path):
    config = write_config(tmp_path, corpus)
    with socket.socket() as busy:                                 # port in use
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc, err, _ = run_launcher(config, busy.getsockname()[1])
    assert rc == 2 and "is in use" in err, err
    rc, err, took = run_launcher(config, free_port(), "--interface", "lo", "--connect-timeout", "2", nodes=2,
                                 node_rank=1)                      # nobody hosts the store
    assert rc == 2 and "within 2 s" in err and "127.0.0.1" in err, err
    assert took < 30
    rc, err, _ = run_launcher(write_config(tmp_path, corpus, constructors=3), free_port())
    assert rc == 2 and "constructors=3 does not fit" in err, err
    rc, err, _ = run_launcher(write_config(tmp_path, corpus, web=str(tmp_path / "missing" / "*.parquet")), free_port())
    assert rc == 2 and "missing" in err, err
    rc, err, _ = run_launcher(write_config(tmp_path, corpus), free_port(), nodes=2)     # no --interface
    assert rc == 2 and "--interface" in err, err


def test_client_reports_an_unreachable_launcher(corpus):
    import torchdata_overlord as ol
    from torchdata_overlord.runtime.rpc_job import RpcJob

    t0 = time.monotonic()
    with pytest.raises(ol.ConfigError, match=r"cannot reach .*127\.0\.0\.1:\d+ within 1 s"):
        RpcJob(["web", "caps"], None, ol.ClientPlaceTree(dp=2), 8, None, address=f"127.0.0.1:{free_port()}", client=0,
               startup_timeout=1)
    assert time.monotonic() - t0 < 20


# ------------------------------------------------------------------------------------ a launched job

@pytest.mark.slow
def test_two_data_nodes_and_two_trainers_equal_the_local_runtime(corpus, tmp_path):
    """Trainer 1 finishes ~12 s after trainer 0 (longer than a client's stop timeout): each leaves on its
    own time, and the launchers end the job once both left, exit code 0 everywhere, and quietly: no
    process prints a warning for its peers' pipes closing (TensorPipe's EOF lines)."""
    port, steps = free_port(), 3
    config = write_config(tmp_path, corpus)
    # the launchers' temporary folder (short: the fork server's socket path must fit AF_UNIX): multiprocessing's
    # folder in it is removed although the launcher leaves by os._exit
    tmp = Path(tempfile.mkdtemp(prefix="ol-launch-"))
    try:
        nodes = [launcher(config, port, "--interface", "lo", "--workers-per-node", "2", nodes=2, node_rank=r,
                          tmpdir=tmp) for r in (0, 1)]
        trainers = [trainer(tmp_path, corpus, port, r, steps, pause=6.0 * r) for r in (0, 1)]
        results = finish([p for p, _ in trainers] + nodes, 180)
        assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]
        assert not list(tmp.glob("pymp-*")), list(tmp.iterdir())    # multiprocessing's (torch keeps caches there)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    noise = [line for _, err in results for line in err.splitlines() if "tensorpipe" in line.lower()]
    assert noise == [], noise

    sys.path.insert(0, str(tmp_path))
    import ljob
    job = LocalJob(**{k: v for k, v in ljob.job().items() if k != "constructors"})
    try:
        reference = [job.step().outputs for _ in range(steps)]
    finally:
        job.close()
    got = [torch.load(out, weights_only=False) for _, out in trainers]
    for r, g in enumerate(got):
        assert [it["step"] for it in g["items"]] == list(range(steps))
        for k, item in enumerate(g["items"]):
            assert_identical(item["microbatches"], reference[k][r]["microbatches"])
    roles = got[0]["roles"]
    assert len(set(roles.values())) == 4                          # 2 nodes x 2 workers hold the 5 roles
    assert roles["constructor:0"] != roles["constructor:1"]
    assert not wait_gone(set(roles.values()))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["ctrl-c launcher", "kill a trainer", "kill the launcher"])
def test_a_launched_job_ends_cleanly_on_faults(corpus, tmp_path, fault):
    """Each trainer still there learns why the job stopped. A killed launcher (SIGKILL, the OOM killer) takes the
    role processes with it: the trainers said that the actor 'launcher' or 'planner-registry' was unreachable, and
    warned that they could not tell the launcher they leave."""
    port = free_port()
    node = launcher(write_config(tmp_path, corpus), port, "--ping-every", "0.5")
    trainers = [trainer(tmp_path, corpus, port, r, 10_000, pause=0.05) for r in (0, 1)]
    try:
        line = trainers[0][0].stdout.readline()               # the job runs: trainer 0 consumed a step
        assert line.startswith("roles"), finish([p for p, _ in trainers] + [node], 10)
        role_pids = [int(p) for p in line.split(" ", 1)[1].strip("[]\n").split(",")]
        t0 = time.monotonic()
        if fault == "ctrl-c launcher":
            node.send_signal(signal.SIGINT)
        elif fault == "kill the launcher":
            node.send_signal(signal.SIGKILL)
        else:
            trainers[1][0].send_signal(signal.SIGKILL)
        results = finish([node] + [p for p, _ in trainers], 60)
        assert time.monotonic() - t0 < 45
    finally:
        kill_left([node] + [p for p, _ in trainers])
    # the launcher says the job failed (a killed one says nothing)
    assert results[0][0] == (-signal.SIGKILL if fault == "kill the launcher" else 1), results[0][1][-2000:]
    assert all("TIMEOUT" not in err for _, err in results)           # nobody hung
    # the trainers still there learn why the job stopped, not that some role became unreachable
    why = {"ctrl-c launcher": "the launcher was interrupted", "kill a trainer": "trainer client 1 died",
           "kill the launcher": "its launcher process died"}[fault]
    for rc, err in results[1:] if fault == "kill the launcher" else results[1:2]:
        assert rc != 0 and "JobStopped" in err and why in err, err[-2000:]
        assert "ActorDied" not in err and "could not tell" not in err, err[-2000:]
    if fault == "kill the launcher":
        assert "load_checkpoint_store" in results[1][1], results[1][1][-2000:]
    assert not wait_gone(role_pids)


def fork_server_of(pid: int) -> int:
    """The multiprocessing fork server process ``pid`` started (its child running ``forkserver``)."""
    kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
    servers = [int(k) for k in kids if b"forkserver" in open(f"/proc/{k}/cmdline", "rb").read()]
    assert len(servers) == 1, (kids, servers)
    return servers[0]


@pytest.mark.slow
def test_a_launched_job_outlives_its_launchers_fork_server(corpus, tmp_path):
    """The launcher's fork server only starts the role workers; when it died (SIGKILL, or the OOM killer: it holds
    torch) every worker read as exited with code 255, and the launcher stopped a healthy job ('role worker
    process(es) [...] died'). The job goes on to its end, exit code 0 everywhere, and the launcher says what died."""
    port, steps = free_port(), 30
    node = launcher(write_config(tmp_path, corpus, mesh={"dp": 1}), port, "--ping-every", "0.5")
    client, out = trainer(tmp_path, corpus, port, 0, steps, pause=0.1, mesh={"dp": 1})
    try:
        line = client.stdout.readline()                   # the job runs: the trainer consumed a step
        assert line.startswith("roles"), finish([client, node], 10)
        role_pids = [int(p) for p in line.split(" ", 1)[1].strip("[]\n").split(",")]
        os.kill(fork_server_of(node.pid), signal.SIGKILL)
        results = finish([client, node], 120)
    finally:
        kill_left([client, node])
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]
    assert "died; stopping every role" not in results[1][1], results[1][1][-3000:]
    assert "the multiprocessing fork server that started the role workers died" in results[1][1], results[1][1][-3000:]
    got = torch.load(out, weights_only=False)
    assert [it["step"] for it in got["items"]] == list(range(steps))
    assert not wait_gone(role_pids)


@pytest.mark.slow
def test_the_launcher_runs_under_torchrun(corpus, tmp_path):
    """torchrun hosts the store (its agent's, at --master-port): the launcher uses it, trainers connect there."""
    port, steps = free_port(), 2
    node = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "torchdata_overlord.launch",
                             "--config", str(write_config(tmp_path, corpus))], env=env_for(port), cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trainers = [trainer(tmp_path, corpus, port, r, steps) for r in (0, 1)]
    results = finish([p for p, _ in trainers] + [node], 180)
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]
    got = [torch.load(out, weights_only=False) for _, out in trainers]
    assert [[it["step"] for it in g["items"]] for g in got] == [[0, 1], [0, 1]]
    assert not wait_gone(set(got[0]["roles"].values()))


def forked_workers(launcher_pid: int, count: int, timeout: float = 120.0) -> list[int]:
    """The pids of the ``count`` role workers a launcher's fork server started (waits, bounded, for them)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            server = fork_server_of(launcher_pid)
            kids = [int(k) for k in open(f"/proc/{server}/task/{server}/children").read().split()]
        except (AssertionError, OSError):
            kids = []
        if len(kids) >= count or time.monotonic() > deadline:
            return kids
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill a node-1 worker", "kill node 1's launcher", "terminate node 1's launcher"])
def test_a_follower_node_that_fails_ends_the_job_as_node_0_would(corpus, tmp_path, fault):
    """Node 0 only saw its own workers: a node-1 worker killed left the trainers failing with RoleLost ("start
    the job with more spares", in a job without fault tolerance) and node 0 exiting 0, and a node-1 launcher
    killed or terminated was not noticed at all. Each ends the job like a fault on node 0: the trainers raise
    JobStopped naming what died and where, node 0 exits 1, and no process is left."""
    port = free_port()
    config = write_config(tmp_path, corpus)
    nodes = [launcher(config, port, "--interface", "lo", "--workers-per-node", "2", "--ping-every", "0.5",
                      nodes=2, node_rank=r) for r in (0, 1)]
    trainers = [trainer(tmp_path, corpus, port, r, 10_000, pause=0.05) for r in (0, 1)]
    procs = [p for p, _ in trainers] + nodes
    try:
        line = trainers[0][0].stdout.readline()               # the job runs: trainer 0 consumed a step
        assert line.startswith("roles"), finish(procs, 10)
        role_pids = [int(p) for p in line.split(" ", 1)[1].strip("[]\n").split(",")]
        node1_workers = forked_workers(nodes[1].pid, 2)
        assert len(node1_workers) == 2 and set(node1_workers) <= set(role_pids), (node1_workers, role_pids)
        t0 = time.monotonic()
        if fault == "kill a node-1 worker":
            os.kill(node1_workers[0], signal.SIGKILL)
        else:
            nodes[1].send_signal(signal.SIGKILL if fault == "kill node 1's launcher" else signal.SIGTERM)
        results = finish(procs, 60)
        took = time.monotonic() - t0
    finally:
        kill_left(procs)
    why = {"kill a node-1 worker": f"(pid {node1_workers[0]}, exited with code -9)'] on node 1 died",
           "kill node 1's launcher": "the launcher of node(s) [1] is gone",
           "terminate node 1's launcher": "node 1's launcher was interrupted (Ctrl-C or SIGTERM)"}[fault]
    assert all("TIMEOUT" not in err for _, err in results), [err[-2000:] for _, err in results]   # nobody hung
    assert took < 45, took
    (rc0, err0), (rc1, err1) = results[2:]
    assert rc0 == 1 and why in err0 and "every trainer left" not in err0, err0[-3000:]
    assert rc1 == (-signal.SIGKILL if fault == "kill node 1's launcher" else 1), err1[-3000:]
    for rc, err in results[:2]:                                      # the trainers learn why, not a consequence
        assert rc != 0 and "JobStopped" in err and why in err, err[-3000:]
        assert "RoleLost" not in err and "more spares" not in err, err[-3000:]
    assert not wait_gone(role_pids)


@pytest.mark.slow
def test_a_follower_worker_that_dies_during_start_up_is_reported_at_once(corpus, tmp_path):
    """A node-1 worker killed while the group assembles (no trainer joined yet): node 0 waited for the group
    until torch's start-up failed (~6 s), then said that not every member joined within --join-timeout=600 s,
    and every worker printed gloo's traceback. Node 0 now names the dead worker and its node within seconds,
    and every process ends without a traceback."""
    port = free_port()
    config = write_config(tmp_path, corpus)
    nodes = [launcher(config, port, "--interface", "lo", "--workers-per-node", "2", nodes=2, node_rank=r)
             for r in (0, 1)]
    try:
        workers = [forked_workers(n.pid, 2) for n in nodes]
        assert all(len(w) == 2 for w in workers), workers
        t0 = time.monotonic()
        os.kill(workers[1][0], signal.SIGKILL)
        results = finish(nodes, 60)
        took = time.monotonic() - t0
    finally:
        kill_left(nodes)
    (rc0, err0), (rc1, err1) = results
    assert rc0 == 1 and rc1 == 1, [err[-3000:] for _, err in results]
    errors = [line for line in err0.splitlines() if line.startswith("torchdata_overlord.launch:")]
    assert len(errors) == 1, err0[-3000:]
    assert f"(pid {workers[1][0]}, exited with code -9)'] on node 1 died during start-up" in errors[0], errors
    assert "join-timeout" not in err0, err0[-3000:]
    assert took < 15, took
    assert not [e for _, err in results for e in ("Traceback", "terminate called") if e in err], \
        [err[-3000:] for _, err in results]
    assert not wait_gone(workers[0] + workers[1])
