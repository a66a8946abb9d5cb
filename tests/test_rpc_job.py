"""RpcJob (roles as actors in RPC worker processes) delivers exactly LocalJob's stream.

Each RpcJob runs in a fresh ``python -c`` subprocess (its own RPC group, roles and fork server,
nothing shared with the test process) that writes its outputs with ``torch.save``; this process
compares them with a LocalJob run here. The strategy and mesh live at module level so the workers
can unpickle them (the subprocess puts this directory on ``sys.path`` before the fork server starts).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import torchdata_overlord as ol
from torchdata_overlord.runtime.local import LocalJob
from torchdata_overlord.runtime.procstats import process_running as _alive
from torchdata_overlord.runtime.rpc_job import RpcJob, SourceSpec
from torchdata_overlord.runtime.inprocess import InProcessTransport
from torchdata_overlord.sim.corpus import build_demo_corpus
from torchdata_overlord.sources import ParquetSource
from torchdata_overlord.testing import assert_identical
from torchdata_overlord.transforms import ImageText, Tokenize

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
GLOBAL_BATCH = 16
STEPS = 5                     # reference LocalJob steps; the RpcJob runs 4 fresh + 2 resumed


def vlm_strategy(g):
    g = g.mix({"web": 0.6, "caps": 0.4})
    img = g.view("image").distribute("WORLD").cost(ol.encoder_cost).balance("greedy")
    return (g.view("text").distribute("DP").cost(ol.attention_flops)
            .balance("greedy", microbatches=2, max_tokens=2048, oversize="split").plan(encoder=img))


def make_mesh():
    mesh = ol.ClientPlaceTree(dp=2, cp=2, tp=2, pp=2)
    mesh.attach("encoder", dp=mesh.world_size)
    return mesh


def make_sources(corpus, seed=0):
    return [ParquetSource("web", corpus.sources["web"], Tokenize(corpus.spm_model, field=corpus.text_fields["web"]),
                          seed=seed),
            ParquetSource("caps", corpus.sources["caps"],
                          ImageText(corpus.spm_model, image_field="image", text_field="text", patch=14, max_side=112),
                          seed=seed)]


def job_kwargs(corpus):
    return dict(global_batch=GLOBAL_BATCH, seq_len=None, seed=0, buffer_size={"web": 24, "caps": 20}, workers=1,
                image_token_id=corpus.image_token_id)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_demo_corpus(tmp_path_factory.mktemp("corpus"), scale="test", seed=0)


@pytest.fixture(scope="module")
def reference(corpus):
    """LocalJob over STEPS steps: outputs, plans, and its states after steps 2 and 4."""
    steps, states = [], {}
    with_job = LocalJob(make_sources(corpus), vlm_strategy, make_mesh(), **job_kwargs(corpus))
    try:
        for k in range(STEPS):
            r = with_job.step()
            steps.append((r.step, r.outputs, r.plan.to_dict()))
            states[k + 1] = with_job.state_dict()
    finally:
        with_job.close()
    return steps, states


class DeclaredOnly:
    """A user's own source with exactly the members the ``Source`` protocol declares (no optional ``skips``),
    over a ParquetSource it builds, so its stream is the reference's."""

    def __init__(self, name, paths, transform, seed=0):
        self._inner = ParquetSource(name, paths, transform, seed=seed)
        self.name, self._args = name, (paths, transform, {"seed": seed})

    epoch = property(lambda self: self._inner.epoch)
    rows_passed = property(lambda self: self._inner.rows_passed)
    buffer_bytes = property(lambda self: self._inner.buffer_bytes)

    def next_raw(self):
        return self._inner.next_raw()

    def apply(self, row, where):
        return self._inner.apply(row, where)

    def check_progress(self, since):
        self._inner.check_progress(since)

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state):
        self._inner.load_state_dict(state)

    def spec_args(self):
        return self._args

    def close(self):
        self._inner.close()


