"""Bad input gets a clear error that names the offending value and, where there is one, the fix."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import torchdata_overlord as ol
from torchdata_overlord.plane.balancing import BinAssignment
from torchdata_overlord.plane.dgraph import PlanContext
from torchdata_overlord.plane.schedules import as_schedule
from _support import graph, make_buffers
from test_loader import corpus  # noqa: F401 (fixture)


# -- weights and schedules -------------------------------------------------------------------------
@pytest.mark.parametrize("weights, pattern", [
    ({"a": -0.5, "b": 1}, r"weight of source 'a' is negative \(-0.5\)"),
    ({"a": math.nan, "b": 1}, r"weight of source 'a' is nan; weights must be finite"),
    ({"a": math.inf}, r"weight of source 'a' is inf; weights must be finite"),
    ({"a": 0, "b": 0.0}, r"all weights are zero; at least one source must have a positive weight"),
    ({"a": "lots"}, r"weight of source 'a' is 'lots', not a number"),
    ({"a": "0.5", "b": 1}, r"weight of source 'a' is '0.5', not a number"),    # float() would take it
    ({"a": True, "b": 1}, r"weight of source 'a' is True, not a number"),
    ({}, r"weights must be a non-empty dict"),
])
def test_bad_weights(weights, pattern):
    with pytest.raises(ol.ConfigError, match=pattern):
        ol.Constant(weights)
    with pytest.raises(ol.ConfigError, match=pattern):
        ol.Piecewise({0: {"a": 1}, 5: weights})
    with pytest.raises(ol.ConfigError, match=pattern):
        ol.Linear({"a": 1}, weights, steps=10)
    with pytest.raises(ol.ConfigError, match=pattern):
        ol.Dynamic(weights)
    with pytest.raises(ol.ConfigError, match=pattern):
        ol.FromCallable(lambda s: weights).weights(3)
    # a plain dict given to mix() is a Constant schedule and is checked the same way
    g = graph(ol.ClientPlaceTree(dp=1), {"a": [1, 2], "b": [3, 4]}, global_batch=2)
    with pytest.raises(ol.ConfigError, match=pattern):
        g.mix(weights)


def test_schedule_construction_errors():
    with pytest.raises(ol.ConfigError, match=r"needs a stage starting at step 0, got steps \[5\]"):
        ol.Piecewise({5: {"a": 1}})
    # stage steps that are not integers >= 0 (a bare KeyError, or a stage never used, before)
    for stages, bad in (({0: {"a": 1}, "5": {"a": 2}}, "['5']"), ({0: {"a": 1}, 2.5: {"a": 2}}, "[2.5]"),
                        ({0: {"a": 1}, -3: {"a": 2}}, "[-3]"), ({True: {"a": 1}}, "[True]")):
        with pytest.raises(ol.ConfigError, match=rf"first step must be an integer >= 0, got {re.escape(bad)}"):
            ol.Piecewise(stages)
    with pytest.raises(ol.ConfigError, match="steps must be an integer >= 1, got 0"):
        ol.Linear({"a": 1}, {"a": 2}, steps=0)
    with pytest.raises(ol.ConfigError, match="steps must be an integer >= 1, got True"):
        ol.Linear({"a": 1}, {"a": 2}, steps=True)
    with pytest.raises(ol.ConfigError, match="start_step must be an integer >= 0, got -1"):
        ol.Cosine({"a": 1}, {"a": 2}, steps=4, start_step=-1)
    with pytest.raises(ol.ConfigError, match="Cosine schedule: steps must be"):
        ol.Cosine({"a": 1}, {"a": 2}, steps=-3)
    with pytest.raises(ol.ConfigError, match="lr must be a positive finite number"):
        ol.Dynamic({"a": 1}, lr=0)
    with pytest.raises(ol.ConfigError, match=r"floor must be in \[0, 1\)"):
        ol.Dynamic({"a": 1}, floor=1.0)
    with pytest.raises(ol.ConfigError, match="needs a callable of the step"):
        ol.FromCallable({"a": 1})
    with pytest.raises(ol.ConfigError, match="got int"):
        as_schedule(42)


def test_dynamic_feedback_errors():
    d = ol.Dynamic({"a": 1, "b": 1})
    with pytest.raises(ol.ConfigError, match=r"unknown sources \['zz'\]; known: \['a', 'b'\]"):
        d.update({"zz": 1.0})
    with pytest.raises(ol.ConfigError, match="feedback for 'a' is nan; must be finite"):
        d.update({"a": float("nan")})
    assert d.updates == 0 and d.weights(0) == {"a": 0.5, "b": 0.5}


def test_unknown_source_in_schedule():
    mesh = ol.ClientPlaceTree(dp=2)
    bufs = make_buffers({"web": np.arange(1, 20), "code": np.arange(1, 20)})
    p = ol.Planner(lambda g: g.mix({"web": 1, "wiki": 1}).distribute("DP"), mesh, 4)
    with pytest.raises(ol.ConfigError, match=r"unknown sources \['wiki'\]; the buffers hold \['web', 'code'\]"):
        p.plan(bufs)
    many = make_buffers({f"src{i:03d}": np.arange(1, 20) for i in range(300)})
    p = ol.Planner(lambda g: g.mix({"src007": 1, "scr012": 1}).distribute("DP"), mesh, 4)
    with pytest.raises(ol.ConfigError, match=r"unknown sources \['scr012'\]; 'scr012': did you mean 'src012'\?; the "
                                             r"buffers hold \['src000', .*'src011', '\.\.\. \(300 in all\)'\]") as err:
        p.plan(many)
    assert len(str(err.value)) < 400                 # not every one of 300 names


def test_unknown_source_first_named_at_a_later_step():
    """A callable schedule that names a missing source only at step 1 must fail there, not
    silently shrink the global batch."""
    mesh = ol.ClientPlaceTree(dp=2)
    bufs = make_buffers({"web": np.arange(1, 20)})
    sched = ol.FromCallable(lambda s: {"web": 1} if s == 0 else {"web": 1, "wiki": 3})
    p = ol.Planner(lambda g: g.mix(sched).distribute("DP"), mesh, 8)
    assert len(p.plan(bufs).sampled_keys()) == 8
    with pytest.raises(ol.ConfigError, match=r"unknown sources \['wiki'\]"):
        p.plan(bufs)


def test_buffer_shortage_names_the_source():
    mesh = ol.ClientPlaceTree(dp=2)
    bufs = make_buffers({"web": np.arange(1, 50), "code": np.arange(1, 4)})
    p = ol.Planner(lambda g: g.mix({"web": 1, "code": 1}).distribute("DP"), mesh, 16)
    with pytest.raises(ol.BufferShortageError,
                       match=r"step 0: source 'code' has 3 samples buffered but the schedule asks for 8"):
        p.plan(bufs)
    assert isinstance(ol.BufferShortageError("x"), RuntimeError)


def test_mix_needs_a_global_batch():
    g = graph(ol.ClientPlaceTree(dp=1), {"a": [1, 2]})
    with pytest.raises(ol.ConfigError, match="mix\\(\\) needs a global batch size >= 1, got None"):
        g.mix({"a": 1})


# -- axes and mesh ---------------------------------------------------------------------------------
def test_unknown_axis_in_distribute_and_broadcast_at():
    g = graph(ol.ClientPlaceTree(dp=2, tp=2), {"a": [1, 2, 3]})
    with pytest.raises(ol.ConfigError, match=r"unknown axis 'sp'; this mesh has \['pp', 'dp', 'cp', 'tp'\]"):
        g.distribute("SP")
    with pytest.raises(ol.ConfigError, match=r"broadcast_at\('sp'\): unknown axis; this mesh has"):
        g.distribute("DP").broadcast_at("SP")
    with pytest.raises(ol.ConfigError, match="no module 'encoder'"):
        g.distribute("WORLD", module="encoder")
    with pytest.raises(ol.ConfigError, match="group_size must be an integer >= 1, got 0"):
        g.distribute("DP", group_size=0)
    for axis in ("TP", "pp"):      # TP ranks / PP stages of one DP group must see the same samples
        with pytest.raises(ol.ConfigError, match=rf"distribute\('{axis}'\): the .*-parallel ranks of a data-parallel "
                                                 r"group take the same samples.*'DP', 'CP'.*'WORLD'"):
            g.distribute(axis)


def test_a_primitive_after_balance_that_would_discard_it_is_refused():
    """cost(), mix(), distribute() and select() drop a graph's balance; after balance() plan() then fell back to
    arrival order with one microbatch a bucket, silently."""
    g = graph(ol.ClientPlaceTree(dp=2), {"a": [5, 1, 9, 3, 7, 2]}, global_batch=6).mix({"a": 1})
    balanced = g.distribute("DP").balance("greedy", microbatches=3)
    for op, call in [("cost", lambda b: b.cost(ol.token_count)), ("mix", lambda b: b.mix({"a": 1})),
                     ("distribute", lambda b: b.distribute("DP")), ("select", lambda b: b.select(np.ones(6, bool)))]:
        with pytest.raises(ol.ConfigError, match=rf"{op}\(\) after balance\(\) would throw the balance away.*"
                                                 rf"call {op}\(\) before balance\(\)"):
            call(balanced)
    plan = g.distribute("DP").cost(ol.token_count).balance("greedy", microbatches=3).plan()
    assert plan.stats["method"] == "greedy" and plan.n_microbatches == 3
    assert balanced.view("text").distribute("DP").plan() is not None       # a view starts a new branch
    assert len(repr(balanced)) < 200 and "balanced" in repr(balanced) and "2 buckets" in repr(balanced)


def test_mesh_mismatch():
    with pytest.raises(ol.ConfigError, match=r"pp=2 x dp=4 x cp=1 x tp=2 has 16 ranks but world_size=8"):
        ol.ClientPlaceTree(pp=2, dp=4, tp=2, world_size=8)
    with pytest.raises(ol.ConfigError, match=r"module 'encoder' has 8 ranks \(dp=8\) but the mesh has 16"):
        ol.ClientPlaceTree(pp=2, dp=4, tp=2).attach("encoder", dp=8)


def test_planner_state_from_another_configuration():
    mesh = ol.ClientPlaceTree(dp=2)
    strat = lambda g: g.mix({"a": 1}).distribute("DP")  # noqa: E731
    a = ol.Planner(strat, mesh, 8, seed=1)
    a.plan(make_buffers({"a": np.arange(1, 20)}))
    state = a.state_dict()
    with pytest.raises(ol.ConfigError, match=r"another configuration: seed 1 vs 2"):
        ol.Planner(strat, mesh, 8, seed=2).load_state_dict(state)
    with pytest.raises(ol.ConfigError, match=r"global_batch 8 vs 16"):
        ol.Planner(strat, mesh, 16, seed=1).load_state_dict(state)
    with pytest.raises(ol.ConfigError, match=r"mesh .*'dp': 2.* vs .*'dp': 4"):
        ol.Planner(strat, ol.ClientPlaceTree(dp=4), 8, seed=1).load_state_dict(state)


def test_planner_construction_errors():
    mesh = ol.ClientPlaceTree(dp=2)
    for seed in (-1, 1.5, "0", True):
        with pytest.raises(ol.ConfigError, match=re.escape(f"seed must be an integer >= 0, got {seed!r}")):
            ol.Planner(lambda g: g, mesh, 8, seed=seed)
    assert ol.Planner(lambda g: g, mesh, 8, seed=np.int64(3)).seed == 3
    with pytest.raises(ol.ConfigError, match="strategy must be a callable"):
        ol.Planner("mix", mesh, 8)
    with pytest.raises(ol.ConfigError, match="mesh must be a ClientPlaceTree, got dict"):
        ol.Planner(lambda g: g, {"dp": 2}, 8)
    with pytest.raises(ol.ConfigError, match="global_batch must be an integer >= 1, got 0"):
        ol.Planner(lambda g: g, mesh, 0)


def test_a_global_batch_smaller_than_the_data_parallel_ranks():
    """Each sample goes to one DP bucket: fewer samples a step than buckets would leave a rank with padding only
    at every step (it used to, silently)."""
    from torchdata_overlord.plane.dry_run import check_strategy
    mesh = ol.ClientPlaceTree(dp=4, cp=2)
    with pytest.raises(ol.ConfigError, match=r"global_batch 3 is smaller than the 4 data-parallel ranks of "
                                             r"distribute\('DP'\), so 1 of them would get no sample at any step.*"
                                             r"give global_batch >= 4"):
        check_strategy(lambda g: g.mix({"a": 1}).distribute("DP").plan(), mesh, ["a"], 3, 0)
    check_strategy(lambda g: g.mix({"a": 1}).distribute("DP").plan(), mesh, ["a"], 4, 0)
    check_strategy(lambda g: g.mix({"a": 1}).distribute("CP").plan(), mesh, ["a"], 3, 0)   # a sample spans CP ranks


@pytest.mark.parametrize("runtime", ["local", "rpc"])
@pytest.mark.parametrize("strategy, kw, pattern", [
    (lambda g: g.mix({"web": 1, "zz": 1}).distribute("DP").plan(), {}, r"unknown sources \['zz'\]"),
    (lambda g: g.mix({"web": 1}).distribute("XX").plan(), {}, r"unknown axis 'xx'"),
    (lambda g: g.mix({"web": 1}).distribute("DP").balance("greedy", max_tokens=0).plan(), {}, r"max_tokens"),
    (lambda g: None, {}, r"strategy must return a Plan or a DGraph, got NoneType"),
    (lambda g: g.mix({"web": 1}).distribute("DP").plan(), {"global_batch": 1}, r"global_batch 1 is smaller"),
    (lambda g: g.distribute("DP").plan(), {}, r"never calls mix\(\).*not global_batch=4.*g.mix\(\{'web': 1.0\}\)"),
    (lambda g: g.mix({"web": 1}).distribute("DP").plan(), {"seed": -1}, r"seed must be an integer >= 0"),
    (lambda g: g.mix({"web": 1}).distribute("DP").plan(), {"pad_id": -1}, r"pad_id must be a token id.*got -1"),
    (lambda g: g.mix({"web": 1}).distribute("DP").plan(), {"image_token_id": 2.0},
     r"image_token_id must be a token id.*got 2.0"),
], ids=["unknown-source", "unknown-axis", "max-tokens", "returns-none", "batch-below-dp", "no-mix", "seed", "pad-id",
        "image-token-id"])
def test_a_bad_strategy_is_refused_where_the_loader_is_made(corpus, runtime, strategy, kw, pattern):
    """Planned once on stand-in metadata before any role starts: under rpc no process is started for it."""
    from test_loader import make_sources
    args = {"global_batch": 4, "seed": 0, **kw}
    with pytest.raises(ol.ConfigError, match=pattern):
        ol.OverlordLoader(make_sources(corpus, names=("web",)), strategy, ol.ClientPlaceTree(dp=2), rank=None,
                          seq_len=None, runtime=runtime, **args)


def web_only(g):
    return g.mix({"web": 1}).distribute("DP").plan()


@pytest.mark.parametrize("runtime", ["local", "rpc"])
@pytest.mark.parametrize("kw, pattern", [
    ({"workers": {"caps": 4}}, r"workers= names unknown sources \['caps'\]; sources are \['web'\]"),
    ({"buffer_size": {"wbe": 8}}, r"buffer_size= names unknown sources \['wbe'\]"),
    ({"rank": 2}, r"rank 2 is outside the mesh's 2 ranks .*: rank is this trainer's rank .* the mesh must be the "
                  r"trainers' own"),
    ({"twice": True}, r"sources: more than one source is named 'web'; give each source a name of its own"),
], ids=["workers", "buffer-size", "rank", "duplicate-name"])
def test_a_bad_argument_is_named_with_what_to_do(corpus, runtime, kw, pattern):
    """The user's mistakes in loader arguments name the argument: a {source: value} dict naming no source
    said only "settings", and two sources of one name were blamed on "the strategy" and its "buffers"."""
    from test_loader import make_sources
    sources = make_sources(corpus, names=("web",))
    kw = dict(kw)                                          # (the parameter's dict is shared by both runtimes)
    if kw.pop("twice", False):
        sources = sources + make_sources(corpus, names=("web",))
    args = {"global_batch": 4, "rank": None, **kw}
    with pytest.raises(ol.ConfigError, match=pattern):
        ol.OverlordLoader(sources, web_only, ol.ClientPlaceTree(dp=2), seq_len=None, runtime=runtime, **args)


class _Later(ol.Schedule):
    """Names 'code' from step 3 only (a user's schedule: its sources() sees step 0)."""

    def weights(self, step):
        return {"web": 1} if step < 3 else {"web": 1, "code": 1}


def test_a_source_the_mixture_never_names_is_warned_about(corpus):
    """A loader source missing from the schedule was silently never sampled (its loader reading for nothing).
    Sources a schedule or the strategy brings in at a later step are not warned about."""
    import warnings
    from test_loader import make_sources
    strat = lambda g: g.mix(ol.Linear({"web": 1}, {"web": 1, "code": 0}, steps=4)).distribute("DP").plan()  # noqa: E731
    with pytest.warns(UserWarning, match=r"sources \['long'\] are not in the strategy's mixture \(its first schedule "
                                         r"names \['code', 'web'\] at steps 0-15 .*\): they are never sampled"):
        ol.OverlordLoader(make_sources(corpus, names=("web", "code", "long")), strat, ol.ClientPlaceTree(dp=2),
                          rank=None, global_batch=4, seq_len=None).close()
    later = [lambda g: g.mix(_Later()).distribute("DP").plan(),
             lambda g: g.mix({"web": 1} if g.step < 100_000 else {"web": 1, "code": 1}).distribute("DP").plan()]
    for strat in later:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ol.OverlordLoader(make_sources(corpus, names=("web", "code")), strat, ol.ClientPlaceTree(dp=2),
                              rank=None, global_batch=4, seq_len=None).close()


def test_a_filter_after_the_mix_is_not_refused_for_its_stand_ins(corpus):
    """A select() after mix() keeps none of the one-token stand-ins; the loader is still made, and plans real
    data (the global-batch check used to count the stand-ins that passed the filter)."""
    from test_loader import make_sources
    strat = lambda g: (g.mix({"web": 1}).select(lambda r: r.tokens >= 8)  # noqa: E731
                       .distribute("DP").balance("greedy").plan())
    with ol.OverlordLoader(make_sources(corpus, names=("web",)), strat, ol.ClientPlaceTree(dp=2), rank=None,
                           global_batch=10, seq_len=None) as loader:
        assert next(iter(loader))[0]["delivery"] == "data"


def test_a_strategy_that_needs_real_metadata_is_left_to_its_first_step(corpus):
    """The stand-ins lack what a custom cost may read: only a ConfigError of the strategy counts."""
    from test_loader import make_sources

    def needs_images(records):
        if records.patches.sum() == 0:
            raise KeyError("no patches in these stand-ins")
        return records.tokens.astype(float)

    strat = lambda g: g.mix({"web": 1}).distribute("DP").cost(needs_images).balance("greedy").plan()  # noqa: E731
    with ol.OverlordLoader(make_sources(corpus, names=("web",)), strat, ol.ClientPlaceTree(dp=2), rank=None,
                           global_batch=4, seq_len=None) as loader:
        with pytest.raises(KeyError, match="no patches"):
            next(iter(loader))


# -- balance ---------------------------------------------------------------------------------------
@pytest.fixture
def dgraph():
    return graph(ol.ClientPlaceTree(dp=2, cp=2), {"a": [100, 200, 300, 400]})


def test_unknown_balance_method(dgraph):
    with pytest.raises(ol.ConfigError, match=r"unknown balancing method 'best'; registered: \[.*'greedy'.*"
                                             r"'karmarkar_karp'.*\] \(add your own with .*register_balancer\)"):
        dgraph.distribute("DP").balance("best")


@pytest.mark.parametrize("kw, pattern", [
    (dict(microbatches=0), r"microbatches must be an integer >= 1, got 0"),
    (dict(microbatches=-2), r"microbatches must be an integer >= 1, got -2"),
    (dict(microbatches=2.0), r"microbatches must be an integer >= 1, got 2.0"),
    (dict(microbatches=True), r"microbatches must be an integer >= 1, got True"),
    (dict(max_tokens=0), r"max_tokens must be None or an integer >= 1, got 0"),
    (dict(max_tokens=10.5), r"max_tokens must be None or an integer >= 1, got 10.5"),
    (dict(oversize="clip"), r"oversize must be one of \('error', 'truncate', 'split', 'drop'\), got 'clip'"),
    (dict(level="rank"), r"level must be one of \(.*'both'.*\), got 'rank'"),
])
def test_bad_balance_arguments(dgraph, kw, pattern):
    with pytest.raises(ol.ConfigError, match=pattern):
        dgraph.distribute("DP").balance("greedy", **kw)


def test_balance_and_plan_before_distribute(dgraph):
    with pytest.raises(ol.ConfigError, match=r"balance\(\) needs buckets: call distribute\('DP'\|'CP'\|'WORLD'\) "
                                             r"before balance\(\)"):
        dgraph.balance("greedy")
    with pytest.raises(ol.ConfigError, match=r"plan\(\) needs buckets"):
        dgraph.plan()
    with pytest.raises(ol.ConfigError, match=r"plan_raw\(\) needs buckets"):
        dgraph.plan_raw(lambda g: [])


@pytest.mark.parametrize("fn, pattern", [
    (lambda r: r.tokens[:-1] * 1.0,
     r"cost function <lambda> returned shape \(3,\); expected one value per sample \(4,\)"),
    (lambda r: -r.tokens * 1.0, r"returned -100.0 for sample a:0; costs must be finite and >= 0"),
    (lambda r: np.where(r.tokens > 250, np.nan, 1.0), r"returned nan for sample a:2"),
    (lambda r: ["x"] * len(r), r"cost function <lambda> returned list that is not numbers.*return one finite number"),
    (lambda r: None, r"cost function <lambda> returned shape \(\); expected one value per sample"),
])
def test_bad_cost_functions(dgraph, fn, pattern):
    with pytest.raises(ol.ConfigError, match=pattern):
        dgraph.cost(fn)
    with pytest.raises(ol.ConfigError, match="cost\\(\\) needs a callable"):
        dgraph.cost("flops")


# -- plan_raw ----------------------------------------------------------------------------------
def test_plan_raw_checks_the_permutation(dgraph):
    g = dgraph.distribute("DP")
    ok = g.plan_raw(lambda g: [[[0, 3], [1]], [[2]]])
    assert [[it.index for it in mb] for mb in ok.bucket_microbatches(0)] == [[0, 3], [1]]
    assert [[it.index for it in mb] for mb in ok.bucket_microbatches(1)] == [[2], []]
    assert ok.stats["method"] == "plan_raw"
    with pytest.raises(ol.ConfigError, match=r"not a permutation of the graph's 4 samples: missing rows \[2\], "
                                             r"duplicated \[\], out of range \[\]"):
        g.plan_raw(lambda g: [[[0, 3], [1]], []])
    with pytest.raises(ol.ConfigError, match=r"missing rows \[\], duplicated \[1\]"):
        g.plan_raw(lambda g: [[[0, 1, 3]], [[1, 2]]])
    with pytest.raises(ol.ConfigError, match=r"out of range \[7\]"):
        g.plan_raw(lambda g: [[[0, 1, 3, 7]], [[2]]])
    with pytest.raises(ol.ConfigError, match=r"one list of microbatches per bucket \(2\), got list"):
        g.plan_raw(lambda g: [[[0, 1, 2, 3]]])


# -- user balancers ------------------------------------------------------------------------------
def test_user_balancer_overflowing_max_tokens_is_caught(zigzag):
    mesh = ol.ClientPlaceTree(dp=2)
    g = graph(mesh, {"a": [100] * 8}).distribute("DP")
    # snake order over 2 x 1 bins puts 4 items of 100 tokens in each bin: 400 > 300
    with pytest.raises(ol.ConfigError, match=r"balancer 'zigzag_test' put 400 tokens in bin \d, over max_tokens=300"):
        g.balance("zigzag_test", microbatches=1, max_tokens=300, level="lockstep")
    assert zigzag and zigzag[-1].cap == 300
    # with room to spare the same balancer is accepted
    assert g.balance("zigzag_test", microbatches=1, max_tokens=400, level="lockstep").plan().stats["method"] == \
        "zigzag_test"


@pytest.mark.parametrize("result, pattern", [
    (lambda p: np.zeros(len(p.costs) + 1, np.int64), r"balancer 'bad_test' returned \(9,\) bins for 8 items"),
    (lambda p: np.full(len(p.costs), p.n_bins, np.int64), r"balancer 'bad_test' returned a bin outside 0..1"),
    (lambda p: BinAssignment(np.zeros(len(p.costs), np.int64), p.n_bins + 1),
     r"balancer 'bad_test' opened bins although growth was not allowed"),
    (lambda p: None, r"balancer 'bad_test' returned None; a balancer returns a BinAssignment, or one integer bin"),
    (lambda p: np.arange(len(p.costs)) % p.n_bins + 0.5,
     r"balancer 'bad_test' returned bins of dtype float64 that are not whole numbers \(e.g. 0.5\)"),
    (lambda p: np.full(len(p.costs), np.nan), r"balancer 'bad_test' returned bins of dtype float64 that are not whole"),
    (lambda p: ["x"] * len(p.costs), r"balancer 'bad_test' returned bins of dtype <U1"),
    (lambda p: BinAssignment(np.zeros(len(p.costs), np.int64), p.n_bins - 1),
     r"balancer 'bad_test' returned 1 bins where the problem has 2; every bin must stay"),
])
def test_user_balancer_returning_garbage_is_caught(register_temp, result, pattern):
    register_temp("bad_test", result)
    g = graph(ol.ClientPlaceTree(dp=2), {"a": [100] * 8}).distribute("DP")
    with pytest.raises(ol.ConfigError, match=pattern):
        g.balance("bad_test", level="bucket")


def test_user_balancer_returning_whole_floats_is_accepted(register_temp):
    """Bins as whole floats (1.0) are bins, as they were before non-whole ones were refused."""
    register_temp("float_test", lambda p: (np.arange(len(p.costs)) % p.n_bins).astype(np.float64))
    register_temp("int_test", lambda p: np.arange(len(p.costs)) % p.n_bins)
    g = graph(ol.ClientPlaceTree(dp=2), {"a": [100, 200, 300, 400, 500, 600, 700, 800]}).distribute("DP")
    a, b = (g.balance(m, level="bucket").plan() for m in ("float_test", "int_test"))
    assert [[it.key for mb in a.bucket_microbatches(k) for it in mb] for k in range(2)] == \
        [[it.key for mb in b.bucket_microbatches(k) for it in mb] for k in range(2)]


def test_user_balancer_ignoring_equal_counts_is_caught(register_temp):
    register_temp("lump_test", lambda p: np.zeros(len(p.costs), np.int64))
    g = graph(ol.ClientPlaceTree(dp=2), {"a": [100] * 8}).distribute("DP")
    with pytest.raises(ol.ConfigError, match=r"balancer 'lump_test' put more than 4 items in one bin \(equal_counts\)"):
        g.balance("lump_test", level="bucket", equal_counts=True)


# -- metadata ---------------------------------------------------------------------------------------
def test_bad_buffer_metadata():
    with pytest.raises(ol.ConfigError, match=r"column 'tokens' has a negative value at row 1"):
        ol.BufferMeta("a", [0, 1], [5, -1])
    with pytest.raises(ol.ConfigError, match=r"column 'tokens' has 3 values, expected 2"):
        ol.BufferMeta("a", [0, 1], [5, 6, 7])
    with pytest.raises(ol.ConfigError, match="source 'a' reports duplicate sample indices"):
        ol.BufferMeta("a", [3, 3], [5, 6])
    with pytest.raises(ol.ConfigError, match=r"extra column 'q' of source 'a' has 1 rows, expected 2"):
        ol.BufferMeta("a", [0, 1], [5, 6], extras={"q": np.array([1.0])})
    with pytest.raises(ol.ConfigError, match="two buffers report the same source name"):
        ol.DGraph.from_buffers([ol.BufferMeta("a", [0], [1]), ol.BufferMeta("a", [1], [1])],
                               PlanContext(ol.ClientPlaceTree()))
    g = graph(ol.ClientPlaceTree(), {"a": [1]})
    with pytest.raises(ol.ConfigError, match="no metadata column 'loss'"):
        g.records.column("loss")
