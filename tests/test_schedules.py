"""Mixing schedules and apportionment: exact per-step counts, cumulative error < 1, round trips."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torchdata_overlord as ol
from torchdata_overlord.plane.apportion import Apportioner
from _support import make_buffers

NAMES = ("a", "b", "c", "d", "e")


# -- schedules, by hand ------------------------------------------------------------------------
def test_constant_returns_copies():
    s = ol.Constant({"a": 3, "b": 1})
    w = s.weights(5)
    assert w == {"a": 3.0, "b": 1.0}
    w["a"] = 100
    assert s(7) == {"a": 3.0, "b": 1.0}


def test_piecewise_switches_at_stage_boundaries_and_fills_missing_sources():
    s = ol.Piecewise({0: {"a": 1}, 10: {"b": 2}, 25: {"a": 1, "c": 1}})
    assert s.weights(0) == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert s.weights(9) == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert s.weights(10) == {"a": 0.0, "b": 2.0, "c": 0.0}
    assert s.weights(24) == s.weights(10)
    assert s.weights(25) == {"a": 1.0, "b": 0.0, "c": 1.0}
    assert s.weights(10**6) == s.weights(25)
    assert s.sources() == {"a", "b", "c"}


def test_linear_interpolates_normalised_mixtures():
    s = ol.Linear({"a": 3, "b": 1}, {"a": 0, "b": 2}, steps=100, start_step=50)
    # normalised: start (0.75, 0.25), end (0, 1)
    assert s.weights(0) == pytest.approx({"a": 0.75, "b": 0.25})
    assert s.weights(50) == pytest.approx({"a": 0.75, "b": 0.25})
    assert s.weights(75) == pytest.approx({"a": 0.5625, "b": 0.4375})
    assert s.weights(100) == pytest.approx({"a": 0.375, "b": 0.625})
    assert s.weights(150) == pytest.approx({"a": 0.0, "b": 1.0})
    assert s.weights(10**6) == pytest.approx({"a": 0.0, "b": 1.0})


def test_cosine_follows_half_cosine():
    s = ol.Cosine({"a": 1}, {"b": 1}, steps=100)
    for step in (0, 10, 25, 50, 90, 100, 200):
        t = 0.5 - 0.5 * math.cos(math.pi * min(step / 100, 1.0))
        assert s.weights(step) == pytest.approx({"a": 1 - t, "b": t})
    # slower than linear near the start
    assert s.weights(10)["b"] < 0.1


def test_from_callable_validates_each_result():
    s = ol.FromCallable(lambda step: {"a": step % 3, "b": 1})
    assert s.weights(2) == {"a": 2.0, "b": 1.0}
    bad = ol.FromCallable(lambda step: {"a": -1.0 if step == 4 else 1.0})
    assert bad.weights(3) == {"a": 1.0}
    with pytest.raises(ol.ConfigError, match=r"step 4.*'a'.*negative"):
        bad.weights(4)


def test_dynamic_moves_weight_towards_high_feedback_and_keeps_floor():
    d = ol.Dynamic({"a": 1, "b": 1, "c": 0}, lr=2.0, floor=0.1)
    assert d.weights(0) == {"a": 0.5, "b": 0.5, "c": 0.0}
    d.update({"a": 1.0, "b": 0.0})
    w = d.weights(1)
    # w_a / w_b = exp(lr * (1 - 0)) before flooring, c stays off (not initially positive)
    assert w["a"] / w["b"] == pytest.approx(math.exp(2.0))
    assert w["c"] == 0.0 and sum(w.values()) == pytest.approx(1.0)
    for _ in range(20):
        d.update({"a": 5.0, "b": 0.0})
    w = d.weights(2)
    # b is held at the floor share (0.1 / 2 active sources), then renormalised against a ~ 1
    # (a's own share before flooring is 1 - O(exp(-10)), hence the loose tolerance)
    assert w["b"] == pytest.approx(0.05 / (1 + 0.05), rel=1e-4)
    assert w["b"] >= 0.05 / 1.05
    assert d.updates == 21


def test_dynamic_state_round_trip():
    d = ol.Dynamic({"a": 1, "b": 3}, lr=0.5)
    for f in (0.3, -1.0, 2.0):
        d.update({"a": f, "b": 0.0})
    e = ol.Dynamic({"a": 1, "b": 3}, lr=0.5)
    e.load_state_dict(d.state_dict())
    assert e.weights(0) == d.weights(0) and e.updates == 3
    d.update({"a": 1.0})
    e.update({"a": 1.0})
    assert e.weights(0) == d.weights(0)
    with pytest.raises(ol.ConfigError, match="state has sources"):
        ol.Dynamic({"a": 1, "z": 1}).load_state_dict(d.state_dict())


def test_spec_is_the_definition_not_the_running_state():
    """What a checkpoint compares: equal for the same mixture at any scale, different for another."""
    assert ol.Constant({"a": 1, "b": 3}).spec() == ol.Constant({"a": 0.25, "b": 0.75, "c": 0}).spec()
    assert ol.Constant({"a": 1, "b": 3}).spec() != ol.Constant({"a": 1, "b": 2}).spec()
    assert ol.Piecewise({0: {"a": 1}, 5: {"b": 2}}).spec() == ol.Piecewise({0: {"a": 3}, 5: {"b": 1}}).spec()
    assert ol.Piecewise({0: {"a": 1}, 5: {"b": 2}}).spec() != ol.Piecewise({0: {"a": 1}, 6: {"b": 2}}).spec()
    lin = ol.Linear({"a": 1}, {"b": 1}, steps=10)
    assert lin.spec() != ol.Linear({"a": 1}, {"a": 1, "b": 1}, steps=10).spec()
    assert lin.spec() != ol.Cosine({"a": 1}, {"b": 1}, steps=10).spec()
    d = ol.Dynamic({"a": 1, "b": 3}, lr=0.5)
    before = d.spec()
    d.update({"a": 2.0, "b": 0.0})
    assert d.weights(0) != ol.Dynamic({"a": 1, "b": 3}).weights(0) and d.spec() == before
    assert d.spec() != ol.Dynamic({"a": 1, "b": 3}, lr=0.6).spec()


# -- apportionment, by hand ------------------------------------------------------------------------
def test_apportioner_hand_example():
    app = Apportioner()
    # targets 3.33 each: floors 3, one left over, ties go to the earliest name
    assert app.counts({"a": 1, "b": 1, "c": 1}, 10) == {"a": 4, "b": 3, "c": 3}
    # targets 6.67; gaps 2.67, 3.67, 3.67: floors 2, 3, 3; two left over to a and b
    assert app.counts({"a": 1, "b": 1, "c": 1}, 10) == {"a": 3, "b": 4, "c": 3}
    assert app.counts({"a": 1, "b": 1, "c": 1}, 10) == {"a": 3, "b": 3, "c": 4}
    assert app.realised == {"a": 10, "b": 10, "c": 10}
    # a source that leaves the schedule keeps its carried error and takes nothing
    assert app.counts({"a": 1}, 5) == {"a": 5, "b": 0, "c": 0}


def test_iid_drift_is_what_carried_error_avoids():
    """The design's claim, checked: 1,000 steps of 256, weights 0.3/0.7, error stays < 1."""
    app = Apportioner()
    for _ in range(1000):
        app.counts({"x": 0.3, "y": 0.7}, 256)
    assert app.realised == {"x": 76800, "y": 179200}
    assert max(abs(v) for v in app.error().values()) < 1e-6