def test_a_source_with_only_the_declared_members_runs_in_both_runtimes(corpus, reference):
    """``skips`` is optional: a source without it reports no skips, in stats() and in the start-up's warm fill
    (the rpc job's roles, here over InProcessTransport, fill every loader first), instead of an AttributeError."""
    steps, _ = reference
    web = make_sources(corpus)[0]
    sources = [DeclaredOnly("web", *web.spec_args()[:2], seed=0), make_sources(corpus)[1]]
    assert isinstance(sources[0], ol.Source) and not hasattr(sources[0], "skips")
    transport = InProcessTransport()
    try:
        for job in (LocalJob(sources, vlm_strategy, make_mesh(), **job_kwargs(corpus)),
                    RpcJob(sources, vlm_strategy, make_mesh(), transport=transport, **job_kwargs(corpus))):
            try:
                assert_identical(job.step().outputs, steps[0][1])
                web_stats = job.stats()["sources"]["web"]
                assert (web_stats["skipped"], web_stats["skipped_distinct"], web_stats["skipped_files"]) == (0, 0, {})
            finally:
                job.close()
    finally:
        transport.stop()


# ------------------------------------------------------------------------------ in-process

def test_source_spec_from_source(corpus):
    src = make_sources(corpus)[0]
    next(iter(src))
    spec = SourceSpec.from_source(src)
    spec = pickle.loads(pickle.dumps(spec))          # a used ParquetSource does not pickle; its spec does
    rebuilt = spec.build()
    assert rebuilt.files == src.files and rebuilt.state_dict() == src.state_dict()
    assert [next(rebuilt)[0] for _ in range(3)] == [next(src)[0] for _ in range(3)]
    src.close(), rebuilt.close()


def test_source_spec_of_a_uri_or_filesystem_source(corpus):
    import pyarrow.fs as pafs

    files = sorted(Path(corpus.root, "web").glob("*.parquet"))
    sub = pafs.SubTreeFileSystem(str(Path(corpus.root, "web")), pafs.LocalFileSystem())
    for src in (ParquetSource("web", [f"file://{f}" for f in files], seed=3),
                ParquetSource("web", "*.parquet", seed=3, filesystem=sub)):
        next(src)
        rebuilt = pickle.loads(pickle.dumps(SourceSpec.from_source(src))).build()
        assert rebuilt.state_dict() == src.state_dict()
        assert [next(rebuilt)[0] for _ in range(3)] == [next(src)[0] for _ in range(3)]
        src.close(), rebuilt.close()


def test_unpicklable_strategy_is_a_config_error(corpus):
    with pytest.raises(ol.ConfigError, match="must pickle"):
        RpcJob(make_sources(corpus), lambda g: vlm_strategy(g), make_mesh(), **job_kwargs(corpus))


def test_rpc_job_logic_in_process(corpus, reference):
    """The same job code over InProcessTransport (no RPC): identical stream and state round trips."""
    steps, states = reference
    transport = InProcessTransport()
    try:
        job = RpcJob(make_sources(corpus), vlm_strategy, make_mesh(), transport=transport, **job_kwargs(corpus))
        for k in range(2):
            r = job.step()
            assert r.step == steps[k][0] and r.plan.to_dict() == steps[k][2]
            assert_identical(r.outputs, steps[k][1])
        assert_identical(job.state_dict(), states[2])
        job.load_state_dict(states[3])
        assert job.step_index == 3
        r = job.step(ranks=[0, 5])
        assert sorted(r.outputs) == [0, 5]
        assert_identical(r.outputs, {k: steps[3][1][k] for k in (0, 5)})
        job.close()
    finally:
        transport.stop()


def test_start_up_fills_every_loader_and_stats_survive_a_dead_role(corpus):
    """The roles' start fills each loader's first buffer (under the start-up timeout, not the call
    timeout); ``stats()`` names a role that cannot answer instead of raising."""
    transport = InProcessTransport()
    job = None
    try:
        job = RpcJob(make_sources(corpus), vlm_strategy, make_mesh(), transport=transport, **job_kwargs(corpus))
        st = job.stats()
        assert st["unanswered"] == {}
        assert {n: s["buffered"] for n, s in st["sources"].items()} == job_kwargs(corpus)["buffer_size"]
        transport.kill(["constructor:0"])
        st = job.stats()
        assert list(st["unanswered"]) == ["constructor:0"] and "ActorDied" in st["unanswered"]["constructor:0"]
        assert "error" in st["constructors"]["constructor:0"] and "constructor:0" not in st["roles"]
        assert st["sources"]["web"]["buffered"] == 24 and "error" not in st["planner"]
    finally:
        if job is not None:
            job.close()                  # the live roles' threads are the job's to stop (a dead one freed its own)
        transport.stop()



