"""Several rpc loaders in one process: a training and an evaluation loader open at once, and loaders
opened, closed and opened again (a notebook re-running a cell). Each stream must equal the local
runtime's, and once every loader is closed nothing may be left: no child process, no listening
socket, no thread.

Runs in a ``python -c`` subprocess (the RPC agent is per process); the two configurations differ in
mesh, batch and seed but use the same role names, so jobs that shared one group and mixed up their
actors would show it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus
from torchdata_overlord.sources import ParquetSource
from torchdata_overlord.testing import assert_identical
from torchdata_overlord.transforms import ImageText, Tokenize

from test_rpc_job import _alive

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
#: name -> (mesh sizes, global batch, seed): a "train" and an "eval" loader
CONFIGS = {"train": ({"dp": 2}, 8, 0), "eval": ({"dp": 1, "cp": 2}, 6, 5)}


def strategy(g):
    return (g.mix({"web": 0.6, "caps": 0.4}).distribute("DP").cost(ol.attention_flops)
            .balance("greedy", microbatches=2, max_tokens=2048, oversize="split"))


def make_loader(corpus, name: str, runtime: str, rank: int | None = None, **rpc):
    sizes, batch, seed = CONFIGS[name]
    sources = [ParquetSource("web", corpus.sources["web"], Tokenize(corpus.spm_model, field=corpus.text_fields["web"]),
                             seed=seed),
               ParquetSource("caps", corpus.sources["caps"],
                             ImageText(corpus.spm_model, image_field="image", text_field="text", patch=14, max_side=112),
                             seed=seed)]
    return ol.OverlordLoader(sources, strategy, ol.ClientPlaceTree(**sizes), rank=rank, global_batch=batch,
                             seq_len=None, seed=seed, image_token_id=corpus.image_token_id, runtime=runtime, **rpc)


SCRIPT = """
import json, os, random, sys, threading, torch
sys.path.insert(0, {tests!r})
from test_rpc_process_lifecycle import make_loader
from torchdata_overlord.runtime.procstats import listening_addresses
from torchdata_overlord.sim.corpus import build_demo_corpus


def sockets():
    fds = os.listdir("/proc/self/fd")
    return sum(os.readlink(f"/proc/self/fd/{{fd}}").startswith("socket:") for fd in fds if os.path.exists(f"/proc/self/fd/{{fd}}"))


