"""The actor transport: InProcessTransport and RpcTransport give the same results; ordering,
concurrency, timeouts, remote exceptions, dead workers, loopback-only sockets, clean stop."""

from __future__ import annotations

import os
import signal
import threading
import time
import concurrent.futures as cf
import multiprocessing as mp

import pytest
import torch

import torchdata_overlord as ol
from torchdata_overlord.runtime.inprocess import InProcessTransport
from torchdata_overlord.runtime.transport import ActorDied, CallTimeout
from torchdata_overlord.sim import SimulatedLoaders, SyntheticSource

SOURCES = [SyntheticSource("web", "web"), SyntheticSource("code", "code"), SyntheticSource("caps", "image_text")]
MESH = dict(pp=1, dp=2, cp=1, tp=2)


class Strategy:
    """A picklable strategy (module-level class, importable in the workers)."""

    def __call__(self, g):
        return (g.mix(ol.Constant({"web": 0.5, "code": 0.3, "caps": 0.2})).distribute("DP").cost(ol.attention_flops)
                .balance("karmarkar_karp", microbatches=2).broadcast_at("TP"))


def make_planner():
    return ol.Planner(Strategy(), ol.ClientPlaceTree(**MESH), 16, seed=7)


class Pooled:
    """An actor holding a thread pool, as a Source Loader with workers does."""

    def __init__(self):
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="overlord-pooled")
        self.closed = False

    def work(self):
        return self.pool.submit(threading.current_thread).result(10).name

    def close(self):
        self.closed = True
        self.pool.shutdown(wait=True)


class Counter:
    def __init__(self, start=0):
        self.value, self.log = start, []

    def add(self, k):
        self.log.append(k)
        self.value += k
        return self.value

    def echo(self, x):
        return x

    def history(self):
        return list(self.log)

    def fail(self, msg):
        raise ValueError(msg)

    def wait(self, event, timeout):
        return event.wait(timeout)

    def block(self, seconds):
        time.sleep(seconds)
        return seconds

    def unpicklable(self):
        return lambda: None


class Relay:
    """An actor that calls other actors through the peers handle roles get (as a loader puts to a constructor)."""

    def __init__(self, peers):
        self.peers = peers

    def same_object(self, name):
        """Whether ``name``'s echo answers with the very object sent (passed by reference, no pickling)."""
        sent = {"payload": torch.arange(4)}
        return self.peers.call(name, "echo", sent, timeout=20).result(25) is sent

    def runs_here(self, name, direct):
        """Whether ``name``'s call ran on this actor's own thread."""
        mine = threading.get_ident()
        return self.peers.call(name, "thread_id", timeout=20, direct=direct).result(25) == mine

    def ordered(self, name, n):
        futs = [self.peers.call(name, "add", k, timeout=20, direct=k % 2 == 0) for k in range(n)]
        return [f.result(25) for f in futs]


class Probe(Counter):
    def thread_id(self):
        return threading.get_ident()


def _plans(transport, name, steps=3):
    transport.start_actor(name, make_planner)
    loaders, out = SimulatedLoaders(SOURCES, 64), []
    for _ in range(steps):
        plan = transport.call(name, "plan", loaders.buffers(), timeout=30).result(60)
        loaders.consume(plan)
        out.append(plan.to_dict())
    return out


def _children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if ppid == pid:
                out.append(int(d))
    return out


def _descendants(exclude=()):
    todo, seen = [os.getpid()], []
    while todo:
        for c in _children(todo.pop()):
            if c not in exclude:
                seen.append(c)
                todo.append(c)
    return seen


def _helper_pids():
    """multiprocessing's own long-lived helpers (fork server, resource tracker), not ours to reap."""
    from multiprocessing import forkserver, resource_tracker
    return {p for p in (getattr(forkserver._forkserver, "_forkserver_pid", None),
                        getattr(resource_tracker._resource_tracker, "_pid", None)) if p}


# ------------------------------------------------------------------------------------ in-process

def test_inprocess_order_results_and_errors():
    with InProcessTransport() as t:
        t.start_actor("c", Counter, 10)
        futs = [t.call("c", "add", k, timeout=10) for k in range(50)]
        assert [f.result(10) for f in futs] == [10 + sum(range(k + 1)) for k in range(50)]
        assert t.call("c", "history", timeout=10).result(10) == list(range(50))
        with pytest.raises(ValueError, match=r"boom.*c\.fail\(\)"):
            t.call("c", "fail", "boom", timeout=10).result(10)
        assert t.is_alive("c")
    assert not t.is_alive("c")