def test_the_first_step_keeps_the_buffers_the_start_up_filled(corpus, reference):
    """The start-up fills every loader, then the trainer's first ``iter()`` loads the job's initial state:
    a loader that holds exactly that state keeps its buffer instead of reading and transforming it again
    (S=300: 13 s of a 30 s start): the row groups read by then are those one buffer's fill reads, and the
    steps are the local job's. (From its first delivery on, an rpc loader also reads ahead.)"""
    from torchdata_overlord.roles.source_loader import SourceLoader

    one_fill = {}
    for src in make_sources(corpus):
        loader = SourceLoader(src, job_kwargs(corpus)["buffer_size"][src.name])
        loader.fill()
        one_fill[src.name] = loader.stats()["row_groups_read"]
        loader.close()
    local = LocalJob(make_sources(corpus), vlm_strategy, make_mesh(), **job_kwargs(corpus))
    transport = InProcessTransport()
    job = None
    try:
        job = RpcJob(make_sources(corpus), vlm_strategy, make_mesh(), transport=transport, **job_kwargs(corpus))
        assert all(s["buffered"] for s in job.stats()["sources"].values())          # warm already
        for j in (local, job):
            j.load_state_dict(j.state_dict())            # what OverlordLoader.__iter__ does
            if j is job:
                assert {n: s["row_groups_read"] for n, s in j.stats()["sources"].items()} == one_fill
            got = [j.step() for _ in range(2)]
            for r, (step, outputs, plan) in zip(got, reference[0]):
                assert r.step == step and r.plan.to_dict() == plan
                assert_identical(r.outputs, outputs)
        assert all(s["read_ahead"] is None for s in local.stats()["sources"].values())
        assert all(s["read_ahead"] is not None for s in job.stats()["sources"].values())
    finally:
        local.close()
        if job is not None:
            job.close()
        transport.stop()


def test_a_fetch_forwarded_to_a_dead_constructor_fails_instead_of_hanging(corpus):
    """A constructor asked for ranks of another constructor's bucket forwards the fetch; when that
    constructor is dead, the forward fails at once (while the first still decides what to forward):
    the fetch fails naming the dead one, and the asking constructor keeps answering."""
    import threading

    from torchdata_overlord.roles.constructor import receives_nothing
    from torchdata_overlord.runtime.constructor_actor import ConstructorActor
    from torchdata_overlord.runtime.transport import ActorDied

    local = LocalJob(make_sources(corpus), vlm_strategy, make_mesh(), **job_kwargs(corpus))
    plan = local.step().plan
    local.close()
    foreign = [r for r in range(make_mesh().world_size) if not receives_nothing(plan, r)[0] and plan.bucket_of(r) == 1]
    assert foreign
    transport = InProcessTransport()
    try:
        args = (None, 0, -100, corpus.image_token_id, transport, 5.0)
        transport.start_actor("constructor:1", ConstructorActor, 1, *args)
        transport.kill(["constructor:1"])
        c0 = ConstructorActor(0, *args)
        c0.commit(0, 0, plan, [0], {}, {"constructors": ["constructor:0", "constructor:1"]})
        asked: list = []
        t = threading.Thread(target=lambda: asked.append(c0.fetch(0, 0, foreign, None, 0)), daemon=True)
        t.start()
        t.join(30)                                      # on a thread of its own: a hang fails the test
        assert not t.is_alive(), "the fetch hung forwarding to a dead constructor"
        with pytest.raises(ActorDied, match="constructor:1"):
            asked[0].result(timeout=30)
        assert c0.stats()["waiting_fetches"] == 0
        c0.close()
    finally:
        transport.stop()


