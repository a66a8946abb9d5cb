"""The hand-over of a ready step (issue 15, item 3): ``next()`` takes what a background thread packaged,
waits on nothing, and what it lets go of is freed off the trainer's thread; the stream is unchanged."""

import os
import threading
import time

import pytest

from torchdata_overlord.testing import assert_identical

from test_loader import corpus, make_loader  # noqa: F401 (the module-scoped corpus fixture)

MESH = dict(dp=2, cp=2)


def wait_for(cond, timeout=60.0):
    """Poll ``cond`` until true (bounded); the thing waited for is built by other threads."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def not_on(thread, method):
    """``method``, failing when called on ``thread``."""
    def guarded(*args, **kwargs):
        assert threading.current_thread() is not thread, "the trainer's thread asked the step's future"
        return method(*args, **kwargs)
    return guarded


@pytest.fixture(scope="module")
def expected(corpus):  # noqa: F811
    with make_loader(corpus, "dp", MESH, prefetch=0) as ref:
        return [item for _, item in zip(range(6), ref)]


def test_a_ready_step_is_packaged_before_next_and_taken_as_is(corpus, expected):  # noqa: F811
    trainer = threading.current_thread()
    with make_loader(corpus, "dp", MESH, prefetch=2) as loader:
        it = iter(loader)
        got = [next(it)]
        for _ in range(4):
            wait_for(lambda: loader._ahead and getattr(loader._ahead[0], loader._BUILT, None) is not None)
            head = loader._ahead[0]
            res, built = getattr(head, loader._BUILT)
            # next() of a ready step does not ask its future (other threads still may)
            head.result, head.done = not_on(trainer, head.result), not_on(trainer, head.done)
            item = next(it)
            assert item is built                   # the object packaged off the trainer's thread
            assert loader.state_dict()["step"] == res.step + 1
            got.append(item)
    assert_identical(got, expected[:5])


class Probe:
    """Rides on what the loader lets go of; records the thread that freed it."""

    def __init__(self):
        self.freed_on, self.done = [], threading.Event()
        self.rider = _Rider(self)


class _Rider:
    def __init__(self, probe: Probe):
        self.probe = probe

    def __del__(self):
        self.probe.freed_on.append(threading.current_thread().name)
        self.probe.done.set()


def test_what_next_lets_go_of_is_dropped_on_the_producer_thread(corpus):  # noqa: F811
    probe = Probe()
    with make_loader(corpus, "dp", MESH, prefetch=2) as loader:
        it = iter(loader)
        next(it)
        wait_for(lambda: loader._ahead and loader._ahead[0].done())
        loader._consumed["probe"], probe.rider = probe.rider, None     # rides on the consumed record next() replaces
        next(it)
        assert probe.done.wait(30)
    assert probe.freed_on == ["overlord-prefetch"]


def test_the_batch_the_trainer_lets_go_of_is_freed_on_the_producer_thread(corpus):  # noqa: F811
    """The trainer drops its last batch as it takes the next one: the loader keeps that batch until the
    producer takes the slot, so its tensors are freed there, not between the trainer's steps (in the rpc
    runtime, where the trainer holds a batch's only reference, that costs ~0.2 ms a step)."""
    probe = Probe()
    with make_loader(corpus, "dp", MESH, prefetch=2) as loader:
        it = iter(loader)
        item = next(it)
        item["probe"], probe.rider = probe.rider, None                 # rides on the batch
        item = next(it)                            # the trainer lets go of the first batch
        assert probe.done.wait(30)
    assert probe.freed_on == ["overlord-prefetch"]


def test_a_step_not_packaged_in_the_background_is_packaged_by_next(corpus, expected):  # noqa: F811
    """A failure of the background packaging (e.g. pinning) is not the step's: next() packages it itself."""
    with make_loader(corpus, "dp", MESH, prefetch=2) as loader:
        own = loader._package
        trainer = threading.current_thread()

        def package(step, outputs):
            if threading.current_thread() is not trainer:
                raise RuntimeError("background packaging failed")
            return own(step, outputs)

        loader._package = package
        got = [item for _, item in zip(range(4), loader)]
        assert all(getattr(f, loader._BUILT, None) is None for f in list(loader._ahead))
    assert_identical(got, expected[:4])


def test_the_producer_thread_does_not_preempt_the_trainer_when_woken(corpus):  # noqa: F811
    """next() wakes the producer with each slot: the producer runs under SCHED_BATCH (Linux), whose
    wake-ups do not preempt the waker; the trainer's own policy is untouched."""
    before = os.sched_getscheduler(0)
    with make_loader(corpus, "dp", MESH, prefetch=2) as loader:
        it = iter(loader)
        next(it)
        producer = loader._thread
        wait_for(lambda: os.sched_getscheduler(producer.native_id) == os.SCHED_BATCH)
        assert os.sched_getscheduler(0) == before
        next(it)
