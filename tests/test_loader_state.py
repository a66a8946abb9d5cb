"""A loader state is checked as a whole on ``load_state_dict``: anything this configuration did not
write, unmodified, is refused with one ConfigError naming the first inconsistency, in both runtimes;
a state saved under another mixture needs ``strict=False``."""

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchdata_overlord as ol
from torchdata_overlord.testing import assert_identical
from test_loader import ROOT, corpus, make_sources  # noqa: F401 (fixture)

STEPS, BATCH = 3, 16
MESH = dict(dp=2)


def dp_strategy(weights):
    def strategy(g):
        return (g.mix(weights).distribute("DP").cost(ol.attention_flops)
                .balance("karmarkar_karp", microbatches=2, max_tokens=2048, oversize="split").plan())
    return strategy


WEIGHTS = {"web": 0.4, "code": 0.25, "long": 0.15, "caps": 0.2}


def module_strategy(g):
    """dp_strategy(WEIGHTS) at module level: the rpc runtime's workers unpickle it by name."""
    return dp_strategy(WEIGHTS)(g)


def loader_with(corpus, weights, strategy=None, **kw):
    return ol.OverlordLoader(make_sources(corpus), strategy or dp_strategy(weights), ol.ClientPlaceTree(**MESH),
                             rank=None, global_batch=BATCH, seq_len=None, image_token_id=corpus.image_token_id, **kw)


@pytest.fixture(scope="module")
def saved(corpus):
    """The state after STEPS steps, and the sample keys those steps delivered."""
    with loader_with(corpus, WEIGHTS) as loader:
        head = [x for _, x in zip(range(STEPS), loader)]
        return loader.state_dict(), keys_of(head)


@pytest.fixture(scope="module")
def fresh(corpus):
    with loader_with(corpus, WEIGHTS) as loader:
        yield loader


def keys_of(items) -> list:
    return [k for item in items for out in item.values() if out["delivery"] == "data"
            for mb in out["microbatches"] for k in mb["sample_keys"]]


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def edit_job(edit, checksum=True):
    """Change the parsed job part; with ``checksum``, as a deliberate edit would, seal it again."""
    def apply(state):
        job = json.loads(state["job"])
        edit(job)
        state["job"] = json.dumps(job, sort_keys=True)
        if checksum:
            state["checksum"] = sha256(state["job"])
    return apply


def setitem(key, value):
    return lambda state: state.__setitem__(key, value)


def planner(key, value):
    return lambda job: job["planner"].__setitem__(key, value)


def both(*edits):
    def apply(state):
        for e in edits:
            e(state)
    return apply


def version_1(state):
    """The layout the previous release wrote: no checksum, no mixture."""
    del state["checksum"], state["config"]["mixture"]
    state["version"] = 1


