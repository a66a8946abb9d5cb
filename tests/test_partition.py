"""Offline source auto-partitioning (paper 5.1): limits and budgets, determinism, monotone workers,
memory pressure, shadows, and the round-robin rule it replaces (checked against RoleConfig.placement)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torchdata_overlord as ol
from torchdata_overlord.errors import ConfigError
from torchdata_overlord.roles.loader_parts import part_key
from torchdata_overlord.runtime.job_config import RoleConfig
from torchdata_overlord.runtime.refs import PLANNER, constructor_actor, loader_actor, shadow_actor
from torchdata_overlord.scaling import Placement, SourceProfile, auto_partition
from torchdata_overlord.scaling.auto import actor_processes
from torchdata_overlord.scaling.partition import chain_threads

MiB = 1 << 20


def profile(name, transform_s, group_bytes=8 * MiB, units=16, splittable=True, read_s=1e-6, sample_bytes=4096):
    return SourceProfile(name, transform_s, read_s, sample_bytes, group_bytes, 1000 * units, units, splittable, 64)


profiles_st = st.lists(
    st.builds(lambda t, r, sb, m, u, sp: (t, r, sb, m, u, sp),
              st.floats(0, 0.05), st.floats(0, 1e-3), st.integers(0, 1 << 20), st.integers(0, 512 * MiB),
              st.integers(1, 40), st.booleans()),
    min_size=1, max_size=9).map(lambda xs: {f"s{i}": SourceProfile(f"s{i}", t, r, sb, m, 1000 * u, u, sp, 64)
                                            for i, (t, r, sb, m, u, sp) in enumerate(xs)})


@st.composite
def jobs(draw, memory=True):
    profiles = draw(profiles_st)
    weights = {n: draw(st.floats(0, 1)) for n in profiles}
    kwargs = dict(cores=draw(st.floats(0.5, 64)), constructors=draw(st.integers(1, 8)),
                  global_batch=draw(st.integers(1, 512)), w_src=draw(st.integers(1, 16)),
                  w_actor=draw(st.integers(1, 8)), cluster_size=draw(st.integers(1, 6)),
                  memory_bytes=draw(st.one_of(st.none(), st.integers(0, 8 << 30))) if memory else None,
                  buffer_size=draw(st.one_of(st.none(), st.integers(1, 1024))), shadows=draw(st.booleans()),
                  max_processes=draw(st.one_of(st.none(), st.integers(1, 12))))
    return profiles, weights, kwargs


@settings(max_examples=150, deadline=None)
@given(jobs())
def test_limits_and_budgets_always_hold(job):
    profiles, weights, kw = job
    p = auto_partition(profiles, weights, **kw)
    assert list(p.sources) == list(profiles)                      # the job's source order
    for name, sp in p.sources.items():
        prof = profiles[name]
        assert 1 <= sp.actors <= min(prof.units if prof.splittable else 1, kw["global_batch"])
        assert 0 <= sp.workers <= kw["w_actor"]
        assert sp.actors * sp.workers <= kw["w_src"]
        assert sp.reason and "\n" not in sp.reason
        assert len(sp.processes) == sp.actors and all(0 <= q < p.processes for q in sp.processes)
    cap = kw["max_processes"] or max(1, int(kw["cores"]))
    packed = min(cap, 1 + kw["constructors"] + sum(sp.actors for sp in p.sources.values()))
    standby = kw["shadows"] and packed == 1 and kw["max_processes"] != 1     # the shadows' own process
    assert 1 <= p.processes <= packed + standby
    assert 0 <= p.planner < p.processes and len(p.constructors) == kw["constructors"]
    assert sum(sp.actors * sp.workers for sp in p.sources.values()) <= max(1, int(kw["cores"]))
    if kw["memory_bytes"] is not None and p.budget["memory"] > kw["memory_bytes"]:
        assert any("over the budget" in n for n in p.notes)
    assert p.actor_count() == (1 + kw["constructors"] + sum(sp.actors for sp in p.sources.values())
                               + (len(profiles) if kw["shadows"] else 0))


@settings(max_examples=60, deadline=None)
@given(jobs())
def test_same_inputs_same_placement_and_the_plain_form_round_trips(job):
    profiles, weights, kw = job
    p = auto_partition(profiles, weights, **kw)
    assert auto_partition(dict(profiles), dict(weights), **kw) == p
    assert Placement.from_dict(p.to_dict()) == p
    assert pickle.loads(pickle.dumps(p)) == p        # the rpc runtime sends it to the Planner's process


@settings(max_examples=150, deadline=None)
@given(jobs(memory=False), st.integers(1, 40), st.booleans())
def test_a_heavier_source_never_gets_fewer_workers_than_a_lighter_one_of_the_same_weight(job, units, splittable):
    profiles, _, kw = job
    profiles = {n: dataclasses.replace(p, units=units, splittable=splittable) for n, p in profiles.items()}
    p = auto_partition(profiles, {n: 1.0 for n in profiles}, **kw)
    total = {n: sp.actors * sp.workers for n, sp in p.sources.items()}
    by_cost = sorted(profiles, key=lambda n: profiles[n].cost_s)
    for light, heavy in zip(by_cost, by_cost[1:]):
        if profiles[heavy].cost_s > profiles[light].cost_s:
            assert total[heavy] >= total[light], p.render()


def test_cpu_follows_weight_times_cost_and_cheap_sources_run_inline():
    profiles = {"text": profile("text", 2e-4), "image": profile("image", 8e-3), "video": profile("video", 2e-2)}
    p = auto_partition(profiles, {"text": 0.6, "image": 0.3, "video": 0.1}, cores=16, memory_bytes=None,
                       constructors=2, global_batch=256)
    assert p.sources["text"].workers == 0 and p.sources["text"].actors == 1          # inline
    image, video = p.sources["image"], p.sources["video"]
    assert image.actors * image.workers > 4 and image.actors > 1                      # over w_actor: data parallel
    assert video.actors * video.workers >= 2
    assert "inline" in p.sources["text"].reason and "2 actors x" in image.reason
    assert p.budget["cpu"] <= 16 and p.budget["loader_cores"] < 16


def test_chain_threads_keep_every_source_within_its_share_of_the_cores():
    share = {"long": 0.57, "web": 0.20, "caps": 0.13, "code": 0.10}
    assert chain_threads(share, 2, 8) == {"long": 2, "web": 0, "caps": 0, "code": 0}     # 1.37 -> 2; the rest inline
    assert chain_threads(share, 1, 8) == {"long": 0, "web": 0, "caps": 0, "code": 0}     # one core: nothing to gain
    eight = chain_threads(share, 8, 8)
    assert eight == {"long": 6, "web": 2, "caps": 2, "code": 0}                          # ceil(share * 8 * 1.2); 0.96 -> inline
    assert all(share[n] * 8 / max(k, 1) <= 1 for n, k in eight.items())                  # no chain over total / cores
    assert chain_threads(share, 64, 8)["long"] == 8                                       # capped at w_src
    # the same source profiled at 48% (a loaded moment) still gets its second thread; 40% does not
    assert chain_threads({"long": 0.48, "web": 0.52}, 2, 8) == {"long": 2, "web": 2}
    assert chain_threads({"long": 0.40, "web": 0.60}, 2, 8) == {"long": 0, "web": 2}


@settings(max_examples=150, deadline=None)
@given(jobs(), st.integers(1, 64))
def test_thread_cores_only_add_threads_to_a_source_that_would_pace_the_step(job, thread_cores):
    profiles, weights, kw = job
    base = auto_partition(profiles, weights, **kw)
    p = auto_partition(profiles, weights, **kw, thread_cores=thread_cores)
    assert p.processes == base.processes and p.planner == base.planner and p.constructors == base.constructors
    for n, sp in p.sources.items():
        was = base.sources[n]
        assert (sp.actors, sp.processes, sp.cpu) == (was.actors, was.processes, was.cpu)   # where, and the CPU estimate
        threads, before = sp.actors * max(1, sp.workers), was.actors * max(1, was.workers)
        assert 0 <= sp.workers <= kw["w_actor"] and threads >= before
        if threads > before:
            assert "pace the step" in sp.reason
            assert sp.actors * sp.workers <= kw["w_src"]
    assert p.budget["thread_cores"] == thread_cores and base.budget["thread_cores"] is None


def test_memory_pressure_cuts_the_largest_row_groups_first_and_says_so():
    profiles = {"small": profile("small", 8e-3, group_bytes=4 * MiB), "big": profile("big", 8e-3, group_bytes=256 * MiB)}
    kw = dict(cores=32, constructors=1, global_batch=64, w_src=16, w_actor=4)
    free = auto_partition(profiles, {"small": 1, "big": 1}, memory_bytes=None, **kw)
    assert free.sources["big"].actors >= 3 and free.sources["small"].actors >= 3
    tight = auto_partition(profiles, {"small": 1, "big": 1}, memory_bytes=900 * MiB, **kw)
    assert tight.sources["big"].actors < free.sources["big"].actors
    assert tight.sources["small"].actors == free.sources["small"].actors              # big cut first
    assert tight.budget["memory"] <= 900 * MiB
    assert any("fewer actors" in n and "big" in n for n in tight.notes)
    assert "for memory" in tight.sources["big"].reason
    hopeless = auto_partition(profiles, {"small": 1, "big": 1}, memory_bytes=100 * MiB, **kw)
    assert [sp.actors for sp in hopeless.sources.values()] == [1, 1] and hopeless.processes == 1
    assert any("over the budget" in n for n in hopeless.notes)


@settings(max_examples=100, deadline=None)
@given(jobs())
def test_shadows_never_share_their_primarys_process_when_there_are_two(job):
    profiles, weights, kw = job
    p = auto_partition(profiles, weights, **{**kw, "shadows": True})
    assert set(p.shadows) == set(profiles)
    for name, at in p.shadows.items():
        assert 0 <= at < p.processes
        if kw["max_processes"] != 1:          # one role process: the shadows get a standby process
            assert p.processes >= 2 and at != p.sources[name].processes[0]
        # every loader part's shadow (as the rpc runtime places them) is outside that part's process
        where = actor_processes(p, True)
        for j, q in enumerate(p.sources[name].processes):
            key = part_key(name, j, p.sources[name].actors)
            assert where[shadow_actor(key)] != where[loader_actor(key)] or p.processes == 1


def test_one_role_process_gives_the_shadows_a_standby_process():
    """Issue 13: with every role packed in one process (a 2-core machine), a shadow there would die
    with its primary; the shadows get an idle process of their own instead, and the roles stay packed."""
    profiles = {n: profile(n, t) for n, t in [("web", 3e-4), ("caps", 8e-3)]}
    kw = dict(cores=1, memory_bytes=2 << 30, constructors=2, global_batch=8)
    packed = auto_partition(profiles, {"web": 1, "caps": 1}, **kw)
    shadowed = auto_partition(profiles, {"web": 1, "caps": 1}, shadows=True, **kw)
    assert packed.processes == 1 and shadowed.processes == 2
    assert dict(shadowed.shadows) == {"web": 1, "caps": 1}
    assert shadowed.planner == 0 and set(shadowed.constructors) == {0}
    assert all(sp.processes == (0,) for sp in shadowed.sources.values())
    assert any("standby process" in n for n in shadowed.notes)
    assert "process 1 (cpu 0.00" in shadowed.render()
    alone = auto_partition(profiles, {"web": 1, "caps": 1}, shadows=True, max_processes=1, **kw)
    assert alone.processes == 1 and any("takes both" in n for n in alone.notes)


@pytest.mark.parametrize("n_sources, constructors, n_processes, shadows", [
    (1, 1, 1, False), (3, 2, 2, False), (5, 4, 3, True), (2, 1, 7, True), (4, 2, 1, True), (6, 3, 4, True),
])
def test_uniform_is_todays_round_robin_rule(n_sources, constructors, n_processes, shadows):
    names = [f"src{i}" for i in range(n_sources)]
    cfg = RoleConfig(names, None, ol.ClientPlaceTree(dp=constructors * 2), global_batch=8, seq_len=None,
                     constructors=constructors, shadows=shadows)
    p = Placement.uniform(names, n_processes, constructors, workers={"src0": 2}, shadows=shadows)
    where = {PLANNER: p.planner, **{constructor_actor(c): q for c, q in enumerate(p.constructors)},
             **{loader_actor(n): sp.processes[0] for n, sp in p.sources.items()},
             **{shadow_actor(n): q for n, q in p.shadows.items()}}
    assert where == cfg.placement(n_processes)
    assert p.method == "n_workers" and p.processes == n_processes
    assert [sp.workers for sp in p.sources.values()] == [2] + [0] * (n_sources - 1)
    assert Placement.from_dict(p.to_dict()) == p


def test_render_names_every_source_and_process():
    profiles = {n: profile(n, t) for n, t in [("web", 3e-4), ("code", 2e-4), ("caps", 8e-3), ("vid", 2e-2)]}
    p = auto_partition(profiles, {"web": 0.5, "code": 0.2, "caps": 0.2, "vid": 0.1}, cores=8,
                       memory_bytes=2 << 30, constructors=2, global_batch=128, shadows=True)
    text = p.render()
    for name in profiles:
        assert f"source {name}:" in text and f"shadow:{name}" in text
    for q in range(p.processes):
        assert f"process {q} " in text
    assert "budget: 8 cores" in text and "totals:" in text
    uniform = Placement.uniform(list(profiles), 3, 2).render()
    assert all(f"source {n}:" in uniform for n in profiles) and all(f"process {q}:" in uniform for q in range(3))


def test_placement_is_immutable_and_bad_inputs_are_refused():
    p = auto_partition({"a": profile("a", 1e-3)}, {"a": 1}, cores=4, memory_bytes=None, constructors=1,
                       global_batch=8)
    with pytest.raises(TypeError):
        p.sources["b"] = p.sources["a"]
    with pytest.raises(AttributeError):
        p.processes = 3
    with pytest.raises(ConfigError, match="unknown sources"):
        auto_partition({"a": profile("a", 1e-3)}, {"b": 1}, cores=4, memory_bytes=None, constructors=1, global_batch=8)
    with pytest.raises(ConfigError, match="w_actor"):
        auto_partition({"a": profile("a", 1e-3)}, {"a": 1}, cores=4, memory_bytes=None, constructors=1,
                       global_batch=8, w_actor=0)
    zero = auto_partition({"a": profile("a", 1e-3), "b": profile("b", 1e-3)}, {}, cores=4, memory_bytes=None,
                          constructors=1, global_batch=8)
    assert any("weighed equally" in n for n in zero.notes)


@pytest.mark.parametrize("bad, match", [
    (dict(cores=float("inf")), "cores must be a finite number > 0, got inf"),
    (dict(cores=True), "cores must be a finite number > 0, got True"),
    (dict(weights=[1.0]), r"weights must map source names to weights .*got \[1.0\]"),
])
def test_auto_partition_names_a_bad_budget_or_weights(bad, match):
    args = dict(cores=4, weights={"a": 1})
    args.update(bad)
    with pytest.raises(ConfigError, match=match):
        auto_partition({"a": profile("a", 1e-3)}, args.pop("weights"), memory_bytes=None, constructors=1,
                       global_batch=8, **args)