# -- apportionment, properties ----------------------------------------------------------------------
def _weight_value():
    return st.one_of(st.just(0.0), st.floats(0.001, 100.0), st.integers(0, 10).map(float))


@st.composite
def mixture(draw, names):
    w = {n: draw(_weight_value()) for n in names}
    if sum(w.values()) == 0:
        w[names[0]] = 1.0
    return w


@st.composite
def schedule_run(draw):
    """A list of per-step mixtures: constant, changing every step, zeros, and a switch of sources."""
    steps = draw(st.integers(1, 40))
    first = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    second = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    switch = draw(st.integers(0, steps))
    kind = draw(st.sampled_from(["constant", "every_step"]))
    const = [draw(mixture(first)), draw(mixture(second))]
    out = []
    for s in range(steps):
        phase = int(s >= switch)
        names = (first, second)[phase]
        out.append(const[phase] if kind == "constant" else draw(mixture(names)))
    return out


def _exact_targets(mixtures, batches):
    """Cumulative targets after each step, in exact rational arithmetic."""
    cum: dict[str, Fraction] = {}
    out = []
    for w, batch in zip(mixtures, batches):
        total = sum(Fraction(v) for v in w.values())
        for n, v in w.items():
            cum[n] = cum.get(n, Fraction(0)) + batch * Fraction(v) / total
        out.append(dict(cum))
    return out


