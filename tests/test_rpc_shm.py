"""Same-host RPC buffers in shared memory (runtime/shm.py): the same objects arrive, a region is reused
only once the receiver's last view is gone, a full arena falls back to the socket, nothing is ever
left in /dev/shm (after a close or a SIGKILL), a killed sender's views stay valid, and
OVERLORD_RPC_SHM=0 keeps every buffer on the socket."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from torchdata_overlord.runtime import shm
from torchdata_overlord.runtime.procstats import process_running
from torchdata_overlord.runtime.wire import discard, pack, unpack


def _dev_shm() -> set:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def _dev_shm_maps(pid: int) -> set:
    """The /dev/shm files ``pid`` maps (other code in a test process, e.g. torch.multiprocessing, may map some)."""
    return {line.split(None, 5)[-1] for line in _maps(pid).splitlines() if "/dev/shm/" in line}


def _until(condition, timeout: float = 30.0, what: str = "") -> None:
    """Wait for ``condition()`` to hold (re-checked every 10 ms), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


@pytest.fixture
def arena(monkeypatch):
    """This process's own arena, with a pretend peer that shares the host (no RPC group needed)."""
    shm.reset()
    shm.set_enabled(True)
    monkeypatch.setitem(shm._PEERS, "peer", True)
    yield
    shm.set_enabled(None)
    shm.reset()


def _sample(i: int, n: int = 3000) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"ids": torch.randint(0, 1000, (n,), generator=g), "img": torch.rand(3, 8, 5, generator=g).permute(1, 2, 0),
            "half": torch.rand(7, generator=g).to(torch.bfloat16), "k": i}


def _same(a: dict, b: dict) -> bool:
    return a["k"] == b["k"] and all(torch.equal(a[x], b[x]) and a[x].dtype == b[x].dtype for x in ("ids", "img", "half"))


def test_pack_into_shared_memory_then_unpack_gives_the_same_objects(arena):
    before, mapped = _dev_shm(), _dev_shm_maps(os.getpid())
    objs = {i: _sample(i) for i in range(4)}
    data, ref = pack(objs, peer="peer")
    assert isinstance(ref, tuple) and ref[0] == "shm"              # a handle, not a tensor
    got = unpack(data, ref)
    assert all(_same(objs[i], got[i]) for i in objs)
    assert "memfd:overlord-wire" in _maps(os.getpid()) and _dev_shm_maps(os.getpid()) == mapped
    assert _dev_shm() - before == set()
    # no peer given, or the peer not known to share the host: the buffer is a tensor, as before
    assert isinstance(pack(objs)[1], torch.Tensor)
    assert isinstance(pack(objs, peer="elsewhere")[1], torch.Tensor)


def test_a_region_is_reused_only_after_the_last_view_is_gone(arena):
    data, ref = pack({"x": torch.arange(1000)}, peer="peer")
    x = unpack(data, ref)["x"]
    y = x[10:20].view(2, 5)                  # a view of a view keeps the region too
    del x
    gc.collect()
    data2, ref2 = pack({"x": torch.full((1000,), 7)}, peer="peer")
    assert ref2[4] != ref[4]                 # the first region is still held: another one is used
    assert torch.equal(y.flatten(), torch.arange(10, 20))
    del y
    gc.collect()
    data3, ref3 = pack({"x": torch.full((1000,), 9)}, peer="peer")
    assert ref3[4] == ref[4]                 # freed by the receiver's last view: reused, lowest first
    assert torch.equal(unpack(data3, ref3)["x"], torch.full((1000,), 9))
    del data2, ref2


