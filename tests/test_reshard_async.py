"""Live resharding does not stop the stream (paper 5.2): the new loader actors start, load and warm off
the Planner's thread and catch up while the old ones serve. A gate in the image source's transform holds
the new actors (only they read the source in parts) inside their warm-up, so what the steps do meanwhile
is seen without timing: were the reshard synchronous, the step after the decision would wait at the gate.
Also: a new actor that dies, and a state loaded while a reshard is pending, abort it cleanly.
"""

from __future__ import annotations

import threading

import pytest

from torchdata_overlord.runtime.local import LocalJob
from torchdata_overlord.sources import ParquetSource
from torchdata_overlord.transforms import ImageText, Tokenize
from torchdata_overlord.testing import assert_identical
from test_autoscaling import STEPS, _kwargs, _scaler, corpus, curriculum_strategy, placement, reference  # noqa: F401
from test_rpc_job import make_mesh

WAIT = 120.0                                # every wait's bound (seconds): a hang fails, never a slow machine


class Gate:
    """Holds every transform call of a data-parallel part until :meth:`open` (the new actors' warm-up:
    the start placement reads the image source in one part)."""

    def __init__(self):
        self.opened, self.entered = threading.Event(), threading.Event()

    def hold(self) -> None:
        self.entered.set()
        if not self.opened.wait(WAIT):
            raise RuntimeError("the test never opened the gate")

    def open(self) -> None:
        self.opened.set()


GATE: Gate | None = None


class GatedSource(ParquetSource):
    """A ParquetSource whose parts (``part[1] > 1``) wait at :data:`GATE` before each transform."""

    def apply(self, row, where):
        if GATE is not None and self.part[1] > 1:
            GATE.hold()
        return super().apply(row, where)


@pytest.fixture
def gate():
    global GATE
    GATE = Gate()
    before = set(threading.enumerate())
    try:
        yield GATE
    finally:
        GATE.open()
        GATE = None
    left = [t.name for t in threading.enumerate() if t not in before and t.name.startswith("overlord-") and t.is_alive()]
    assert not left, f"threads left behind: {left}"


def gated_sources(corpus):
    return [ParquetSource("web", corpus.sources["web"], Tokenize(corpus.spm_model, field=corpus.text_fields["web"]),
                             seed=0),
               GatedSource("caps", corpus.sources["caps"],
                           ImageText(corpus.spm_model, image_field="image", text_field="text", patch=14, max_side=112),
                           seed=0)]


def start(corpus, placement):
    return LocalJob(gated_sources(corpus), curriculum_strategy, make_mesh(), constructors=2, placement=placement,
                    autoscale=_scaler(), timeout=WAIT, **_kwargs(corpus))


def planner_stats(job) -> dict:
    """The Planner's stats, asked through its queue: its step's boundary work is done by then."""
    return job.planner.stats().result(WAIT)


def caps_pending(job) -> dict | None:
    return next((p for p in planner_stats(job)["resharding"] if p["source"] == "caps"), None)


def step_until_caps_pending(job, reference, k: int = 0) -> int:
    while k < STEPS:
        assert_identical(job.step().outputs, reference[k])
        k += 1
        if caps_pending(job) is not None:
            return k
    pytest.fail("the image source was never resharded")


def test_new_actors_warming_do_not_block_the_steps(corpus, placement, reference, gate):
    job = start(corpus, placement)
    planner = job.actor("planner")
    try:
        k = step_until_caps_pending(job, reference)
        decided = k - 1
        assert gate.entered.wait(WAIT), "no new actor started its warm-up"
        planner.resharding.pending["caps"].prepare.result(WAIT)    # started and loaded: warming from now on
        for _ in range(3):                  # served by the old actor while the new ones wait at the gate
            assert_identical(job.step().outputs, reference[k])
            k += 1
        pending = caps_pending(job)
        assert pending is not None and pending["phase"] == "warming" and pending["steps_behind"] == 3, pending
        assert not [r for r in planner_stats(job)["reshards"] if r["source"] == "caps"]
        assert job.planner.roles().result(WAIT)["parts"]["caps"] == 1
        gate.open()
        while k < STEPS:                    # every pending round answered before each step (a later reshard
            if caps_pending(job) is not None:    # too), so where each one switches does not depend on timing
                assert planner.resharding.wait(WAIT), "the new actors did not finish their round"
            assert_identical(job.step().outputs, reference[k])
            k += 1
        stats = planner_stats(job)
    finally:
        gate.open()
        job.close()
    first = next(r for r in stats["reshards"] if r["source"] == "caps")
    assert first["ok"] and first["from"] == 1 and first["to"] > 1, first
    assert first["decision_step"] == decided and first["switch_step"] >= decided + 4, first
    assert first["step"] == first["switch_step"] + 1 and first["seconds"] >= first["blocked_s"] >= 0
    assert first["rounds"] >= 1, first      # three steps behind when warm: at least one round before the switch
    assert not stats["resharding"]


