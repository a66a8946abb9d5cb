"""Elastic resume (issue 14): a state saved under one mesh, global batch, number of constructors or
runtime continues under another with nothing lost or repeated; sources added or removed with an
explicit opt-in; a state of another configuration (files, seed, transform) refused naming the difference."""

from __future__ import annotations

import collections
import copy
import json
import shutil
import subprocess
import warnings
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import torchdata_overlord as ol
from torchdata_overlord.testing import assert_identical
from test_loader import corpus, make_sources  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("web", "code", "long")
WEIGHTS = {"web": 0.4, "code": 0.25, "long": 0.15}


def strategy(g):
    """Module level: the rpc runtime's workers unpickle it by name."""
    return (g.mix(WEIGHTS).distribute("DP").cost(ol.attention_flops)
            .balance("greedy", microbatches=2, max_tokens=4096, oversize="split").plan())


def make_loader(corpus, mesh: dict, batch: int, names=TEXT, strat=strategy, **kw):
    return ol.OverlordLoader(make_sources(corpus, names=names), strat, ol.ClientPlaceTree(**mesh), rank=None,
                             global_batch=batch, seq_len=None, **kw)


def step_keys(item) -> dict[str, set]:
    """The samples one step delivered, per source (each once: CP/TP/PP replicas and split pieces share a key)."""
    out = collections.defaultdict(set)
    for per_rank in item.values():
        if per_rank["delivery"] != "data":
            continue
        for mb in per_rank["microbatches"]:
            for key in mb["sample_keys"]:
                source, index = key.rsplit(":", 1)           # "source:index"
                out[source].add(int(index))
    return out


def consume(loader, steps: int) -> tuple[dict[str, list], list[float]]:
    """Per source, the sample indices ``steps`` steps delivered (in step order), and each step's largest
    gap between a source's cumulative count and its schedule."""
    keys, errors = collections.defaultdict(list), []
    for _, item in zip(range(steps), loader):
        for s, idx in step_keys(item).items():
            keys[s] += sorted(idx)            # (a step's samples in key order: a set, not the read order)
        errors.append(loader.last_plan.stats["mixture"]["max_abs_error"])
    return keys, errors


meshes = st.fixed_dictionaries({"dp": st.integers(1, 3), "cp": st.sampled_from([1, 2]), "tp": st.sampled_from([1, 2]),
                                "pp": st.sampled_from([1, 2])})


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=(Phase.explicit, Phase.reuse, Phase.generate))         # a failure prints its example unshrunk
@given(before=meshes, after=meshes, batches=st.tuples(st.sampled_from([8, 12, 16]), st.sampled_from([8, 12, 16])),
       steps=st.tuples(st.integers(1, 3), st.integers(1, 3)))
def test_a_resume_under_another_mesh_and_batch_loses_and_repeats_nothing(corpus, before, after, batches, steps):
    """Before + after the resume, each source delivered exactly the samples an uninterrupted run delivers
    over the same number of that source's samples (all within the first epoch), and after the resume every
    source stays within one sample of its schedule."""
    with make_loader(corpus, before, batches[0]) as a:
        head, _ = consume(a, steps[0])
        state = a.state_dict()
    with make_loader(corpus, after, batches[1]) as b:
        changes = b.load_state_dict(state)
        assert (before != after) == any(c.startswith("mesh") for c in changes)
        assert (batches[0] != batches[1]) == any(c.startswith("global_batch") for c in changes)
        tail, errors = consume(b, steps[1])
        assert next(iter(b.state_dict()["config"]["mesh"].values())) is not None
    assert max(errors) < 1.0
    for s in TEXT:
        got = head[s] + tail[s]
        assert len(got) == len(set(got)), f"{s}: a sample delivered twice"
        assert sorted(got) == sorted(read_order(corpus, s, len(got))), f"{s}: not the first {len(got)} samples"


def read_order(corpus, name: str, n: int) -> list[int]:
    """The first ``n`` sample keys of a source as it reads them. Every run takes each source's oldest
    buffered samples first, so whatever the mesh and batch, an uninterrupted run that delivered n samples
    of a source delivered exactly these."""
    src = next(s for s in make_sources(corpus, names=TEXT) if s.name == name)
    return [next(src)[0] for _ in range(n)]


