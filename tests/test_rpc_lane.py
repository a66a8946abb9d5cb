"""Same-host call lanes (runtime/lane.py): once a peer's lane opens, calls to it take a Unix socket
instead of TensorPipe, in the same order as the calls that went over RPC before it opened; answers,
errors, tensors (in shared memory or, with that off, as the frame's own bytes) arrive the same; a
lane call times out as an RPC call does, fails as ActorDied at once when the peer is killed, a
connection without the peer's secret is served nothing, a quick method runs on the lane's thread in
order, OVERLORD_RPC_LANE=0 keeps every call on RPC, and nothing (thread, socket) is left once the
group ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from torchdata_overlord.runtime import lane, shm
from torchdata_overlord.runtime.transport import ActorDied, CallTimeout

pytestmark = pytest.mark.slow


class Counter:
    def __init__(self):
        self.total, self.seen = 0, []

    def add(self, k):
        self.total += k
        self.seen.append(k)
        return self.total

    def history(self):
        return list(self.seen)

    def echo(self, x):
        return x

    def fail(self, msg):
        raise ValueError(msg)

    def block(self, seconds):
        time.sleep(seconds)
        return seconds

    def block_then_tensor(self, seconds, n):
        time.sleep(seconds)
        return torch.arange(n)

    def lane_stats(self):
        return lane.stats()

    def lane_address(self):
        return lane._address()


class QuickCounter(Counter):
    """A Counter whose ``add`` and ``thread`` are quick: the lane thread that receives them may run them."""

    QUICK_METHODS = frozenset({"add", "thread", "quick_echo"})

    def thread(self):
        return threading.current_thread().name

    def quick_echo(self, x):
        return x

    def slow_thread(self):
        return threading.current_thread().name

    def slow_add(self, k):
        return self.add(k)


def _until(condition, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.005)


def _lane_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("overlord-lane") and t.is_alive()]


def _abstract_sockets(pid: int) -> list[str]:
    with open("/proc/net/unix") as f:
        return [line.split()[-1] for line in f if f"@overlord-lane-{pid}-" in line]


@pytest.fixture(scope="module")
def group():
    from torchdata_overlord.runtime.rpc_transport import RpcTransport

    t = RpcTransport(n_workers=2, startup_timeout=60, rpc_timeout=30, stop_timeout=10)
    yield t
    t.stop()
    _until(lambda: not _lane_threads(), 10, f"lane threads left: {_lane_threads()}")
    assert _abstract_sockets(os.getpid()) == []


def test_calls_move_to_the_lane_once_it_opens_and_keep_their_order(group):
    group.start_actor("ctr", Counter, worker=1)
    worker = group.worker_name(1)
    before = lane.stats()["calls"]
    futs, k = [], 0
    while lane.route(worker) is None:          # RPC until the lane answers its probe
        futs.append(group.call("ctr", "add", k, timeout=30))
        k += 1
        assert k < 100_000, "the lane never opened"
    via_rpc = k
    for _ in range(200):
        futs.append(group.call("ctr", "add", k, timeout=30))
        k += 1
    assert [f.result(60) for f in futs] == [sum(range(i + 1)) for i in range(k)]
    assert group.call("ctr", "history", timeout=30).result(40) == list(range(k))
    assert via_rpc >= 1 and lane.stats()["calls"] - before >= 200
    served = group.call("ctr", "lane_stats", timeout=30).result(40)["served"]
    assert served >= 200                       # the worker served them from its lane


def test_lane_answers_errors_and_tensors_as_rpc_does(group, monkeypatch):
    group.start_actor("echo", Counter, worker=0)
    _until(lambda: (group.call("echo", "echo", 0, timeout=30).result(40) == 0
                    and lane.route(group.worker_name(0)) is not None), 30, "lane to worker 0")
    x = {"ids": torch.arange(7000), "img": torch.rand(3, 16, 9).permute(1, 2, 0), "half": torch.rand(5).bfloat16(),
         "s": "text", "n": 3}
    calls = lane.stats()["calls"]
    for shm_on in (True, False):               # the buffer in shared memory, then as the frame's own bytes
        monkeypatch.setattr(shm, "_SWITCH", [shm_on])
        y = group.call("echo", "echo", x, timeout=30).result(40)
        assert y["s"] == "text" and y["n"] == 3
        for key in ("ids", "img", "half"):
            assert torch.equal(y[key], x[key]) and y[key].dtype == x[key].dtype and y[key].shape == x[key].shape
    big = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)     # 3 MiB, beyond the socket's buffer
    assert torch.equal(group.call("echo", "echo", big, timeout=30).result(40), big)
    with pytest.raises(ValueError, match=r"boom.*echo\.fail\(\)"):
        group.call("echo", "fail", "boom", timeout=30).result(40)
    assert lane.stats()["calls"] - calls == 4


def test_a_lane_call_times_out_and_the_actor_goes_on(group):
    group.start_actor("slow", Counter, worker=1)
    _until(lambda: (group.call("slow", "add", 0, timeout=30).result(40) == 0
                    and lane.route(group.worker_name(1)) is not None), 30, "lane to worker 1")
    start = time.monotonic()
    with pytest.raises(CallTimeout, match=r"slow\.block\(\).*0\.5"):
        group.call("slow", "block", 2.0, timeout=0.5).result(30)
    assert time.monotonic() - start < 1.9
    assert group.call("slow", "add", 4, timeout=30).result(40) == 4       # answered once the block ended
    # the late answer of a call that timed out: its tensors' region in the peer's shared memory is given back
    freed = shm.stats()["freed"]
    with pytest.raises(CallTimeout):
        group.call("slow", "block_then_tensor", 1.0, 50_000, timeout=0.3).result(30)
    assert group.call("slow", "add", 1, timeout=30).result(40) == 5
    _until(lambda: shm.stats()["freed"] > freed, 10, "the late answer's region freed")


def test_a_connection_without_the_secret_is_served_nothing(group):
    group.start_actor("guarded", Counter, worker=0)
    name, secret = group.call("guarded", "lane_address", timeout=30).result(40)
    refused = group.call("guarded", "lane_stats", timeout=30).result(40)["refused"]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(name)
    s.sendall(bytes(b ^ 0xFF for b in secret))
    try:
        assert s.recv(1) == b""                # closed without an answer
    except ConnectionResetError:
        pass
    finally:
        s.close()
    _until(lambda: group.call("guarded", "lane_stats", timeout=30).result(40)["refused"] == refused + 1, 10,
           "the wrong secret is counted as refused")
    assert group.call("guarded", "add", 1, timeout=30).result(40) == 1


def test_quick_methods_run_on_the_lane_thread_and_keep_the_order(group):
    """A quick method (``QUICK_METHODS``) of an idle actor runs on the lane thread that received it, any
    other on the actor's thread; behind a call still running, quick calls queue and keep their order."""
    group.start_actor("quick", QuickCounter, worker=1)
    _until(lambda: (group.call("quick", "add", 0, timeout=30).result(40) == 0
                    and lane.route(group.worker_name(1)) is not None), 30, "lane to worker 1")
    assert group.call("quick", "thread", timeout=30).result(40).startswith("overlord-lane-serve")
    assert group.call("quick", "slow_thread", timeout=30).result(40).startswith("overlord-actor-")
    # the wait for the lane above adds 0 once per try (once or more, as the lane opens): the calls below come after
    warm = group.call("quick", "history", timeout=30).result(40)
    assert warm and set(warm) == {0}
    futs = [group.call("quick", "block", 0.3, timeout=30)]
    futs += [group.call("quick", "add" if k % 2 else "slow_add", k, timeout=30) for k in range(1, 41)]
    assert [f.result(40) for f in futs[1:]] == [sum(range(1, k + 1)) for k in range(1, 41)]
    assert group.call("quick", "history", timeout=30).result(40) == warm + list(range(1, 41))