CASES = {
    "planner step behind the loaders": (edit_job(planner("step", 1)), r"job\.planner\.step is 1 but the state's 'step' is 3"),
    "planner and state step 1, mixer at 3 steps": (both(edit_job(planner("step", 1)), setitem("step", 1)),
                                                  r"has drawn 48 samples, more than 1 steps \(16 samples\)"),
    "negative step": (setitem("step", -3), r"'step' is -3, not an integer >= 0"),
    "negative planner step": (both(edit_job(planner("step", -3)), setitem("step", -3)), r"'step' is -3"),
    "job edited, not sealed": (edit_job(planner("step", 1), checksum=False), "does not match its checksum"),
    "truncated job": (lambda s: s.__setitem__("job", s["job"][: len(s["job"]) // 2]), "does not match its checksum"),
    # torch.distributed.checkpoint keeps one rank's 'job' and another's 'checksum' when their feedback differs
    "another rank's feedback": (edit_job(lambda job: job.__setitem__("feedback", [[4, {"web": 1.0}]]), checksum=False),
                                r"mixes the states of trainer ranks that differ: ranks saved after different numbers of steps.*"
                                r"ol.elastic.earliest"),
    "truncated job, sealed": (lambda s: s.update(job=s["job"][:100], checksum=sha256(s["job"][:100])), "is not JSON"),
    "job is 42": (setitem("job", 42), r"'job' is an int, not a str"),
    "no checksum": (lambda s: s.pop("checksum"), r"lacks \['checksum'\]"),
    "format version 1": (version_1, r"format version 1, written by an older torchdata_overlord"),
    "a source missing": (edit_job(lambda job: job["loaders"].pop("web")), r"job\.loaders has sources"),
    "taken index not a number": (edit_job(lambda job: job["loaders"]["code"].__setitem__("taken", ["x"])),
                                 r"job\.loaders\['code'\]\.taken\[0\] is 'x'"),
    "feedback for a planned step": (edit_job(lambda job: job.__setitem__("feedback", [[0, {"web": 1.0}]])),
                                    r"job\.feedback\[0\]\[0\] is 0, not an integer >= 3"),
    "planner of another seed": (edit_job(planner("seed", 5)), r"job\.planner\.seed is 5"),
    "another seed": (lambda s: s["config"].__setitem__("seed", 5), r"another loader configuration: seed: saved 5"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_inconsistent_state_is_refused_naming_the_inconsistency(saved, fresh, case):
    edit, message = CASES[case]
    state = copy.deepcopy(saved[0])
    edit(state)
    before = fresh.state_dict()
    with pytest.raises(ol.ConfigError, match=message):
        fresh.load_state_dict(state)
    assert fresh.state_dict() == before                      # nothing of a refused state is applied


def test_a_state_that_is_not_a_dict_is_refused(fresh):
    with pytest.raises(ol.ConfigError, match="got list"):
        fresh.load_state_dict([1, 2])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_change_to_the_job_part_is_refused(saved, fresh, data):
    """Truncations, and any one character replaced: refused by the checksum, before parsing."""
    state = copy.deepcopy(saved[0])
    text = state["job"]
    if data.draw(st.booleans(), label="truncate"):
        state["job"] = text[: data.draw(st.integers(0, len(text) - 1), label="length")]
    else:
        i = data.draw(st.integers(0, len(text) - 1), label="position")
        c = data.draw(st.characters(codec="utf-8").filter(lambda c: c != text[i]), label="replacement")
        state["job"] = text[:i] + c + text[i + 1:]
    with pytest.raises(ol.ConfigError, match="checksum"):
        fresh.load_state_dict(state)


def test_a_state_is_versioned_sealed_and_reloads_unchanged(saved, corpus, tmp_path):
    state = saved[0]
    assert state["version"] == 2 and state["checksum"] == sha256(state["job"])
    torch.save(state, tmp_path / "s.pt")
    with loader_with(corpus, WEIGHTS) as loader:
        assert loader.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True)) == []
        assert loader.state_dict() == state


def test_a_state_saved_under_another_mixture_needs_strict_false(saved, corpus):
    state, head = saved
    scaled = {k: 2 * v for k, v in WEIGHTS.items()}           # the same mixture, written at another scale
    with loader_with(corpus, scaled) as same:
        assert same.load_state_dict(state) == []
    other = {"web": 0.25, "code": 0.25, "long": 0.25, "caps": 0.25}
    with loader_with(corpus, other) as loader:
        before = loader.state_dict()
        with pytest.raises(ol.ConfigError, match=r'another strategy .*"web": 0\.4.*strict=False'):
            loader.load_state_dict(state)
        assert loader.state_dict() == before
        with pytest.warns(UserWarning, match="mixture"):
            changes = loader.load_state_dict(state, strict=False)
        assert len(changes) == 1 and '"web": 0.4' in changes[0] and '"web": 0.25' in changes[0]
        tail = [x for _, x in zip(range(2), loader)]
        assert [next(iter(x.values()))["step"] for x in tail] == [STEPS, STEPS + 1]      # from the saved position
        assert not set(keys_of(tail)) & set(head)                                  # nothing delivered again
        assert loader.last_plan.stats["mixture"]["weights"] == other               # with the new mixture


@pytest.mark.slow
def test_the_rpc_runtime_refuses_the_same_states_and_resumes_a_good_one(corpus, tmp_path):
    """runtime="rpc" writes the same format, and its loader checks a state before any role sees it."""
    with loader_with(corpus, WEIGHTS) as ref:
        stream = [x for _, x in zip(range(4), ref)]
    out = tmp_path / "out.pt"
    script = f"""
import copy, hashlib, json, sys, torch
sys.path.insert(0, {str(ROOT / 'tests')!r})
import torchdata_overlord as ol
from test_loader_state import WEIGHTS, loader_with, module_strategy
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({str(Path(corpus.root))!r}, scale="test", seed=0)

def refusal(state):
    try:
        loader.load_state_dict(state)
    except ol.ConfigError as e:
        return str(e)
    return "accepted"

with loader_with(corpus, WEIGHTS, module_strategy, runtime="rpc", n_workers=1) as loader:
    head = [x for _, x in zip(range(2), loader)]
    state = loader.state_dict()
    behind = copy.deepcopy(state)
    job = json.loads(behind["job"])
    job["planner"]["step"] = 1
    behind["job"] = json.dumps(job, sort_keys=True)
    behind["checksum"] = hashlib.sha256(behind["job"].encode()).hexdigest()
    mixed = copy.deepcopy(state)
    mixed["config"]["mixture"] = mixed["config"]["mixture"].replace("0.4", "0.5")
    refused = [refusal(behind), refusal(dict(state, step=-3)), refusal(mixed)]
    loader.load_state_dict(state)
    tail = [x for _, x in zip(range(2), loader)]
torch.save({{"state": state, "refused": refused, "items": head + tail}}, {str(out)!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    behind, negative, mixed = got["refused"]
    assert "job.planner.step is 1 but the state's 'step' is 2" in behind
    assert "'step' is -3" in negative
    assert "another strategy" in mixed
    for a, b in zip(got["items"], stream):
        assert_identical(a, b)
    with loader_with(corpus, WEIGHTS) as local:                     # the rpc state loads into runtime="local"
        local.load_state_dict(got["state"])
        assert_identical(next(iter(local)), stream[2])


def test_a_source_cycled_for_many_epochs_keeps_a_bounded_state(corpus, tmp_path):
    """A state lists the latest epochs each source started, not all of them: a small source cycled for a
    long run added one entry per epoch to every state, checkpoint and stats() forever. The stream resumed
    from such a state is the uninterrupted one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchdata_overlord.roles.source_loader import SourceLoader

    path = tmp_path / "tiny.parquet"
    pq.write_table(pa.table({"text": [f"line {i} of a tiny source" for i in range(6)]}), path, row_group_size=2)

    def loader():
        src = ol.ParquetSource("tiny", str(path), ol.Tokenize(corpus.spm_model, field="text"))
        return ol.OverlordLoader([src], dp_strategy({"tiny": 1.0}), ol.ClientPlaceTree(**MESH), rank=None,
                                 global_batch=6, seq_len=None)

    steps, more = 2 * SourceLoader.EPOCHS_KEPT + 3, 4
    with loader() as a:
        head = [x for _, x in zip(range(steps), a)]
        state = a.state_dict()
        epochs = json.loads(state["job"])["loaders"]["tiny"]["epochs_started"]
        assert len(a.stats()["sources"]["tiny"]["epochs_started"]) == SourceLoader.EPOCHS_KEPT     # (read ahead)
        tail = [x for _, x in zip(range(more), a)]
    assert len(epochs) == SourceLoader.EPOCHS_KEPT
    assert epochs == list(range(epochs[-1] - len(epochs) + 1, epochs[-1] + 1)) and epochs[-1] >= steps - 1
    with loader() as b:
        b.load_state_dict(state)
        assert_identical([x for _, x in zip(range(more), b)], tail)
    assert keys_of(head)                                   # (the tiny source did deliver)