def test_a_resume_to_the_same_mesh_is_bit_identical(corpus):
    mesh = {"dp": 2, "cp": 2}
    with make_loader(corpus, mesh, 16) as ref:
        stream = [x for _, x in zip(range(5), ref)]
    with make_loader(corpus, mesh, 16) as a:
        [x for _, x in zip(range(2), a)]
        state = a.state_dict()
    with make_loader(corpus, mesh, 16) as b:
        assert b.load_state_dict(state) == []
        for x, y in zip([x for _, x in zip(range(3), b)], stream[2:]):
            assert_identical(x, y)


def test_sources_added_or_removed_need_an_opt_in(corpus):
    """Kept sources continue from their positions, a new one starts from its first sample, a removed one
    is reported; without ``sources_changed="allow"`` the state is refused naming the sources."""
    with make_loader(corpus, {"dp": 2}, 16, image_token_id=corpus.image_token_id) as a:
        head, _ = consume(a, 2)
        state = a.state_dict()

    def other(g):
        return (g.mix({"web": 0.5, "code": 0.2, "caps": 0.3}).distribute("DP").cost(ol.attention_flops)
                .balance("greedy", microbatches=2, max_tokens=4096, oversize="split").plan())

    names = ("web", "code", "caps")
    with make_loader(corpus, {"dp": 3}, 12, names=names, strat=other, image_token_id=corpus.image_token_id) as b:
        with pytest.raises(ol.ConfigError, match=r"removed: \['long'\], added: \['caps'\].*sources_changed='allow'"):
            b.load_state_dict(state)
        with pytest.warns(UserWarning, match="mixture"):
            changes = b.load_state_dict(state, sources_changed="allow")
        assert any("removed ['long']" in c and "added ['caps']" in c for c in changes)
        tail, errors = consume(b, 3)
    assert max(errors) < 1.0
    for s in ("web", "code"):
        got = head[s] + tail[s]
        assert len(set(got)) == len(got) and sorted(got) == sorted(read_order(corpus, s, len(got)))
    first = ol.ParquetSource("caps", corpus.sources["caps"])
    assert sorted(tail["caps"]) == sorted(next(first)[0] for _ in range(len(tail["caps"])))


def test_a_state_of_another_configuration_is_refused_naming_the_difference(corpus, tmp_path):
    with make_loader(corpus, {"dp": 2}, 16) as a:
        consume(a, 1)
        state = a.state_dict()
    reseeded = make_sources(corpus, seed=3, names=TEXT)
    with ol.OverlordLoader(reseeded, strategy, ol.ClientPlaceTree(dp=2), rank=None, global_batch=16,
                           seq_len=None) as b:
        with pytest.raises(ol.ConfigError, match=r"source 'web'.*seed=0.*seed=3"):
            b.load_state_dict(state)
    fewer = make_sources(corpus, names=TEXT)
    web = tmp_path / "web"
    shutil.copytree(Path(corpus.sources["web"]).parent, web)
    sorted(web.glob("*.parquet"))[0].unlink()
    fewer[0] = ol.ParquetSource("web", str(web / "*.parquet"), fewer[0].transform)
    with ol.OverlordLoader(fewer, strategy, ol.ClientPlaceTree(dp=2), rank=None, global_batch=16, seq_len=None) as b:
        with pytest.raises(ol.ConfigError, match=r"source 'web': file list differs"):
            b.load_state_dict(state)
    other = make_sources(corpus, names=TEXT)
    other[1] = ol.ParquetSource("code", corpus.sources["code"], ol.Tokenize(corpus.spm_model, field=corpus.text_fields["code"],
                                                                            max_tokens=64))
    with ol.OverlordLoader(other, strategy, ol.ClientPlaceTree(dp=2), rank=None, global_batch=16, seq_len=None) as b:
        with pytest.raises(ol.ConfigError, match=r"source 'code''s transform: saved .*max_tokens=None.*max_tokens=64"):
            b.load_state_dict(state)
        with pytest.warns(UserWarning, match="transform"):
            b.load_state_dict(state, strict=False)


def moved_copy(corpus, tmp_path):
    """``(state after 2 steps at dp=2, the 3 steps after it, the corpus copied under another root)``."""
    with make_loader(corpus, {"dp": 2}, 12) as a:
        consume(a, 2)
        state = a.state_dict()
        expected = [x for _, x in zip(range(3), a)]
    root = tmp_path / "ssd" / "corpus"
    shutil.copytree(corpus.root, root)
    copy = ol.sim.corpus.build_demo_corpus(root, scale="test", seed=0)
    assert copy.root == root and copy.spm_model != corpus.spm_model
    return state, expected, copy