def test_a_closed_constructor_leaves_no_build_thread_behind():
    """close() waits, bounded, for a build already under way on the constructor's build thread: no thread
    outlives a closed constructor (a test's leftover-thread check met one that was still ending)."""
    import threading
    import time

    from torchdata_overlord.runtime.constructor_actor import ConstructorActor

    c = ConstructorActor(7, None, 0, -100, None, None, 5.0)
    started = threading.Event()
    c.pool.submit(lambda: (started.set(), time.sleep(0.5)))
    assert started.wait(10)
    c.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("overlord-build-7") and t.is_alive()]


# ------------------------------------------------------------------------------ RPC (subprocess)

SCRIPT = """
import os, sys, time, torch
sys.path.insert(0, {tests!r})
import test_rpc_job as T
from torchdata_overlord.runtime.rpc_job import RpcJob

cfg = torch.load({inp!r}, weights_only=False)
out = {{"fresh": [], "resumed": []}}
t0 = time.monotonic()
with RpcJob(cfg["specs"], T.vlm_strategy, T.make_mesh(), n_workers=2, timeout=60, **cfg["kwargs"]) as job:
    out["pids"] = list(job.transport.worker_pids)
    out["start_s"] = time.monotonic() - t0
    for k in range(4):
        r = job.step()
        out["fresh"].append((r.step, r.outputs, r.plan.to_dict()))
        if k == 1:
            out["state2"] = job.state_dict()
    out["state4"] = job.state_dict()
    bad = dict(cfg["local_state2"], planner=dict(cfg["local_state2"]["planner"], seed=99))
    try:
        job.load_state_dict(bad)                  # fails inside the planner actor
    except Exception as e:
        out["error"] = (type(e).__name__, str(e))
    job.load_state_dict(cfg["local_state2"])      # rewind to LocalJob's state after step 2
    for _ in range(2):
        r = job.step()
        out["resumed"].append((r.step, r.outputs, r.plan.to_dict()))
from multiprocessing import forkserver, resource_tracker
helpers = {{getattr(forkserver._forkserver, "_forkserver_pid", None), getattr(resource_tracker._resource_tracker, "_pid", None)}}
def children(pid):
    try:
        with open(f"/proc/{{pid}}/task/{{pid}}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []
out["children"] = [c for c in children(os.getpid()) if c not in helpers]
out["helpers"] = sorted(p for p in helpers if p)
out["total_s"] = time.monotonic() - t0
torch.save(out, {outp!r})
"""


@pytest.mark.slow
def test_rpc_job_equals_local_job_and_resumes_across_runtimes(corpus, reference, tmp_path):
    steps, states = reference
    inp, outp = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"specs": [SourceSpec.from_source(s) for s in make_sources(corpus)], "kwargs": job_kwargs(corpus),
                "local_state2": states[2]}, inp)
    script = SCRIPT.format(tests=str(TESTS), inp=str(inp), outp=str(outp))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], timeout=120, capture_output=True,
                          text=True, cwd=str(ROOT), env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = torch.load(outp, weights_only=False)
    print(f"RpcJob subprocess: start-up {out['start_s']:.2f} s, 4+2 steps and close {out['total_s']:.2f} s")

    # every rank's output over 4 steps is bit-identical to LocalJob's, and so is the plan
    assert len(out["fresh"]) == 4
    for k, (step, outputs, plan) in enumerate(out["fresh"]):
        assert step == steps[k][0] == k and plan == steps[k][2]
        assert sorted(outputs) == list(range(make_mesh().world_size))
        assert_identical(outputs, steps[k][1])
    # a remote role's exception arrives with its type and names the actor
    assert out["error"][0] == "ConfigError" and "seed 99 vs 0" in out["error"][1], out["error"]
    assert "planner.attach()" in out["error"][1]
    # the stream holds images (pixels travelled over RPC) and CP-split text
    enc = [o["encoder"] for o in out["fresh"][0][1].values() if o["encoder"]]
    assert any(isinstance(px, torch.Tensor) and px.dtype == torch.uint8 for e in enc for px in e["pixels"])
    assert all(mb["cp_size"] == 2 for o in out["fresh"][0][1].values() for mb in o["microbatches"])
    # RpcJob's states have LocalJob's format and values
    assert_identical(out["state2"], states[2])
    assert_identical(out["state4"], states[4])
    # LocalJob's state after 2 steps, loaded into the (used) RpcJob, continues identically
    for k, (step, outputs, plan) in enumerate(out["resumed"], start=2):
        assert step == k and plan == steps[k][2]
        assert_identical(outputs, steps[k][1])
    # and RpcJob's state after 4 steps loaded into a fresh LocalJob continues identically
    job = LocalJob(make_sources(corpus), vlm_strategy, make_mesh(), **job_kwargs(corpus))
    try:
        job.load_state_dict(out["state4"])
        r = job.step()
        assert r.step == 4 and r.plan.to_dict() == steps[4][2]
        assert_identical(r.outputs, steps[4][1])
    finally:
        job.close()
    # a clean exit: no children left after close, and no worker process outlives the subprocess
    assert out["children"] == []
    assert len(out["pids"]) == 2 and not [p for p in out["pids"] + out["helpers"] if _alive(p)]