def test_a_receiver_that_exits_gives_its_views_back_and_a_forked_child_frees_nothing(arena, tmp_path):
    """A receiver that still holds views when it exits normally (a trainer's last batches) frees their regions
    in the sender's arena, which goes on; a child forked from a receiver frees nothing of what the receiver
    still reads when the child drops its copies."""
    data, ref = pack({"x": torch.arange(1000)}, peer="peer")
    words = shm.current().words
    msg = tmp_path / "msg.pt"
    msg.write_bytes(pickle.dumps((data, ref)))
    code = textwrap.dedent("""
        import pickle, sys
        from torchdata_overlord.runtime.wire import unpack
        data, ref = pickle.loads(open(sys.argv[1], "rb").read())
        kept = unpack(data, ref)
        assert int(kept["x"].sum()) == 499500
    """)
    done = subprocess.run([sys.executable, "-c", code, str(msg)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert words[ref[4] // 8] == 0                      # the receiver let go of it as it exited

    data, ref = pack({"x": torch.arange(1000)}, peer="peer")
    kept = unpack(data, ref)
    pid = os.fork()
    if pid == 0:                                         # the child: drop its copies of the views, and go
        del kept
        gc.collect()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert words[ref[4] // 8] == 1                       # still live: this process reads it
    assert int(kept["x"].sum()) == 499500
    del kept
    gc.collect()
    assert words[ref[4] // 8] == 0


def test_a_full_arena_falls_back_to_the_socket_and_unsent_regions_come_back(arena, monkeypatch):
    monkeypatch.setenv(shm.SIZE_ENV, "4")
    shm.reset()
    shm.set_enabled(True)
    monkeypatch.setitem(shm._PEERS, "peer", True)
    big = {"x": torch.zeros(1_000_000, dtype=torch.uint8)}        # a message may take a quarter of 4 MiB
    held = [unpack(*pack(big, peer="peer")) for _ in range(4)]
    assert all(h["x"].untyped_storage().data_ptr() != held[0]["x"].untyped_storage().data_ptr() for h in held[1:])
    _, ref = pack(big, peer="peer")
    assert isinstance(ref, torch.Tensor)                             # full: the socket
    del held
    gc.collect()
    data, ref = pack(big, peer="peer")
    assert isinstance(ref, tuple)
    discard(ref)                                                     # never sent: its region is free again
    _, again = pack(big, peer="peer")
    assert again[4] == ref[4]
    _, huge = pack({"x": torch.zeros(2 << 20, dtype=torch.uint8)}, peer="peer")
    assert isinstance(huge, torch.Tensor)                            # > a quarter of the arena: the socket


def test_set_enabled_false_keeps_buffers_on_the_socket(arena):
    shm.set_enabled(False)
    assert isinstance(pack({"x": torch.arange(5)}, peer="peer")[1], torch.Tensor)


# ------------------------------------------------------------------------------------ across processes

class Holder:
    """A constructor-like actor: keeps what it is given; sends to a peer."""

    def __init__(self, peers=None):
        self.peers, self.held = peers, []

    def put(self, recs):
        self.held.append(recs)
        return len(self.held)

    def echo(self, x):
        return x

    def sums(self):
        return [{k: int(v["ids"].sum()) for k, v in recs.items()} for recs in self.held]

    def send(self, to, n, seed):
        recs = {i: _sample(seed + i) for i in range(n)}
        self.peers.call(to, "put", recs, timeout=30).result(35)
        return {i: int(r["ids"].sum()) for i, r in recs.items()}

    def shm_stats(self):
        return shm.stats()

    def maps(self):
        return _maps(os.getpid())


@pytest.mark.slow
def test_rpc_same_host_buffers_travel_in_shared_memory_and_leave_nothing_behind():
    """Across processes: buffers go through the arena (after the probe), arrive identical, and
    neither a normal close nor a SIGKILL of the sender leaves anything in /dev/shm; the receiver's
    views of a killed sender's arena stay valid."""
    from torchdata_overlord.runtime.rpc_transport import RpcTransport

    before, mapped = _dev_shm(), _dev_shm_maps(os.getpid())
    t0 = time.time()
    with RpcTransport(n_workers=2, startup_timeout=60, rpc_timeout=30, stop_timeout=10) as t:
        t.place({"a": 0, "b": 1})
        t.start_actor("b", Holder, worker=1)
        t.start_actor("a", Holder, t.peers(), worker=0)
        sent = [t.call("a", "send", "b", 4, 10 * k, timeout=30).result(40) for k in range(6)]
        assert t.call("b", "sums", timeout=30).result(40) == sent
        a_stats = t.call("a", "shm_stats", timeout=30).result(40)
        b_stats = t.call("b", "shm_stats", timeout=30).result(40)
        assert a_stats["peers"].get("overlord-actors-1") is True and a_stats["sent"] >= 4
        assert b_stats["received"] == a_stats["sent"]
        # answers to the client come back through shared memory too (the client probed by the worker)
        x = torch.randn(100, 100)

        def echoed_through_shm() -> bool:          # the worker probes this client on its first answer
            y = t.call("b", "echo", {"x": x}, timeout=30).result(40)
            assert torch.equal(y["x"], x)
            return t.call("b", "shm_stats", timeout=30).result(40)["sent"] >= 1
        _until(echoed_through_shm, what="an answer to the client through shared memory")
        assert _dev_shm_maps(os.getpid()) == mapped
        for pid in t.worker_pids:
            assert _dev_shm_maps(pid) == set()
        assert "memfd:overlord-wire" in t.call("a", "maps", timeout=30).result(40)
        # kill the sender while the receiver holds views of its arena: they stay readable
        killed = t.worker_pids[0]
        os.kill(killed, signal.SIGKILL)
        _until(lambda: not process_running(killed), what=f"process {killed} to exit")   # gone or a zombie
        assert t.call("b", "sums", timeout=30).result(40) == sent
    new = {e for e in _dev_shm() - before if os.stat(f"/dev/shm/{e}").st_mtime >= t0 - 1}
    assert new == set(), f"left in /dev/shm: {sorted(new)}"


@pytest.mark.slow
def test_rpc_shm_off_in_the_environment_keeps_every_buffer_on_the_socket(tmp_path):
    code = textwrap.dedent("""
        import torch
        from torchdata_overlord.runtime.rpc_transport import RpcTransport
        from torchdata_overlord.runtime import shm
        from test_rpc_shm import Holder

        if __name__ == "__main__":
            with RpcTransport(n_workers=2, startup_timeout=60, rpc_timeout=30, stop_timeout=10) as t:
                t.place({"a": 0, "b": 1})
                t.start_actor("b", Holder, worker=1)
                t.start_actor("a", Holder, t.peers(), worker=0)
                sent = [t.call("a", "send", "b", 3, k, timeout=30).result(40) for k in range(4)]
                assert t.call("b", "sums", timeout=30).result(40) == sent
                x = torch.arange(1000)
                for _ in range(3):
                    assert torch.equal(t.call("b", "echo", {"x": x}, timeout=30).result(40)["x"], x)
                s = [t.call(n, "shm_stats", timeout=30).result(40) for n in ("a", "b")]
                assert all(x["sent"] == 0 and x["received"] == 0 for x in s), s
                assert shm.stats()["sent"] == 0 and shm.stats()["received"] == 0
            print("OK")
    """)
    script = tmp_path / "off.py"
    script.write_text(code)
    env = {**os.environ, "OVERLORD_RPC_SHM": "0",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_a_call_to_a_closed_job_gives_its_arguments_memory_back(arena):
    """A call that arrives for an actor of a job already closed is answered with the closing, unread: the
    shared memory its arguments came in goes back to the caller (it stayed live until the group ended)."""
    from torchdata_overlord.runtime import _rpc_worker as W

    W._drop("closed-job/")
    try:
        data, ref = pack(((torch.arange(5000),), {}), peer="peer")
        words = shm.current().words
        assert words[ref[4] // 8] == 1
        answers = []
        W.dispatch("closed-job/constructor:0", "caller", 0, "put", data, ref, answers.append)
        assert len(answers) == 1 and "closed" in str(unpack(*answers[0]).text)
        assert words[ref[4] // 8] == 0
    finally:
        with W._ACTORS_LOCK:
            W._DROPPED.discard("closed-job/")