def test_a_state_resumes_over_a_copy_of_the_data_and_tokenizer_under_another_root(corpus, tmp_path, caplog):
    """The files and the tokenizer model copied under another root (local SSD, another mount point): a state
    loads with strict=True and the stream continues bit for bit as in place; the moves are logged. A model file
    whose content differs is refused, saying so; a state saved before the config recorded the model's content
    loads in place, and over the moved model needs strict=False, which the error says."""
    state, expected, copy = moved_copy(corpus, tmp_path)
    with make_loader(copy, {"dp": 2}, 12) as b:
        with caplog.at_level("INFO", logger="torchdata_overlord"):
            assert b.load_state_dict(state) == []
        assert_identical([x for _, x in zip(range(3), b)], expected)
    assert f"model file moved (the same content): {corpus.spm_model} -> {copy.spm_model}" in caplog.text
    for s in TEXT:
        assert f"source {s!r}: the state's 4 files moved from {corpus.root / s} to {copy.root / s}" in caplog.text
    # a state of the previous release: no model digests in its config
    previous = {**state, "config": {k: v for k, v in state["config"].items() if k != "transform_files"}}
    with make_loader(corpus, {"dp": 2}, 12) as c:
        c.load_state_dict(previous)
        assert_identical([x for _, x in zip(range(3), c)], expected)
    with make_loader(copy, {"dp": 2}, 12) as c:
        with pytest.raises(ol.ConfigError, match=r"source 'code''s transform: saved .*; this state was saved by an "
                                                 r"earlier release.*pass strict=False"):
            c.load_state_dict(previous)
        with pytest.warns(UserWarning, match="transform"):
            c.load_state_dict(previous, strict=False)
        assert_identical([x for _, x in zip(range(3), c)], expected)
    Path(copy.spm_model).write_bytes(b"another model")
    with make_loader(copy, {"dp": 2}, 12) as c:
        with pytest.raises(ol.ConfigError, match=r"its model file differs: saved .*tok.* \(sha256 [0-9a-f]{12}\), "
                                                 r"now " + copy.spm_model):
            c.load_state_dict(state)


def test_a_tokenizer_model_changed_in_place_is_a_changed_transform(corpus, tmp_path):
    """A model retrained at the same path gives other token ids under the same transform description: refused
    under strict=True, saying the file changed in place, and accepted as a change with strict=False."""
    _, _, copy = moved_copy(corpus, tmp_path)
    with make_loader(copy, {"dp": 2}, 12) as a:
        consume(a, 2)
        state = a.state_dict()
    Path(copy.spm_model).write_bytes(b"a retrained model")
    with make_loader(copy, {"dp": 2}, 12) as b:
        with pytest.raises(ol.ConfigError, match=r"its model file changed in place \(.*tok.*: saved sha256 "
                                                 r"[0-9a-f]{12}, now [0-9a-f]{12}\)"):
            b.load_state_dict(state)
        with pytest.warns(UserWarning, match="changed in place"):
            assert any("changed in place" in c for c in b.load_state_dict(state, strict=False))


_MOVED_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
import torchdata_overlord as ol
from test_elastic import make_loader
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus, copy = (build_demo_corpus(r, scale="test", seed=0) for r in ({root!r}, {copy!r}))
if __name__ == "__main__":
    state = torch.load({state!r}, weights_only=False)
    with make_loader(copy, {{"dp": 2}}, 12, runtime="rpc", n_workers=2) as b:
        changes = b.load_state_dict(state)
        tail = [x for _, x in zip(range(3), b)]
    ft = ol.FaultTolerance(checkpoint_dir={store!r}, shadows=False, snapshot_every=3)
    with make_loader(corpus, {{"dp": 2}}, 12, runtime="rpc", fault_tolerance=ft, n_workers=2) as a:
        [x for _, x in zip(range(6), a)]
    torch.save({{"changes": changes, "tail": tail}}, {out!r})