@pytest.mark.slow
def test_rpc_roles_own_their_files_and_report_processes(corpus, tmp_path):
    """Each source's Parquet files are read by its own loader process only, never held by the trainer; a
    default job puts its roles in as many processes as the cores the trainer leaves free (at least one,
    at most one per role) and nothing listens beyond loopback."""
    out = tmp_path / "fds.json"
    script = f"""
import json, os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus
from test_rpc_job import make_sources, vlm_strategy, make_mesh

from torchdata_overlord.runtime.procstats import listening_addresses as listening, open_paths

def open_files(pid):
    return open_paths(pid, ".parquet")

corpus = build_demo_corpus({str(corpus.root)!r}, scale="test", seed=0)
with ol.OverlordLoader(make_sources(corpus), vlm_strategy, make_mesh(), rank=0, global_batch=8, seq_len=None,
                       image_token_id=corpus.image_token_id, runtime="rpc", prefetch=1) as loader:
    seen = {{}}
    for _ in zip(range(4), loader):        # the roles keep working meanwhile: union what each process holds open
        stats = loader.stats()
        for pid in set(stats["roles"].values()) | {{os.getpid()}}:
            seen.setdefault(str(pid), set()).update(open_files(pid))
    report = {{"master": os.getpid(), "roles": stats["roles"], "open": {{k: sorted(v) for k, v in seen.items()}},
               "processes": {{str(k): v for k, v in stats["processes"].items()}}, "sources": stats["sources"],
               "constructors": stats["constructors"], "planner": stats["planner"],
               "listening": {{str(pid): listening(pid) for pid in set(stats["roles"].values()) | {{os.getpid()}}}}}}
json.dump(report, open({str(out)!r}, "w"))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    rep = json.loads(out.read_text())
    master = rep["master"]
    assert rep["open"][str(master)] == []                          # the trainer opens no data file
    for name in ("web", "caps"):
        pid = rep["roles"][f"loader:{name}"]
        assert pid != master
        # a row group's file is open only while it is read: the loader read its files, nobody else holds them
        assert rep["sources"][name]["row_groups_read"] > 0, rep["sources"][name]
        for other, files in rep["open"].items():
            if int(other) != pid:
                assert not [f for f in files if f"/{name}/" in f], f"{name} files open in pid {other}"
    for pid, mem in rep["processes"].items():
        assert mem["rss_mib"] and mem["rss_mib"] > 0 and mem["pss_mib"] and mem["pss_mib"] > 0
    assert rep["sources"]["web"]["served"] > 0
    # queue depths: one constructor per DP group, each holding at most the steps not yet consumed
    assert sorted(rep["constructors"]) == ["constructor:0", "constructor:1"]
    # a constructor builds only what a client asks for: rank 0's bucket (DP group 0), never the other one;
    # it holds the steps not yet consumed by every client, plus one until the Planner hears of the last
    held = {c: v["steps_held"] for c, v in rep["constructors"].items()}
    assert all(0 <= h <= 3 for h in held.values()), held
    assert rep["constructors"]["constructor:0"]["steps_built"] >= 4
    assert rep["constructors"]["constructor:1"]["steps_built"] == 0
    assert rep["planner"]["next_step"] >= 4 and all(c["waiting_fetches"] <= 1 for c in rep["constructors"].values())
    # a default single-node job: the roles share the cores the trainer leaves free; every process
    # listens on loopback only
    assert len(rep["roles"]) == 5
    assert len(set(rep["roles"].values())) == max(1, min(5, len(os.sched_getaffinity(0)) - 1))
    assert all(rep["listening"][pid] for pid in rep["listening"]), rep["listening"]
    assert all(a.startswith("127.0.0.1:") for addrs in rep["listening"].values() for a in addrs), rep["listening"]


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["SIGKILL the trainer", "SIGTERM its process group"])
def test_a_killed_trainer_leaves_no_role_process_behind(corpus, tmp_path, kill):
    """SIGKILL the trainer process mid-run, or SIGTERM its whole process group (as ``timeout`` or a
    scheduler's cancel does: the fork server and the roles get it too): its RPC worker processes (the
    roles) must exit, and the fork server's socket folder (``pymp-*``, which a trainer removes only when
    it exits) goes too, with the session's rendezvous store (``overlord-rpc-*``: it stayed, one per job)."""
    import signal
    import time

    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus
from test_rpc_job import make_sources, vlm_strategy, make_mesh
corpus = build_demo_corpus({str(corpus.root)!r}, scale="test", seed=0)
loader = ol.OverlordLoader(make_sources(corpus), vlm_strategy, make_mesh(), rank=0, global_batch=8, seq_len=None,
                           image_token_id=corpus.image_token_id, runtime="rpc", n_workers=2)
it = iter(loader)
next(it)
import multiprocessing.util
print(" ".join(str(p) for p in set(loader.stats()["roles"].values())), flush=True)
print(multiprocessing.util.get_temp_dir(), flush=True)
print(loader._job.transport.session.tmp, flush=True)
for _ in it:
    pass
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and proc.pid not in pids, (line, proc.stderr.read() if not line else "")
        folder = proc.stdout.readline().strip()
        assert os.path.basename(folder).startswith("pymp-") and any(
            n.startswith("listener-") for n in os.listdir(folder)), folder     # the fork server's socket
        store = proc.stdout.readline().strip()                   # the session's rendezvous store
        assert os.path.basename(store).startswith("overlord-rpc-") and os.path.isdir(store), store
        if kill == "SIGKILL the trainer":
            proc.send_signal(signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30                 # bounded poll of the process table (not our children)
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if _alive(p)]
            if alive:
                time.sleep(0.1)
        assert not alive, f"role processes {alive} outlived their trainer"
        while os.path.exists(folder) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(folder), f"{folder} outlived the killed trainer: {os.listdir(folder)}"
        assert not os.path.exists(store), f"{store} outlived the killed trainer"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_start_up_past_startup_timeout_fails_and_stops_its_roles(corpus, tmp_path):
    """``OverlordLoader(startup_timeout=)`` bounds the rpc start: past it, the constructor raises
    TransportStartupError naming the timeout, and no role process is left (multiprocessing's own
    fork server and resource tracker stay until the interpreter exits, as they do for any pool)."""
    script = tmp_path / "start.py"
    script.write_text(f"""
import json, os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import torchdata_overlord as ol
from torchdata_overlord.runtime.rpc_transport import TransportStartupError
from torchdata_overlord.sim.corpus import build_demo_corpus
from test_rpc_job import make_sources, vlm_strategy, make_mesh


def children():
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, ppid = open(f"/proc/{{d}}/stat").read().rsplit(")", 1)[1].split()[:2]
            cmd = open(f"/proc/{{d}}/cmdline").read().replace(chr(0), " ")
        except OSError:
            continue
        if int(ppid) == os.getpid() and state != "Z":
            out.append(cmd)
    return out


if __name__ == "__main__":
    corpus = build_demo_corpus({str(corpus.root)!r}, scale="test", seed=0)
    try:
        ol.OverlordLoader(make_sources(corpus), vlm_strategy, make_mesh(), rank=None, global_batch=8, seq_len=None,
                          image_token_id=corpus.image_token_id, runtime="rpc", n_workers=2, startup_timeout=0.001)
        print(json.dumps({{"error": None}}))
    except TransportStartupError as e:
        print(json.dumps({{"error": str(e), "children": children()}}))
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] is not None and "0.001 s" in out["error"], out
    left = [c for c in out["children"] if "multiprocessing.forkserver" not in c and "resource_tracker" not in c]
    assert left == [], left


@pytest.mark.slow
def test_an_exception_in_the_training_loop_stops_every_role(corpus, tmp_path):
    out = tmp_path / "exc.json"
    script = f"""
import json, os, sys
sys.path.insert(0, {str(TESTS)!r})
import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus
from test_rpc_job import make_sources, vlm_strategy, make_mesh
from multiprocessing import forkserver, resource_tracker
corpus = build_demo_corpus({str(corpus.root)!r}, scale="test", seed=0)
roles = []
try:
    with ol.OverlordLoader(make_sources(corpus), vlm_strategy, make_mesh(), rank=3, global_batch=8, seq_len=None,
                           image_token_id=corpus.image_token_id, runtime="rpc", n_workers=3, spares=1) as loader:
        for step, batch in enumerate(loader):
            stats = loader.stats()
            roles = sorted(set(stats["roles"].values()))
            spares = stats["spares"]
            if step == 1:
                raise RuntimeError("boom in the training loop")
except RuntimeError as e:
    error = str(e)
helpers = {{getattr(forkserver._forkserver, "_forkserver_pid", None), getattr(resource_tracker._resource_tracker, "_pid", None)}}
kids = [int(c) for c in open(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read().split()]
json.dump({{"error": error, "roles": roles, "spares": spares, "children": [c for c in kids if c not in helpers]}}, open({str(out)!r}, "w"))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    rep = json.loads(out.read_text())
    assert rep["error"] == "boom in the training loop" and len(rep["roles"]) == 3
    assert len(rep["spares"]) == 1 and rep["spares"][0] not in rep["roles"]     # an idle spare process
    assert rep["children"] == []
    assert not [p for p in rep["roles"] + rep["spares"] if _alive(p)]


@pytest.mark.parametrize("cores", [1, 2, 3, 8, 64])
def test_default_placement_shares_the_free_cores_and_isolates_roles_under_fault_tolerance(corpus, monkeypatch, tmp_path,
                                                                                          cores):
    """Without ``n_workers``, the roles of a job go in as many processes as the cores the trainer leaves
    free (at least one, at most one per role); with a checkpoint store or shadows, each role gets its own
    process, so a failure takes down one role."""
    from torchdata_overlord.runtime import job_config
    from torchdata_overlord.runtime.job_config import RoleConfig

    monkeypatch.setattr(job_config, "usable_cores", lambda: cores)
    cfg = RoleConfig(make_sources(corpus), vlm_strategy, make_mesh(), 8, None)
    roles = len(cfg.roles)
    assert roles == 5                                   # Planner, 2 Source Loaders, 2 Data Constructors
    assert cfg.default_workers() == {1: 1, 2: 1, 3: 2, 8: 5, 64: 5}[cores]
    kept = RoleConfig(make_sources(corpus), vlm_strategy, make_mesh(), 8, None, checkpoint_dir=str(tmp_path))
    assert kept.default_workers() == roles
    shadowed = RoleConfig(make_sources(corpus), vlm_strategy, make_mesh(), 8, None, shadows=True)
    assert shadowed.default_workers() == len(shadowed.roles) == 7


@pytest.mark.slow
def test_a_timed_out_next_names_a_frozen_role_process(corpus):
    """Without fault tolerance, a frozen Planner (SIGSTOP, a debugger) made next() time out saying only to raise
    the timeout "for very slow sources". It now names the roles whose process answers no ping."""
    from torchdata_overlord.runtime import faults

    loader = ol.OverlordLoader(make_sources(corpus), vlm_strategy, make_mesh(), rank=0, global_batch=8, seq_len=None,
                               image_token_id=corpus.image_token_id, runtime="rpc", n_workers=1, prefetch=0, timeout=6)
    pid = None
    try:
        it = iter(loader)
        next(it)
        pid = faults.freeze_role(loader, "planner")
        with pytest.raises(TimeoutError, match=r"no step produced within 6 s .*'planner'.* answers no ping .*frozen"):
            for _ in range(4):                       # (a step already on its way may still come)
                next(it)
    finally:
        if pid is not None:
            faults.thaw(pid)
        loader.close()


@pytest.mark.slow
def test_close_after_a_frozen_planner_waits_for_no_call_to_it(corpus):
    """Without fault tolerance, after next() timed out on a frozen Planner, close() still called it: the stats
    snapshot, the Planner's own stats and every role's close each waited out a call timeout, and the frozen
    worker got the full stop_timeout to exit (32 s with timeout=6, measured; over 2 minutes at the defaults).
    close() now pings the roles' processes first and sends a frozen one nothing: it returns within a few
    seconds, and every worker process, the frozen one too, is gone."""
    import threading
    import time

    from torchdata_overlord.runtime import faults

    loader = ol.OverlordLoader(make_sources(corpus), vlm_strategy, make_mesh(), rank=0, global_batch=8, seq_len=None,
                               image_token_id=corpus.image_token_id, runtime="rpc", n_workers=2, prefetch=0, timeout=6)
    pid, pids = None, list(loader._job.transport.worker_pids)
    try:
        it = iter(loader)
        next(it)
        pid = faults.freeze_role(loader, "planner")
        with pytest.raises(TimeoutError, match=r"'planner'.* answers no ping"):
            for _ in range(4):                       # (a step already on its way may still come)
                next(it)
        closing = threading.Thread(target=loader.close, daemon=True)
        t0 = time.monotonic()
        closing.start()
        closing.join(90)
        took = time.monotonic() - t0
        assert not closing.is_alive() and took < 8, took
        assert loader.stats()["closed"] and "planner" not in loader.stats()["roles"]
        assert len(pids) == 2 and not [p for p in pids if _alive(p)]
    finally:
        if pid is not None and _alive(pid):
            faults.thaw(pid)
        loader.close()


class StuckFrom:
    """A transform (picklable) that from its ``n``-th row on waits until the file ``release`` exists, 120 s at most:
    user code that does not return."""

    def __init__(self, inner, n, release):
        self.inner, self.n, self.release, self.calls = inner, n, release, 0

    def __call__(self, row):
        import time

        self.calls += 1
        deadline = time.monotonic() + 120
        while self.calls >= self.n and not os.path.exists(self.release) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.inner(row)


@pytest.mark.slow
def test_the_stats_a_close_keeps_wait_for_a_busy_role_only_the_close_bound(corpus, tmp_path):
    """A job's close first keeps the roles' stats, for ``stats()`` after it. Under rpc (no close deadline of
    the local runtime's), a role busy in a call, here a Source Loader whose transform is stuck in user code,
    was waited for until its calls timed out, up to twice (60 to 120 s at the defaults; 8 s with timeout=8,
    measured). It now gets ``min(timeout, 5)`` s in all, and is listed as unanswered."""
    import time

    from torchdata_overlord.runtime.client_stats import snapshot

    release = tmp_path / "release"
    sources = make_sources(corpus)
    sources[0] = ParquetSource("web", corpus.sources["web"],
                               StuckFrom(Tokenize(corpus.spm_model, field=corpus.text_fields["web"]), 40, str(release)))
    transport = InProcessTransport()          # the rpc job's code, in this process
    job = None
    try:
        job = RpcJob(sources, vlm_strategy, make_mesh(), transport=transport, timeout=8, **job_kwargs(corpus))
        # the Planner gives up on the stuck loader after its call timeout, twice 8 s (then nothing replaces it)
        with pytest.raises(ol.OverlordError, match="loader:web"):
            for _ in range(20):
                job.step()
        t0 = time.monotonic()
        kept = snapshot(job)
        took = time.monotonic() - t0
        assert took < 7, took
        assert "loader:web" in kept["unanswered"] and "error" in kept["sources"]["web"], kept["unanswered"]
        assert "error" not in kept["planner"] and kept["sources"]["caps"]["buffered"] > 0
    finally:
        release.touch()                       # the transform returns
        if job is not None:
            job.close()
        transport.stop()