def test_inprocess_actors_run_concurrently_and_time_out():
    barrier = threading.Barrier(2, timeout=10)
    release = threading.Event()
    t = InProcessTransport(stop_timeout=5)
    try:
        t.start_actor("a", Counter)
        t.start_actor("b", Counter)
        # both calls must be inside the barrier at once: only possible if the actors run concurrently
        fa = t.call("a", "wait", barrier, None, timeout=10)
        fb = t.call("b", "wait", barrier, None, timeout=10)
        fa.result(10), fb.result(10)
        slow = t.call("a", "wait", release, 60, timeout=0.2)
        with pytest.raises(CallTimeout, match=r"a\.wait\(\).*0\.2"):
            slow.result(10)
    finally:
        release.set()
        t.stop()
    assert not [th for th in threading.enumerate() if th.name.startswith("overlord-") and th.is_alive()]


def test_a_killed_inprocess_actor_frees_its_threads_as_a_dead_process_would():
    t = InProcessTransport(stop_timeout=5)
    try:
        t.start_actor("p", Pooled)
        t.start_actor("q", Pooled)
        assert t.call("p", "work", timeout=10).result(10).startswith("overlord-pooled")
        assert t.call("q", "work", timeout=10).result(10).startswith("overlord-pooled")
        p, q = t.actor("p"), t.actor("q")
        t.kill(["p"])
        with pytest.raises(ActorDied):
            t.call("p", "work", timeout=10).result(10)
    finally:
        t.stop()                                # joins the actor threads
    assert p.closed and not q.closed            # stop() leaves closing live actors to their owner
    q.close()
    assert not [th for th in threading.enumerate() if th.name.startswith("overlord-") and th.is_alive()]


def test_inprocess_planner_matches_direct_planner():
    planner, loaders, direct = make_planner(), SimulatedLoaders(SOURCES, 64), []
    for _ in range(3):
        plan = planner.plan(loaders.buffers())
        loaders.consume(plan)
        direct.append(plan.to_dict())
    with InProcessTransport() as t:
        assert _plans(t, "planner") == direct


def test_deadlines_fail_late_calls_and_hold_no_answered_call():
    """A call not answered in time fails with CallTimeout; an answered one is not kept alive by its
    deadline (the heap holds futures weakly and is swept), whatever the number of calls."""
    import gc
    import weakref

    from torchdata_overlord.runtime.transport import Deadlines

    d = Deadlines("test-deadlines")
    try:
        late = cf.Future()
        d.add(late, 0.2, lambda: CallTimeout("late", "a"))
        answered = []
        for i in range(5000):
            f = cf.Future()
            d.add(f, 300.0, lambda: CallTimeout("never", "b"))
            f.set_result([i])
            answered.append(weakref.ref(f))
        with pytest.raises(CallTimeout, match="late"):
            late.result(5)
        del f
        gc.collect()
        assert all(r() is None for r in answered)              # nothing answered is kept alive
        assert len(d._heap) < 2 * Deadlines._SWEEP_AT           # swept as entries piled up
    finally:
        d.close()


# ------------------------------------------------------------------------------------ rpc

@pytest.fixture(scope="module")
def rpc_transport():
    from torchdata_overlord.runtime.rpc_transport import RpcTransport

    threads_before = set(threading.enumerate())
    t = RpcTransport(n_workers=2, startup_timeout=60, rpc_timeout=30, stop_timeout=10)
    yield t
    start = time.monotonic()
    t.stop()
    assert time.monotonic() - start < t.stop_timeout + 5
    t.stop()                                              # idempotent
    assert not mp.active_children()
    assert _descendants(exclude=_helper_pids()) == []
    left = [th for th in set(threading.enumerate()) - threads_before if th.is_alive() and not th.daemon]
    assert left == []


@pytest.mark.slow
def test_rpc_same_results_as_inprocess(rpc_transport):
    with InProcessTransport() as local:
        expected = _plans(local, "planner")
    assert _plans(rpc_transport, "planner") == expected
    rpc_transport.start_actor("echo", Counter, worker=1)
    x = torch.randn(257, 33, dtype=torch.float64)
    y = rpc_transport.call("echo", "echo", {"x": x, "i": torch.arange(5)}, timeout=10).result(20)
    assert torch.equal(y["x"], x) and y["x"].dtype == torch.float64 and torch.equal(y["i"], torch.arange(5))