def children():
    from multiprocessing import forkserver, resource_tracker
    helpers = {{getattr(forkserver._forkserver, "_forkserver_pid", None), getattr(resource_tracker._resource_tracker, "_pid", None)}}
    kids = open(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read().split()
    return [int(c) for c in kids if int(c) not in helpers]


if __name__ == "__main__":
    corpus = build_demo_corpus({root!r}, scale="test", seed=0)
    before = {{"sockets": sockets(), "threads": sorted(t.name for t in threading.enumerate())}}
    out = {{"together": {{"train": [], "eval": []}}, "again": []}}
    # a training and an evaluation loader open at once, next() interleaved in a random order
    train = make_loader(corpus, "train", "rpc", n_workers=2)
    ev = make_loader(corpus, "eval", "rpc")
    its = {{"train": iter(train), "eval": iter(ev)}}
    for name in {order!r}:
        out["together"][name].append(next(its[name]))
    roles = {{"train": train.stats()["roles"], "eval": ev.stats()["roles"]}}
    ev.close()                                          # the other one goes on
    out["together"]["train"].append(next(its["train"]))
    train.close()
    out["left_after_both"] = children()
    # opened, closed, opened again: each a fresh stream
    for name in ("eval", "train"):
        with make_loader(corpus, name, "rpc", n_workers=1) as loader:
            out["again"].append([x for _, x in zip(range(2), loader)])
    out["roles"] = roles
    out["after"] = {{"children": children(), "listening": listening_addresses(os.getpid()), "sockets": sockets(),
                    "threads": sorted(t.name for t in threading.enumerate())}}
    out["before"] = before
    torch.save(out, {out!r})
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_demo_corpus(tmp_path_factory.mktemp("corpus"), scale="test", seed=0)


def local_stream(corpus, name: str, steps: int) -> list:
    with make_loader(corpus, name, "local") as loader:
        return [x for _, x in zip(range(steps), loader)]


@pytest.mark.slow
def test_two_rpc_loaders_at_once_and_one_after_another(corpus, tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    order = ["train"] * 3 + ["eval"] * 3
    rng.shuffle(order)                               # how the two loaders' next() calls interleave
    out = tmp_path / "out.pt"
    script = SCRIPT.format(tests=str(TESTS), root=str(corpus.root), order=order, out=str(out))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=str(ROOT),
                          env=env)
    assert proc.returncode == 0, f"interleaving seed {seed}\n" + proc.stderr[-4000:]
    print(f"4 rpc loaders in one process: {time.monotonic() - t0:.1f} s")
    got = torch.load(out, weights_only=False)

    expected = {name: local_stream(corpus, name, 4) for name in CONFIGS}
    assert len(got["together"]["train"]) == 4 and len(got["together"]["eval"]) == 3
    for name, items in got["together"].items():
        for k, item in enumerate(items):
            assert_identical(item, expected[name][k])
    assert_identical(got["again"][0], expected["eval"][:2])
    assert_identical(got["again"][1], expected["train"][:2])
    # the second loader shared the first one's worker processes (one RPC group per process)
    assert set(got["roles"]["eval"].values()) <= set(got["roles"]["train"].values())
    # nothing left behind, and nothing in the stderr but what the script printed
    assert got["left_after_both"] == [] and got["after"]["children"] == []
    assert got["after"]["listening"] == []
    assert got["after"]["sockets"] <= got["before"]["sockets"], (got["before"], got["after"])
    assert got["after"]["threads"] == got["before"]["threads"], (got["before"], got["after"])
    pids = {p for roles in got["roles"].values() for p in roles.values()}
    assert not [p for p in pids if _alive(p)]
    assert "tensorpipe" not in proc.stderr.lower(), proc.stderr[-3000:]


@pytest.mark.slow
def test_stats_after_close_describe_the_closed_job(corpus):
    """``stats()`` after ``close()`` answers as the local runtime does (here, in the test process): the
    roles' figures as the close began, this client's final ones, and ``closed``; the roles are gone."""
    with make_loader(corpus, "eval", "local") as local:
        next(iter(local))
    local_after = local.stats()
    loader = make_loader(corpus, "eval", "rpc", n_workers=1)
    with loader:
        for _ in zip(range(2), loader):
            pass
        during = loader.stats()
    after = loader.stats()
    assert set(local_after) <= set(after) and after["closed"] is True and after["step"] == 2
    assert after["sources"]["web"]["served"] >= during["sources"]["web"]["served"] > 0
    assert after["roles"] == during["roles"] and after["unanswered"] == {}
    assert not [p for p in set(after["roles"].values()) if _alive(p)]


def _group_trainer(rank: int, root: str, out_dir: str) -> None:
    """Trainer ``rank`` of a 2-process gloo group: a training and an evaluation loader over the same
    group at once (rank 0 starts the roles, shared), then a loader of its own group (other ranks)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    corpus = build_demo_corpus(root, scale="test", seed=0)
    out = {}
    train = make_loader(corpus, "train", "rpc", rank=rank, group="default", n_workers=2)
    ev = make_loader(corpus, "train", "rpc", rank=rank, group="default")
    out["train"] = [x for _, x in zip(range(2), train)]
    out["eval"] = [x for _, x in zip(range(2), ev)]
    ev.close()
    train.close()
    with make_loader(corpus, "train", "rpc", rank=rank, group="default", n_workers=1) as again:
        out["again"] = [x for _, x in zip(range(2), again)]
    dist.destroy_process_group()
    torch.save(out, f"{out_dir}/out-{rank}.pt")


@pytest.mark.slow
def test_trainer_ranks_open_several_rpc_loaders_over_one_group(corpus, tmp_path):
    """A trainer group (``group=``) opens two loaders at once, then one more after closing both; the
    last one puts this client at another RPC rank than the first group did. Every rank's part of
    every stream equals the local runtime's."""
    from test_rpc_group import _spawn_group

    _spawn_group(_group_trainer, (str(corpus.root), str(tmp_path)), 2)
    expected = local_stream(corpus, "train", 2)
    for r in range(2):
        got = torch.load(tmp_path / f"out-{r}.pt", weights_only=False)
        for name in ("train", "eval", "again"):
            for k, item in enumerate(got[name]):
                assert_identical(item, expected[k][r])


LONG_TMPDIR_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from multiprocessing import process
from test_rpc_process_lifecycle import make_loader
from torchdata_overlord.runtime import rpc_session
from torchdata_overlord.sim.corpus import build_demo_corpus

if __name__ == "__main__":
    if sys.argv[1] == "nowhere":
        rpc_session._SHORT_TEMP = ()                 # no short system folder to fall back on
    corpus = build_demo_corpus({root!r}, scale="test", seed=0)
    try:
        with make_loader(corpus, "train", "rpc", n_workers=1) as loader:
            items = [x for _, x in zip(range(2), loader)]
    except Exception as e:
        print(json.dumps({{"error": type(e).__name__, "message": str(e)}}))
    else:
        torch.save(items, {out!r})
        print(json.dumps({{"folder": process.current_process()._config.get("tempdir")}}))
"""


@pytest.mark.slow
def test_rpc_runtime_starts_under_a_tmpdir_too_long_for_a_unix_socket(corpus, tmp_path):
    """A scheduler's per-job TMPDIR can be longer than a Unix socket's path allows (107 bytes); the fork
    server's socket then goes under a short system folder, which is gone after the process exits.
    Where there is none, the error names TMPDIR and what to do."""
    long_dir = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    long_dir.mkdir()
    assert len(str(long_dir)) >= 100
    out = tmp_path / "items.pt"
    script = LONG_TMPDIR_SCRIPT.format(tests=str(TESTS), root=str(corpus.root), out=str(out))
    env = dict(os.environ, TMPDIR=str(long_dir),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    runs = {}
    for case in ("fallback", "nowhere"):
        proc = subprocess.run([sys.executable, "-c", script, case], capture_output=True, text=True, timeout=300,
                              cwd=str(ROOT), env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[case] = json.loads(proc.stdout.strip().splitlines()[-1])
    folder = runs["fallback"]["folder"]
    assert folder is not None and len(folder) < 40 and not folder.startswith(str(tmp_path)), folder
    assert not os.path.exists(folder)                   # removed at exit, as multiprocessing's own folder is
    assert_identical(torch.load(out, weights_only=False), local_stream(corpus, "train", 2))
    assert runs["nowhere"]["error"] == "ConfigError"
    assert "set TMPDIR to a shorter folder" in runs["nowhere"]["message"]
    assert str(long_dir) in runs["nowhere"]["message"]


def _open_one_loader(root: str) -> None:
    """A process started by the trainer of SHARED_TMP_SCRIPT: an rpc loader of its own, one step."""
    with make_loader(build_demo_corpus(root, scale="test", seed=0), "eval", "rpc", n_workers=1) as loader:
        next(iter(loader))


def _nothing() -> None:
    pass


SHARED_TMP_SCRIPT = """
import json, multiprocessing as mp, os, sys
sys.path.insert(0, {tests!r})
from multiprocessing import util
from test_rpc_process_lifecycle import _nothing, _open_one_loader, make_loader
from torchdata_overlord.sim.corpus import build_demo_corpus

if __name__ == "__main__":
    corpus = build_demo_corpus({root!r}, scale="test", seed=0)
    with make_loader(corpus, "train", "rpc", n_workers=1) as loader:
        next(iter(loader))
    folder = util.get_temp_dir()
    ours = [n for n in os.listdir(folder) if n.startswith("listener-")]
    p = mp.get_context("spawn").Process(target=_open_one_loader, args=({root!r},))
    p.start()
    p.join(240)
    q = mp.get_context("forkserver").Process(target=_nothing)   # through our fork server's socket
    q.start()
    q.join(60)
    print(json.dumps({{"folder": folder, "ours": ours, "child": p.exitcode, "forked": q.exitcode,
                      "left": [n for n in os.listdir(folder) if n.startswith("listener-")]}}))
"""


@pytest.mark.slow
def test_a_fork_server_leaves_a_shared_socket_folder_to_the_process_that_made_it(corpus, tmp_path):
    """A process started by a trainer (``spawn``) inherits its ``pymp-*`` folder and starts its own fork server
    there. When that child ends, its server must not take the trainer's socket (or the folder) with it:
    the trainer's server still forks, and at the trainer's exit the folder goes without an error."""
    script = SHARED_TMP_SCRIPT.format(tests=str(TESTS), root=str(corpus.root))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400, cwd=str(ROOT),
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["child"] == 0 and got["forked"] == 0, (got, proc.stderr[-3000:])
    assert len(got["ours"]) == 1 and got["ours"][0] in got["left"]          # the trainer's socket stayed
    assert not os.path.exists(got["folder"])                                # removed at the trainer's exit
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_is_the_trainers_to_handle(corpus, tmp_path):
    """A terminal's Ctrl-C reaches the trainer's whole process group, role processes included. They leave it to
    the trainer: one that catches it and goes on (a notebook's interrupt) keeps its job, and one that exits leaves
    no process behind and no traceback of a role process (each role process used to die of it, printing one, and
    the job was lost)."""
    script = f"""
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)    # (a background job starts with SIGINT ignored)
sys.path.insert(0, {str(TESTS)!r})
from test_rpc_process_lifecycle import make_loader
from torchdata_overlord.sim.corpus import build_demo_corpus
if __name__ == "__main__":
    corpus = build_demo_corpus({str(Path(corpus.root))!r}, scale="test", seed=0)
    with make_loader(corpus, "train", "rpc", n_workers=2) as loader:
        it = iter(loader)
        next(it)
        try:
            print("ready", flush=True)             # (the interrupt may come while this prints)
            while True:
                next(it)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        print("continued", [x[0]["step"] for _, x in zip(range(3), loader)], flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(ROOT), start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
        os.killpg(proc.pid, signal.SIGINT)                       # as a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "interrupted" in out and "continued [" in out, out + err[-3000:]
    assert "overlord-actors" not in err and "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:                           # the group empties as the roles exit
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"processes of the trainer's group are left: {subprocess.run(['pgrep', '-g', str(proc.pid), '-a'], capture_output=True, text=True).stdout}")


FORK_SERVER_DIES_SCRIPT = """
import json, os, signal, sys, time, torch
sys.path.insert(0, {tests!r})
from multiprocessing import forkserver
from test_rpc_process_lifecycle import make_loader
from torchdata_overlord.sim.corpus import build_demo_corpus

if __name__ == "__main__":
    corpus = build_demo_corpus({root!r}, scale="test", seed=0)
    out = {{"items": []}}
    with make_loader(corpus, "train", "rpc", n_workers=2) as loader:
        it = iter(loader)
        out["items"] += [next(it) for _ in range(2)]
        os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)   # as the OOM killer may: the roles live on
        time.sleep(0.5)
        out["items"] += [next(it) for _ in range(2)]
        roles = loader.stats()["roles"]
        out["roles"] = sorted(set(roles.values()))
        os.kill(roles["planner"], signal.SIGKILL)                          # a role process that does die is seen
        try:
            for _ in range(20):
                next(it)
        except Exception as e:
            out["error"] = f"{{type(e).__name__}}: {{e}}"
    with make_loader(corpus, "eval", "rpc", n_workers=1) as loader:        # a new fork server starts the next job
        out["again"] = next(iter(loader))
    torch.save(out, {out!r})
"""


@pytest.mark.slow
def test_roles_outlive_the_fork_server_that_started_them(corpus, tmp_path):
    """The fork server only starts role processes; multiprocessing reads their exits through its socket, and
    when it died (SIGKILL, or the OOM killer: it holds torch) every role process read as exited with code 255,
    and the job failed with a role 'lost' that still ran. The roles serve on; a role process that does die
    later is reported so (its exit code, which only the fork server could read, is unknown); the next job starts
    a new fork server."""
    out = tmp_path / "out.pt"
    script = FORK_SERVER_DIES_SCRIPT.format(tests=str(TESTS), root=str(corpus.root), out=str(out))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=str(ROOT),
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    assert_identical(got["items"], local_stream(corpus, "train", 4))
    assert got["error"].startswith("RoleLost"), got["error"]
    assert "'planner'" in got["error"] and "code 255" not in got["error"], got["error"]
    assert_identical(got["again"], local_stream(corpus, "eval", 1)[0])
    assert not [p for p in got["roles"] if _alive(p)]