def test_answers_of_calls_read_together_go_back_together_each_to_its_own_call(group):
    """Quick calls of one method that arrive while the lane thread still reads others are answered in one write
    (a loader's puts to the constructors of one process); from several threads at once, mixed with calls of
    other methods and calls run on the actor's thread, every call gets its own answer."""
    for name in ("qa", "qb"):
        group.start_actor(name, QuickCounter, worker=1)
    _until(lambda: (group.call("qa", "add", 0, timeout=30).result(40) == 0
                    and lane.route(group.worker_name(1)) is not None), 30, "lane to worker 1")
    before = group.call("qa", "lane_stats", timeout=30).result(40)
    got: dict = {}

    def burst(tag: int) -> None:
        futs = []
        for k in range(60):
            actor, method = ("qa", "quick_echo") if k % 2 else ("qb", "quick_echo")
            if k % 7 == 0:
                method = "echo"                     # runs on the actor's thread, answered from there
            elif k % 11 == 0:
                method = "thread"                    # quick, another method: the waiting answers go first
            futs.append(((tag, k, method), group.call(actor, method, *(() if method == "thread" else ((tag, k),)),
                                                      timeout=30)))
        got[tag] = [(key, f.result(40)) for key, f in futs]

    threads = [threading.Thread(target=burst, args=(tag,)) for tag in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == [0, 1, 2, 3]
    for tag, answers in got.items():
        for (t, k, method), answer in answers:
            if method == "thread":
                assert answer.startswith(("overlord-lane-serve", "overlord-actor-")), answer
            else:
                assert answer == (t, k), (method, answer)
    after = group.call("qa", "lane_stats", timeout=30).result(40)
    served, writes = after["served"] - before["served"], after["answer_writes"] - before["answer_writes"]
    assert served >= 240 and writes < served, (served, writes)


def test_zy_a_send_to_a_frozen_peer_is_bounded(group, monkeypatch):
    """A peer that reads nothing (SIGSTOP) fills the socket: the send gives up after the lane's send
    timeout and the call fails as a timeout, not a hang; the lane is then given up for RPC."""
    monkeypatch.setattr(lane, "_SEND_TIMEOUT", 1)
    lane.reset()                               # the next lane is opened with the 1 s bound
    group.start_actor("frozen", Counter, worker=1)
    _until(lambda: (group.call("frozen", "add", 0, timeout=30).result(40) == 0
                    and lane.route(group.worker_name(1)) is not None), 30, "lane to worker 1")
    monkeypatch.setattr(shm, "_SWITCH", [False])          # the bytes in the frame: more than the socket holds
    pid = group.worker_pids[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        fut = group.call("frozen", "echo", torch.zeros(16 << 20, dtype=torch.uint8), timeout=60)
        with pytest.raises(CallTimeout, match=r"frozen\.echo\(\)"):
            fut.result(30)
        assert time.monotonic() - start < 10
        assert lane.route(group.worker_name(1)) is None
    finally:
        os.kill(pid, signal.SIGCONT)


def test_zz_a_killed_peer_fails_its_waiting_lane_calls_at_once(group):
    """Runs last in this module: it kills worker 1."""
    lane.reset()                               # a fresh lane to worker 1 (the test before gave its lane up)
    group.start_actor("doomed", Counter, worker=1)
    _until(lambda: (group.call("doomed", "add", 0, timeout=30).result(40) == 0
                    and lane.route(group.worker_name(1)) is not None), 30, "lane to worker 1")
    waiting = group.call("doomed", "block", 30.0, timeout=60)
    assert not waiting.done()
    os.kill(group.worker_pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ActorDied, match="doomed"):
        waiting.result(30)
    assert time.monotonic() - start < 5
    assert lane.route(group.worker_name(1)) is None          # later calls go (and fail) the RPC way
    # the other worker serves on (an actor of this test's own: under pytest-xdist the test that starts 'echo'
    # may have run in the other pytest worker, with a group of its own)
    group.start_actor("survivor", Counter, worker=0)
    assert group.call("survivor", "echo", 5, timeout=30).result(40) == 5


def test_lane_off_in_the_environment_keeps_every_call_on_rpc(tmp_path):
    script = tmp_path / "off.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_rpc_lane import Counter
        from torchdata_overlord.runtime import lane
        from torchdata_overlord.runtime.rpc_transport import RpcTransport

        if __name__ == "__main__":
            with RpcTransport(n_workers=1, startup_timeout=60, rpc_timeout=30, stop_timeout=10) as t:
                t.start_actor("c", Counter, worker=0)
                got = [t.call("c", "add", k, timeout=30).result(40) for k in range(300)]
                assert got == [sum(range(k + 1)) for k in range(300)], got
                remote = t.call("c", "lane_stats", timeout=30).result(40)
                print("LANE", lane.stats()["opened"], lane.stats()["calls"], remote["served"], remote["opened"])
    """))
    env = dict(os.environ, OVERLORD_RPC_LANE="0",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LANE 0 0 0 0" in out.stdout, out.stdout