@pytest.mark.slow
def test_rpc_order_errors_timeout(rpc_transport):
    rpc_transport.start_actor("ctr", Counter, 5, worker=0)
    futs = [rpc_transport.call("ctr", "add", k, timeout=20) for k in range(40)]
    assert [f.result(30) for f in futs] == [5 + sum(range(k + 1)) for k in range(40)]
    assert rpc_transport.call("ctr", "history", timeout=20).result(30) == list(range(40))
    with pytest.raises(ValueError, match=r"boom.*ctr\.fail\(\)"):
        rpc_transport.call("ctr", "fail", "boom", timeout=20).result(30)
    start = time.monotonic()
    with pytest.raises(CallTimeout, match=r"ctr\.block\(\).*0\.5"):
        rpc_transport.call("ctr", "block", 3.0, timeout=0.5).result(30)
    assert time.monotonic() - start < 2.5
    # the actor is still usable (its queue drains once the slow call returns)
    assert rpc_transport.call("ctr", "echo", 1, timeout=20).result(30) == 1


@pytest.mark.slow
def test_rpc_listens_on_loopback_only(rpc_transport):
    from torchdata_overlord.runtime.procstats import listening_addresses

    for pid in [os.getpid()] + rpc_transport.worker_pids:
        listening = listening_addresses(pid)
        assert listening, f"pid {pid}: the rpc agent should listen somewhere"
        assert all(a.startswith("127.0.0.1:") for a in listening), (pid, listening)


@pytest.mark.slow
def test_rpc_actors_of_one_process_call_each_other_without_rpc(rpc_transport):
    """Actors in one worker call each other directly: arguments by reference (no pickling), a direct
    call to an idle actor on the caller's own thread, calls in order; across workers they are pickled."""
    rpc_transport.place({"relay": 0, "near": 0, "far": 1})
    rpc_transport.start_actor("near", Probe, worker=0)
    rpc_transport.start_actor("far", Probe, worker=1)
    rpc_transport.start_actor("relay", Relay, rpc_transport.peers(), worker=0)
    call = lambda *a: rpc_transport.call("relay", *a, timeout=30).result(40)        # noqa: E731
    assert call("same_object", "near") is True
    assert call("same_object", "far") is False
    assert call("runs_here", "near", True) is True
    assert call("runs_here", "near", False) is False
    assert call("runs_here", "far", True) is False
    assert call("ordered", "near", 30) == [sum(range(k + 1)) for k in range(30)]


@pytest.mark.slow
def test_rpc_arguments_or_answers_that_do_not_pickle_fail_that_call_only(rpc_transport):
    from torchdata_overlord.runtime.transport import ActorError

    rpc_transport.start_actor("pickles", Counter, worker=1)
    assert rpc_transport.call("pickles", "add", 1, timeout=10).result(20) == 1
    with pytest.raises(ActorError, match=r"pickles\.echo\(\): its arguments do not pickle"):
        rpc_transport.call("pickles", "echo", lambda: None, timeout=10).result(20)
    with pytest.raises(Exception, match=r"pickles\.unpicklable\(\)"):
        rpc_transport.call("pickles", "unpicklable", timeout=10).result(20)
    # neither took the actor's order off track: the next calls run, in order
    futs = [rpc_transport.call("pickles", "add", k, timeout=10) for k in (2, 3)]
    assert [f.result(20) for f in futs] == [3, 6]


@pytest.mark.slow
def test_rpc_zz_killed_worker_fails_fast(rpc_transport):
    """Runs last in this module: it kills a worker of the shared transport."""
    rpc_transport.start_actor("victim", Counter, worker=0)
    rpc_transport.start_actor("survivor", Counter, worker=1)
    assert rpc_transport.call("victim", "add", 1, timeout=10).result(20) == 1
    os.kill(rpc_transport.worker_pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ActorDied, match="victim"):
        rpc_transport.call("victim", "add", 1, timeout=25).result(30)
    assert time.monotonic() - start < 5
    assert not rpc_transport.is_alive("victim") and rpc_transport.is_alive("survivor")
    assert rpc_transport.call("survivor", "add", 2, timeout=10).result(20) == 2
