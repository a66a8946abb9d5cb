"""Data-parallel Source Loader parts: a source read by k loaders gives the stream one loader gives.

A small Planner stand-in merges the parts' buffers (``BufferMeta.merge``), takes samples from the
merged view (oldest first, and some out of order, as a strategy may), hands each part the indices it
holds and, every few steps, merges the parts' states (``merge_states``) and reshards them into
another number of parts. Whatever the k's, the taken keys equal those of a single loader over the
same steps: nothing lost, nothing repeated, same order. Real Parquet files (several row groups,
uneven sizes) and a transform that skips some rows under ``on_error="skip"``.
"""

from __future__ import annotations

import copy
import glob

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import torchdata_overlord as ol
from torchdata_overlord.plane.records import BufferMeta
from torchdata_overlord.roles.loader_parts import merge_states, part_keys
from torchdata_overlord.roles.source_loader import SourceLoader
from torchdata_overlord.sources import ParquetSource
from _support import numbered_parquet


def _transform(row):
    if row["n"] % 11 == 5:
        raise ValueError("a bad row")          # skipped under on_error="skip"
    return {"input_ids": [row["n"] % 97 + 1] * (row["n"] % 7 + 1)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return numbered_parquet(tmp_path_factory.mktemp("parts"), seed=0, rows=(40, 90), row_groups=(6, 17))


def _loaders(files, k, state=None, buffer=12):
    out = []
    for j in range(k):
        src = ParquetSource("s", files, _transform, seed=3, on_error="skip")
        src.shard(j, k)
        loader = SourceLoader(src, buffer)
        if state is not None:
            loader.reset(copy.deepcopy(state))
        out.append(loader)
    return out


def _step(loaders, want, rng, buffer=12):
    """One planned step over the parts: the merged view's oldest ``want`` samples plus one out of
    order (when there is one); each part gives the indices it holds."""
    merged, owner = BufferMeta.merge([p.metadata() for p in loaders], buffer)
    pick = list(range(min(want, len(merged))))
    if len(merged) > want and rng.random() < 0.5:
        pick.append(int(rng.integers(want, len(merged))))
    got = {}
    for j, part in enumerate(loaders):
        idx = [int(merged.index[r]) for r in pick if owner[r] == j]
        got.update(part.take(idx) if idx else {})
    return [int(merged.index[r]) for r in pick], got


def _run(files, layout, steps, seed):
    """Taken indices per step when the source is split as ``layout[s]`` parts from step s on."""
    rng, loaders, k, out = np.random.default_rng(seed), None, None, []
    for s in range(steps):
        if layout[s] != k:
            state = None if loaders is None else merge_states([p.get_state() for p in loaders])
            k, loaders = layout[s], _loaders(files, layout[s], state)
        keys, got = _step(loaders, 5, rng)
        assert sorted(got) == sorted(keys)
        out.append(keys)
    return out


def test_part_keys_name_the_parts():
    assert part_keys("web", 1) == ["web"] and part_keys("web", 3) == ["web@0of3", "web@1of3", "web@2of3"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ks=st.lists(st.integers(1, 4), min_size=1, max_size=4), seed=st.integers(0, 10))
def test_any_split_and_any_reshard_gives_the_single_loader_stream(files, ks, seed):
    steps = 70                                # > one epoch of ~200 rows at ~5.5 a step
    change = sorted(np.random.default_rng(seed).choice(np.arange(1, steps), len(ks) - 1, replace=False))
    layout = [ks[int(np.searchsorted(change, s, side="right"))] for s in range(steps)]
    one = _run(files, [1] * steps, steps, seed)
    assert _run(files, layout, steps, seed) == one
    flat = [i for keys in one for i in keys]
    n = ParquetSource("s", files).num_rows
    first = [i for i in flat if i < n]
    assert len(first) == len(set(first))      # within an epoch nothing repeats


def test_a_merged_state_resumes_in_fresh_parts_exactly(files):
    rng = np.random.default_rng(1)
    parts = _loaders(files, 3)
    for _ in range(9):
        _step(parts, 5, rng)
    state = merge_states([p.get_state() for p in parts])
    tail = [_step(parts, 5, np.random.default_rng(7))[0] for _ in range(20)]
    for k in (1, 2, 3, 4):
        again = _loaders(files, k, state)
        assert [_step(again, 5, np.random.default_rng(7))[0] for _ in range(20)] == tail


# -- in a job: the same outputs whatever the number of loader actors per source ------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from torchdata_overlord.sim.corpus import build_demo_corpus
    return build_demo_corpus(tmp_path_factory.mktemp("corpus"), scale="test", seed=0)


def _job_outputs(corpus, steps, state=None, **kw):
    from test_rpc_job import job_kwargs, make_mesh, make_sources, vlm_strategy
    from torchdata_overlord.runtime.local import LocalJob

    job = LocalJob(make_sources(corpus), vlm_strategy, make_mesh(), **job_kwargs(corpus), **kw)
    try:
        if state is not None:
            job.load_state_dict(state)
        out = [job.step().outputs for _ in range(steps)]
        return out, job.state_dict()
    finally:
        job.close()


def test_k_loader_actors_per_source_give_the_same_batches_bit_for_bit(corpus):
    from torchdata_overlord.testing import assert_identical

    steps = 10
    ref, ref_state = _job_outputs(corpus, steps)
    for actors in (2, 3, {"web": 3, "caps": 2}):
        got, state = _job_outputs(corpus, steps, actors=actors)
        for a, b in zip(got, ref):
            assert_identical(a, b)
        # the Planner's state is the same; the loaders' may say the same position another way (a part
        # stands at the end of a unit another part continues): the next test resumes from it
        assert state["planner"] == ref_state["planner"] and state["loaders"].keys() == ref_state["loaders"].keys()


def test_a_state_saved_under_one_split_resumes_under_another(corpus):
    from torchdata_overlord.testing import assert_identical

    ref, _ = _job_outputs(corpus, 12)
    _, mid = _job_outputs(corpus, 5, actors=3)
    tail, _ = _job_outputs(corpus, 7, state=mid, actors={"web": 2, "caps": 3})
    for a, b in zip(tail, ref[5:]):
        assert_identical(a, b)


def _one_source(g):
    return g.mix({"s": 1.0}).distribute("DP").balance("greedy", microbatches=1).plan()


def test_stats_of_a_source_split_over_loader_actors_are_the_sources_own(files, tmp_path):
    """``stats()["sources"]`` is keyed by source even when a source is split over loader actors: the parts'
    counts add up, each part's own stats under ``"parts"``, and a file skipped whole (every part opens every
    file) counts once (before: only ``"s@0of3"``... keys, and the file counted three times)."""
    from torchdata_overlord.runtime.local import LocalJob

    bad = tmp_path / "zz_truncated.parquet"
    data = open(sorted(glob.glob(files))[0], "rb").read()
    bad.write_bytes(data[: len(data) // 2])
    paths = sorted(glob.glob(files)) + [str(bad)]
    job = LocalJob([ParquetSource("s", paths, _transform, seed=3, on_error="skip")], _one_source,
                   ol.ClientPlaceTree(dp=2), 8, None, actors={"s": 3})
    try:
        for _ in range(6):
            job.step()
        got = job.stats()["sources"]
    finally:
        job.close()
    assert list(got) == ["s"]
    s = got["s"]
    assert sorted(s["parts"]) == part_keys("s", 3)
    parts = list(s["parts"].values())
    assert all(p["skipped_files"] == {str(bad): 1} for p in parts)
    assert s["skipped_files"] == {str(bad): 1}
    assert s["skipped"] == sum(p["skipped"] for p in parts) - 2 > 1          # rows the transform failed on, too
    assert s["skipped_distinct"] == sum(p["skipped_distinct"] for p in parts) - 2
    assert s["served"] == sum(p["served"] for p in parts) and s["buffered"] == sum(p["buffered"] for p in parts)


@pytest.mark.parametrize("seed", range(4))
def test_a_reused_metadata_report_equals_a_fresh_one(files, seed):
    """metadata() hands an unchanged buffer's last report back (read-only) instead of gathering it again: at any
    point of a random run of takes, refills and resets, of an endless source and of one that runs out (whose
    buffer then shrinks), it equals the report gathered afresh."""
    rng = np.random.default_rng(seed)
    loader = SourceLoader(ParquetSource("s", files, _transform, seed=3, on_error="skip", epochs=seed % 2 or None), 12)
    start, ran_out = loader.get_state(), 0
    fields = ("index", "tokens", "num_images", "patches", "patches_sq", "order")
    for _ in range(300):
        got = loader.metadata()
        loader._reported = None                        # the report as gathered without reuse
        fresh = loader.metadata()
        for f in fields:
            a, b = getattr(got, f), getattr(fresh, f)
            assert (a is None and b is None) or np.array_equal(a, b), f
        assert not got.index.flags.writeable and not got.tokens.flags.writeable
        assert loader.metadata() is fresh              # unchanged: the same report
        ran_out += loader.exhausted
        act = rng.integers(8)
        if act < 5 and len(fresh):                     # take some, oldest or not
            k = int(rng.integers(1, len(fresh) + 1))
            loader.take([int(i) for i in rng.choice(fresh.index, k, replace=False)])
        elif act == 5 and rng.random() < 0.2:
            loader.reset(copy.deepcopy(start if rng.random() < 0.5 else loader.get_state()))
        elif act == 6:
            loader.fill()
    assert ran_out if seed % 2 else not ran_out       # the finite source ran out (its buffer then shrank)