def test_a_new_actor_dying_aborts_the_reshard_and_the_old_ones_go_on(corpus, placement, reference, gate):
    job = start(corpus, placement)
    planner = job.actor("planner")
    try:
        k = step_until_caps_pending(job, reference)
        assert gate.entered.wait(WAIT)
        new = dict(planner.resharding.pending["caps"].names)
        victim = sorted(new.values())[0]
        job.transport.kill([victim])
        gate.open()
        while caps_pending(job) is not None and k < STEPS:
            assert planner.resharding.wait(WAIT)
            assert_identical(job.step().outputs, reference[k])
            k += 1
        stats = planner_stats(job)
        aborted = [r for r in stats["reshards"] if r["source"] == "caps"]
        assert aborted and not aborted[0]["ok"] and "ActorDied" in aborted[0]["error"], aborted
        assert not set(new.values()) & set(job.planner.roles().result(WAIT)["loaders"].values())
        while k < STEPS:                    # the old actor serves on (a later reshard may start and succeed)
            assert_identical(job.step().outputs, reference[k])
            k += 1
        survivors = [job.actor(n) for n in new.values() if n != victim]
    finally:
        gate.open()
        job.close()
    for actor in survivors:                 # closed by the abort: its transform pool is gone
        assert actor.loader._pool is None


def test_a_state_loaded_while_a_reshard_is_pending_aborts_it(corpus, placement, reference, gate):
    job = start(corpus, placement)
    try:
        job.step(), job.step()
        state, k0 = job.state_dict(), 2
        k = step_until_caps_pending(job, reference, k0)
        assert gate.entered.wait(WAIT)
        new = dict(job.actor("planner").resharding.pending["caps"].names)
        job.load_state_dict(state)
        gate.open()
        stats = planner_stats(job)
        aborted = [r for r in stats["reshards"] if r["source"] == "caps"]
        assert aborted and not aborted[0]["ok"] and "new generation" in aborted[0]["error"], aborted
        assert aborted[0]["decision_step"] == k - 1 and not [p for p in stats["resharding"] if p["source"] == "caps"]
        for k in range(k0, STEPS):          # the stream from the loaded state, a new reshard and all
            assert_identical(job.step().outputs, reference[k])
        closed = [job.actor(n) for n in new.values()]
    finally:
        gate.open()
        job.close()
    for actor in closed:
        assert actor.loader._pool is None


def _recovery(placement: dict, active: dict, constructors: list, spares=(), home=None):
    """What ``reshard._hosts`` reads of the Planner's recovery: where actors live, who serves."""
    from types import SimpleNamespace
    return SimpleNamespace(peers=SimpleNamespace(placement=placement), policy=SimpleNamespace(spares=list(spares)),
                           active=active, constructor_names=constructors, home=home)


def test_new_actors_go_to_the_role_processes_with_the_least_estimated_load():
    """A reshard's new actors go where the serving actors' estimated cores (the scaler's last partition)
    are fewest, then to the process with the fewest actors: not by loader count, which took the Planner's
    process for empty and a process of two light loaders for busier than one of a heavy one."""
    from torchdata_overlord.roles.loader_parts import Parts
    from torchdata_overlord.runtime.reshard import _hosts
    placement = {"planner": "w0", "constructor:0": "w0", "constructor:1": "w0", "loader:text@0of2": "w1",
                 "loader:text@1of2": "w1", "loader:image": "w2", "loader:code": "w3", "spare-actor": "w4"}
    parts = Parts(["text", "image", "code"], {"text": 2})
    active = {key: f"loader:{key}" for key in parts.keys}
    assert set(active.values()) <= set(placement)
    r = _recovery(placement, active, ["constructor:0", "constructor:1"], spares=["w4"])
    cores = {"planner": 0.25, "constructor": 0.05, "sources": {"text": 0.2, "image": 1.0, "code": 0.3}}
    # load: w0 0.35 (3 actors), w1 0.2 (2 light loaders), w2 1.0, w3 0.3; two new code actors of 0.6 each
    # (its own actor retiring): w3 is left empty, so it and then w1 take them; never w4, the spare
    assert _hosts(r, parts, 2, 0.6, ["code"], [], cores) == ["w3", "w1"]
    # another reshard pending (its new actors counted where they will serve): w0 is the least loaded
    assert _hosts(r, parts, 1, 1.0, ["image"], [("w3", 0.6), ("w1", 0.6)], cores) == ["w2"]
    assert _hosts(r, parts, 1, 1.0, ["image"], [("w3", 0.6), ("w1", 0.6), ("w2", 0.6)], cores) == ["w0"]
    # equal loads: the process with fewer actors, then the first by name
    flat = {"planner": 0.0, "constructor": 0.0, "sources": {"text": 0.0, "image": 0.0, "code": 0.0}}
    assert _hosts(r, parts, 4, 0.0, [], [], flat) == ["w2", "w3", "w1", "w2"]
    # a replacement Planner on a spare counts where it is (the spare, which is never chosen)
    busy = [("w2", 1.0), ("w3", 1.0)]
    assert _hosts(r, parts, 1, 1.0, ["image", "code"], busy, cores) == ["w1"]     # w0: 0.35, w1: 0.2
    r.home = "w4"
    assert _hosts(r, parts, 1, 1.0, ["image", "code"], busy, cores) == ["w0"]     # w0: 0.1
    # one process: nowhere to choose
    assert _hosts(_recovery({}, {}, []), parts, 2, 1.0, [], [], cores) == [None, None]