def _check_cumulative(realised: dict, target: dict):
    for n in set(realised) | set(target):
        err = Fraction(realised.get(n, 0)) - target.get(n, Fraction(0))
        assert abs(err) < 1, f"source {n}: realised {realised.get(n, 0)} vs target {float(target.get(n, 0))}"


@settings(max_examples=60, deadline=None)
@given(mixtures=schedule_run(), batch=st.integers(1, 300), vary_batch=st.booleans(), data=st.data())
def test_apportioner_cumulative_error_below_one(mixtures, batch, vary_batch, data):
    batches = [data.draw(st.integers(1, 300)) if vary_batch else batch for _ in mixtures]
    app = Apportioner()
    realised: dict[str, int] = {}
    for w, b, target in zip(mixtures, batches, _exact_targets(mixtures, batches)):
        counts = app.counts(w, b)
        assert sum(counts.values()) == b
        assert all(isinstance(c, int) and c >= 0 for c in counts.values())
        assert all(counts[n] == 0 for n, v in w.items() if v == 0 and target.get(n, 0) == 0)
        for n, c in counts.items():
            realised[n] = realised.get(n, 0) + c
        _check_cumulative(realised, target)


# -- mix() through the Planner ---------------------------------------------------------------------
def _schedule_from(mixtures):
    return ol.FromCallable(lambda step: mixtures[min(step, len(mixtures) - 1)])


def _mix_planner(schedule, batch, seed=0):
    mesh = ol.ClientPlaceTree(dp=2)
    return ol.Planner(lambda g: g.mix(schedule).distribute("DP").balance("greedy", microbatches=2), mesh, batch, seed)


def _big_buffers(batch):
    return make_buffers({n: np.arange(1, batch + 1) for n in NAMES})