"""


@pytest.mark.slow
def test_the_rpc_runtime_resumes_over_a_copy_under_another_root(corpus, tmp_path):
    """runtime="rpc": a state taken over the corpus loads over its copy (data and tokenizer) under another
    root, with strict=True, and continues bit for bit; a checkpoint store written over the corpus restores
    (snapshot plus replay) over the copy too."""
    state, expected, copy = moved_copy(corpus, tmp_path)
    saved, out, store = tmp_path / "state.pt", tmp_path / "out.pt", tmp_path / "store"
    torch.save(state, saved)
    script = _MOVED_SCRIPT.format(tests=str(ROOT / "tests"), root=str(corpus.root), copy=str(copy.root),
                                  state=str(saved), store=str(store), out=str(out))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    assert got["changes"] == []
    assert_identical(got["tail"], expected)
    with make_loader(corpus, {"dp": 2}, 12) as ref:
        stream = [x for _, x in zip(range(6), ref)]
    with make_loader(copy, {"dp": 2}, 12) as b:
        assert b.load_checkpoint_store(str(store), step=4) == []      # the snapshot of step 3, a replay of step 4
        assert_identical([x for _, x in zip(range(2), b)], stream[4:])


def test_earliest_picks_the_state_with_the_fewest_steps(corpus):
    with make_loader(corpus, {"dp": 2}, 8) as a:
        consume(a, 1)
        one = a.state_dict()
        consume(a, 2)
        three = a.state_dict()
    assert ol.elastic.earliest([three, one, three]) is one


def rpc_cases(n: int, seed: int) -> list[dict]:
    """``n`` random resumes (meshes, batches, steps, runtimes) with the rpc runtime on at least one side; an
    rpc resume at dp > 1 has a single Data Constructor (the saving job had one per DP group)."""
    import random
    rng = random.Random(seed)

    def mesh():
        return {"dp": rng.randint(1, 3), "cp": rng.choice([1, 2]), "tp": rng.choice([1, 2]), "pp": rng.choice([1, 2])}
    out = []
    for i in range(n):
        runtimes = [("rpc", "local"), ("local", "rpc"), ("rpc", "rpc")][i % 3]
        before, after = mesh(), mesh()
        out.append({"before": before, "after": after, "batches": [rng.choice([8, 12, 16]) for _ in range(2)],
                    "steps": [rng.randint(1, 3) for _ in range(2)], "runtimes": runtimes,
                    "constructors": 1 if runtimes[1] == "rpc" and after["dp"] > 1 else None})   # one for all DP groups
    return out


@pytest.mark.slow
def test_resumes_across_runtimes_at_random_meshes_lose_and_repeat_nothing(corpus, tmp_path):
    """The property test's claim with real role processes: random pairs of meshes, batches and steps,
    saved by one runtime and resumed by the other (or by rpc again, with one Data Constructor or one per
    DP group)."""
    cases = rpc_cases(3, seed=14)
    out = tmp_path / "out.json"
    script = f"""
import json, sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
from test_elastic import consume, make_loader
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({str(Path(corpus.root))!r}, scale="test", seed=0)
if __name__ == "__main__":
    results = []
    for case in {cases!r}:
        kw = [dict(runtime=r) for r in case["runtimes"]]
        if case["constructors"] and case["runtimes"][1] == "rpc":
            kw[1]["constructors"] = case["constructors"]
        with make_loader(corpus, case["before"], case["batches"][0], **kw[0]) as a:
            head, _ = consume(a, case["steps"][0])
            state = a.state_dict()
        with make_loader(corpus, case["after"], case["batches"][1], **kw[1]) as b:
            changes = b.load_state_dict(state)
            tail, errors = consume(b, case["steps"][1])
        results.append({{"head": head, "tail": tail, "errors": errors, "changes": changes}})
    json.dump(results, open({str(out)!r}, "w"))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case, got in zip(cases, json.loads(out.read_text())):
        assert max(got["errors"]) < 1.0, case
        assert (case["before"] != case["after"]) == any(c.startswith("mesh") for c in got["changes"]), case
        for s in TEXT:
            seen = got["head"].get(s, []) + got["tail"].get(s, [])
            assert len(seen) == len(set(seen)), (case, s)
            assert sorted(seen) == sorted(read_order(corpus, s, len(seen))), (case, s)


def dynamic_strategy(g):
    """Module level (the rpc workers unpickle it); builds its Dynamic schedule at every plan."""
    return (g.mix(ol.Dynamic({"web": 0.5, "code": 0.3, "long": 0.2}, lr=2.0)).distribute("DP")
            .cost(ol.token_count).balance("greedy", microbatches=2).plan())


def loss(step: int) -> dict:
    """A deterministic stand-in for per-source training loss."""
    return {"web": 1.0 + (step % 3), "code": 2.0, "long": 0.5 * (step % 2)}


def run_with_feedback(loader, steps: int, start: int = 0) -> list:
    out = []
    for i, item in zip(range(steps), loader):
        out.append(item)
        loader.feedback(loss(start + i))
    return out