@settings(max_examples=30, deadline=None)
@given(mixtures=schedule_run(), batch=st.integers(1, 200), cut=st.integers(0, 40))
def test_mix_realises_schedule_and_survives_state_round_trip(mixtures, batch, cut):
    """mix() keeps every source within one sample of its cumulative target, and a Planner
    restored from a state_dict at step ``cut`` continues with identical plans."""
    cut = min(cut, len(mixtures))
    bufs = _big_buffers(batch)
    targets = _exact_targets(mixtures, [batch] * len(mixtures))
    a = _mix_planner(_schedule_from(mixtures), batch)
    plans, realised, saved = [], {}, None
    for step, target in enumerate(targets):
        if step == cut:
            saved = a.state_dict()
        p = a.plan(bufs)
        counts = p.records.source_counts()
        assert len(p.records) == batch and sum(counts.values()) == batch
        for n, c in counts.items():
            realised[n] = realised.get(n, 0) + c
        _check_cumulative(realised, target)
        cum = p.stats["mixture"]["cumulative"]
        assert cum == {n: c for n, c in realised.items() if n in cum}
        plans.append(p.to_dict())
    if saved is None:
        saved = a.state_dict()
    b = _mix_planner(_schedule_from(mixtures), batch)
    b.load_state_dict(saved)
    assert b.step == cut
    again = [b.plan(bufs) for _ in range(cut, len(mixtures))]
    assert [p.to_dict() for p in again] == plans[cut:]
    # the restored planner's own figures hold the same invariant
    for p, target in zip(again, targets[cut:]):
        assert sum(p.records.source_counts().values()) == batch
        _check_cumulative(p.stats["mixture"]["cumulative"], target)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_schedule_the_strategy_builds_at_every_plan_runs_as_one_built_once(seed):
    """``g.mix(ol.Dynamic(...))`` written inside the strategy makes a new schedule object at every plan: it
    carries on from the running state of the step before (as one object built once does, with the same
    feedback), also after a state round trip at a random step; switching to a schedule of another
    definition starts that one as it was made. (It used to restart from its initial weights every step.)"""
    rng = np.random.default_rng(seed)
    batch, steps, cut = 24, 12, int(rng.integers(1, 11))
    feedback = [{n: float(rng.normal()) for n in NAMES[:3]} for _ in range(steps)]
    initial = {"a": 1.0, "b": 2.0, "c": 1.0}
    bufs = _big_buffers(batch)
    mesh = ol.ClientPlaceTree(dp=2)

    def inside(switch_at=None):
        def strategy(g):
            if switch_at is not None and g.ctx.step >= switch_at:
                sched = ol.Dynamic({"a": 1.0, "b": 1.0, "c": 3.0}, lr=0.5)      # another definition
            else:
                sched = ol.Dynamic(initial, lr=0.7)
            return g.mix(sched).distribute("DP").balance("greedy", microbatches=2)
        return ol.Planner(strategy, mesh, batch, seed)

    once = ol.Dynamic(initial, lr=0.7)
    outside = ol.Planner(lambda g: g.mix(once).distribute("DP").balance("greedy", microbatches=2), mesh, batch, seed)
    a, b = inside(), inside()
    want, got = [], []
    for step in range(steps):
        if step == cut:
            b = inside()
            b.load_state_dict(a.state_dict())
        want.append(outside.plan(bufs, feedback=[feedback[step]]).to_dict())
        got.append(a.plan(bufs, feedback=[feedback[step]]).to_dict())
        if step >= cut:
            assert b.plan(bufs, feedback=[feedback[step]]).to_dict() == want[-1], step
    assert got == want
    assert abs(once.weights(0)["b"] - 0.5) > 1e-3              # the feedback moved the weights
    switched = inside(switch_at=cut)
    for step in range(cut + 1):
        p = switched.plan(bufs, feedback=[feedback[step]])
    fresh = ol.Dynamic({"a": 1.0, "b": 1.0, "c": 3.0}, lr=0.5)
    fresh.update(feedback[cut])
    assert p.stats["mixture"]["weights"] == pytest.approx(fresh.weights(0))


class _Ema(ol.Schedule):
    """A user's stateful schedule, written as ol.Schedule's docstring asks (no spec() of its own)."""

    def __init__(self):
        self.ema = {"a": 1.0, "b": 1.0, "c": 1.0}

    def update(self, feedback):
        for k, v in feedback.items():
            self.ema[k] = 0.5 * self.ema[k] + 0.5 * v

    def weights(self, step):
        return {k: v ** 3 for k, v in self.ema.items()}

    def state_dict(self):
        return {"ema": dict(self.ema)}

    def load_state_dict(self, state):
        self.ema = dict(state["ema"])


def test_a_users_stateful_schedule_runs_the_same_built_once_or_anew_and_shared():
    """A Schedule subclass with running state in an attribute its state_dict() names: built anew at every plan it
    carries on as one built once (the default spec() leaves the running attribute out, so the new object is seen
    as the same schedule); a resume continues it; a second Planner sharing the object starts it as it was first
    mixed, not as the first Planner left it (the schedule has no way back of its own). All three used to diverge
    silently."""
    rng = np.random.default_rng(5)
    batch, steps, mesh = 24, 10, ol.ClientPlaceTree(dp=2)
    feedback = [{n: float(rng.uniform(0, 3)) for n in NAMES[:3]} for _ in range(steps)]
    bufs = _big_buffers(batch)

    def planner(make):
        return ol.Planner(lambda g: g.mix(make()).distribute("DP").balance("greedy", microbatches=2), mesh, batch)

    once = _Ema()
    assert once.spec() == {"kind": "_Ema"}
    outside, inside, shared, alone = planner(lambda: once), planner(_Ema), None, planner(_Ema)
    want, cut = [], 4
    for step in range(steps):
        want.append(outside.plan(bufs, feedback=[feedback[step]]).to_dict())
        assert inside.plan(bufs, feedback=[feedback[step]]).to_dict() == want[-1], step
        if step == cut:
            resumed = planner(_Ema)
            resumed.load_state_dict(inside.state_dict())
        if step > cut:
            assert resumed.plan(bufs, feedback=[feedback[step]]).to_dict() == want[-1], step
    assert want[0] != want[-1]                                  # the feedback moved the mixture
    shared = planner(lambda: once)                              # an eval Planner on the object the first one moved
    assert [shared.plan(bufs).to_dict() for _ in range(3)] == [alone.plan(bufs).to_dict() for _ in range(3)]


def test_one_schedule_mixing_two_views_moves_once_a_step():
    """One Dynamic object mixed by the backbone's and the encoder's views takes each step's feedback once (it
    took it once per mix(), moving twice as fast), and a resume at a random step continues it exactly (the
    second mix's saved state used to overwrite the first's)."""
    rng = np.random.default_rng(11)
    batch, steps, mesh = 20, 8, ol.ClientPlaceTree(dp=2)
    bufs = make_buffers({"a": np.arange(1, 3 * batch), "b": np.arange(1, 3 * batch)},
                        {"a": np.full(3 * batch - 1, 4), "b": np.zeros(3 * batch - 1)})
    feedback = [{"a": float(rng.uniform(0, 2)), "b": 1.0} for _ in range(steps)]

    def planner():
        d = ol.Dynamic({"a": 1, "b": 1}, lr=0.3)

        def strategy(g):
            text = g.mix(d).view("text").distribute("DP").balance("greedy")
            images = g.mix(d).view("image").distribute("WORLD").balance("greedy")
            return text.plan(encoder=images)
        return d, ol.Planner(strategy, mesh, batch)

    ref = ol.Dynamic({"a": 1, "b": 1}, lr=0.3)
    d, a = planner()
    plans, cut = [], int(rng.integers(1, steps - 1))
    for step in range(steps):
        if step == cut:
            _, b = planner()
            b.load_state_dict(a.state_dict())
        ref.update(feedback[step])
        p = a.plan(bufs, feedback=[feedback[step]])
        assert p.stats["mixture"]["weights"] == pytest.approx(ref.weights(step)), step
        if step >= cut:
            assert b.plan(bufs, feedback=[feedback[step]]).to_dict() == p.to_dict(), step
    assert d.updates == steps


@pytest.mark.parametrize("sched", [
    ol.Linear({"a": 0.9, "b": 0.1}, {"a": 0.1, "b": 0.5, "c": 0.4}, steps=17),
    ol.Cosine({"a": 1}, {"c": 1}, steps=13, start_step=4),
    ol.Piecewise({0: {"a": 1, "b": 1}, 7: {"c": 1}, 12: {"a": 1, "b": 2, "c": 3}}),
], ids=["linear", "cosine", "piecewise"])
def test_builtin_schedules_through_mix(sched):
    batch, steps = 37, 25
    planner = _mix_planner(sched, batch)
    bufs = _big_buffers(batch)
    mixtures = [sched.weights(s) for s in range(steps)]
    realised = {}
    for p, target in zip((planner.plan(bufs) for _ in range(steps)), _exact_targets(mixtures, [batch] * steps)):
        for n, c in p.records.source_counts().items():
            realised[n] = realised.get(n, 0) + c
        _check_cumulative(realised, target)


def test_mix_takes_oldest_samples_first_and_batch_is_shuffled_by_seed():
    bufs = make_buffers({"a": np.arange(1, 41), "b": np.arange(1, 41)})
    p0 = _mix_planner(ol.Constant({"a": 3, "b": 1}), 16, seed=0).plan(bufs)
    p1 = _mix_planner(ol.Constant({"a": 3, "b": 1}), 16, seed=1).plan(bufs)
    # FIFO: the 12 oldest of a (indices 0..11) and 4 oldest of b (1000..1003)
    want = {("a", i) for i in range(12)} | {("b", 1000 + i) for i in range(4)}
    assert set(p0.sampled_keys()) == want == set(p1.sampled_keys())
    assert p0.sampled_keys() != p1.sampled_keys()       # order depends on the seed