@pytest.mark.slow
def test_a_resume_from_the_checkpoint_store_keeps_the_trainers_feedback(corpus, tmp_path):
    """A fault-tolerant rpc job with a Dynamic schedule and feedback at every step writes its store; a local
    loader resumed from it continues exactly like an uninterrupted run: the resumed state holds the feedback the
    trainer gave by that step for the plans after it, which the store takes from the plans that used it (it
    used to keep only what was unplanned at the step, and the plans after the resume lost the rest). Resuming
    at a step whose feedback the job had not planned when it stopped says so."""
    store = tmp_path / "store"
    script = f"""
import sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
import torchdata_overlord as ol
from test_elastic import make_loader, dynamic_strategy, run_with_feedback
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({str(Path(corpus.root))!r}, scale="test", seed=0)
if __name__ == "__main__":
    ft = ol.FaultTolerance(checkpoint_dir={str(store)!r}, shadows=False, snapshot_every=3)
    with make_loader(corpus, {{"dp": 2}}, 12, strat=dynamic_strategy, runtime="rpc", fault_tolerance=ft,
                     n_workers=2) as a:
        run_with_feedback(a, 11)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with make_loader(corpus, {"dp": 2}, 12, strat=dynamic_strategy) as ref:
        stream = run_with_feedback(ref, 12)
    kept = ol.runtime.checkpoint_store.CheckpointStore(str(store)).steps("planner")
    warned, regiven = [], []
    for at in kept:                     # every step the store keeps: exact, or warned with what makes it exact
        with make_loader(corpus, {"dp": 2}, 12, strat=dynamic_strategy) as b:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                changes = b.load_checkpoint_store(str(store), step=at)
            assert [str(w.message) for w in caught] == (["OverlordLoader.load_checkpoint_store: " + changes[0]]
                                                        if changes else [])
            exact = not changes
            if changes:
                assert changes[0].startswith("feedback: the store has none for the plans of steps"), changes
                warned.append(at)
                if "give the feedback of the last step consumed again" in changes[0]:
                    b.feedback(loss(at - 1))      # what the trainer gave after consuming `at` steps
                    exact = True
                    regiven.append(at)
            tail = run_with_feedback(b, 12 - at, start=at)
        if exact:
            for x, y in zip(tail, stream[at:]):
                assert_identical(x, y)
    assert warned and warned[-1] == kept[-1] and kept[0] not in warned and regiven, (kept, warned, regiven)


@pytest.mark.slow
def test_a_job_restarts_elastically_from_its_checkpoint_store(corpus, tmp_path):
    """A fault-tolerant rpc job at dp=2 writes its checkpoint store; a local loader at dp=3 cp=2 resumes
    from the store at the step the model checkpoint consumed (each source: snapshot plus replay), and at the
    default step (what every trainer had reported consumed), with nothing lost or repeated."""
    out, store = tmp_path / "out.json", tmp_path / "store"
    script = f"""
import json, sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
import torchdata_overlord as ol
from test_elastic import consume, make_loader
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({str(Path(corpus.root))!r}, scale="test", seed=0)
if __name__ == "__main__":
    ft = ol.FaultTolerance(checkpoint_dir={str(store)!r}, shadows=False, snapshot_every=3)
    with make_loader(corpus, {{"dp": 2}}, 8, runtime="rpc", fault_tolerance=ft, n_workers=2) as a:
        head, _ = consume(a, 7)
    json.dump({{"head": head}}, open({str(out)!r}, "w"))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    head = json.loads(out.read_text())["head"]
    with make_loader(corpus, {"dp": 3, "cp": 2}, 12) as b:
        changes = b.load_checkpoint_store(str(store), step=7)       # the snapshot of step 6, a replay of step 6
        assert any(c.startswith("mesh") for c in changes) and any(c.startswith("global_batch") for c in changes)
        tail, errors = consume(b, 2)
        assert b.state_dict()["step"] == 9
    assert max(errors) < 1.0
    for s in TEXT:
        seen = head[s] + tail[s]
        assert len(seen) == len(set(seen)) and sorted(seen) == sorted(read_order(corpus, s, len(seen))), s
    with make_loader(corpus, {"dp": 1}, 8) as c:
        c.load_checkpoint_store(str(store))
        assert 6 <= c.state_dict()["step"] <= 7           # released: what the trainer had reported consumed
        with pytest.raises(ol.ConfigError, match=r"no Planner checkpoint at step 0"):
            c.load_checkpoint_store(str(store), step=0)
