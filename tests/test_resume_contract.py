"""The resume contract (``torchdata_overlord.testing.check_resume_contract``) on every stateful class.

Each entry of ``CASES``, ``builder(corpus, request)`` (``request.getfixturevalue`` gives other
fixtures), builds a :class:`~torchdata_overlord.testing.ResumeCase` from the real test corpus (Parquet
files written by pyarrow, a sentencepiece model trained on their text, JPEG captions): adding a
stateful class (a JSONL source, a node adapter) is one builder and one line in ``CASES``. The
contract resumes at 0, just before and at an epoch boundary and at seeded random midpoints, in fresh
objects, through ``torch.save``/``torch.load(weights_only=True)``, and replays everything from the
initial state.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchdata_overlord as ol
from torchdata_overlord.roles.constructor import DataConstructor
from torchdata_overlord.roles.source_loader import SourceLoader
from torchdata_overlord.sources import ParquetSource
from torchdata_overlord.testing import ResumeCase, assert_identical, check_resume_contract
from torchdata_overlord.transforms import Tokenize
from test_loader import corpus, make_sources  # noqa: F401 (module-scoped corpus fixture)

TESTS = Path(__file__).resolve().parent


def _source(corpus, name="code", seed=5):
    return ParquetSource(name, corpus.sources[name], Tokenize(corpus.spm_model, field=corpus.text_fields[name]),
                         seed=seed)


def _rows(corpus, name="code"):
    return _source(corpus, name).num_rows


# -- sources ------------------------------------------------------------------------------------

def parquet_source(corpus, request):
    """Items ``(key, record)``; the second epoch (new shuffle) starts at item ``num_rows``."""
    rows = _rows(corpus)
    return ResumeCase.for_stateful(lambda: _source(corpus), n=rows + 6, boundaries=[rows])


def _jsonl_glob(request, fmt):
    from test_sources import write
    return write(request.getfixturevalue("tmp_path_factory").mktemp(fmt), fmt)


def file_source(fmt):
    """FileSource over real JSON Lines / Arrow IPC files; the second epoch starts at item ``num_rows``."""
    def build(corpus, request):
        glob = _jsonl_glob(request, fmt)
        make = lambda: ol.FileSource("t", glob, seed=4)      # noqa: E731
        rows = make().num_rows
        return ResumeCase.for_stateful(make, n=rows + 6, boundaries=[rows])
    return build


def node_source(corpus, request):
    """NodeSource over a user's BaseNode (its own state) that ends after 50 items."""
    from test_sources import counter
    return ResumeCase.for_stateful(lambda: ol.NodeSource("n", counter), n=50, boundaries=[25])


# -- Source Loader ------------------------------------------------------------------------------

def source_loader_stream(corpus, request):
    """The BaseNode stream (oldest buffered sample first), over a worker pool."""
    rows = _rows(corpus)
    return ResumeCase.for_node(lambda: SourceLoader(_source(corpus), buffer_size=7, workers=2), n=rows + 6,
                               boundaries=[rows])


def source_loader_files(corpus, request):
    """The BaseNode stream over a FileSource (Arrow IPC files, tokenized text), over a worker pool."""
    glob = _jsonl_glob(request, "arrow")
    tok = Tokenize(corpus.spm_model, field="text")
    rows = ol.FileSource("t", glob).num_rows
    return ResumeCase.for_node(lambda: SourceLoader(ol.FileSource("t", glob, tok, seed=2), buffer_size=5, workers=2),
                               n=rows + 6, boundaries=[rows])


def _take_longest(loader, k):
    """The role's use: read the metadata, take one sample out of order (the longest), k times."""
    out = []
    for _ in range(k):
        meta = loader.metadata()
        i = int(meta.index[int(meta.tokens.argmax())])
        out.append((i, loader.take([i])[i]))
    return out


def source_loader_takes(corpus, request):
    """Out-of-order takes: the state holds samples taken after the oldest one still buffered."""
    rows = _rows(corpus)
    return ResumeCase(lambda: SourceLoader(_source(corpus), buffer_size=9), _take_longest,
                      lambda loader: loader.get_state(), lambda loader, s: loader.reset(s), n=rows + 4,
                      boundaries=[rows - 9, rows])


# -- Planner ------------------------------------------------------------------------------------

PLAN_STEPS = 8
SCHEDULE_STEPS = 4           # the Linear schedule's ramp ends here: a phase boundary


def _planner_strategy(g):
    mix = ol.Linear({"web": 0.7, "code": 0.2, "caps": 0.1}, {"web": 0.2, "code": 0.4, "caps": 0.4},
                    steps=SCHEDULE_STEPS)
    return (g.mix(mix).distribute("DP").cost(ol.attention_flops)
            .balance("karmarkar_karp", microbatches=2, max_tokens=4096, oversize="split").broadcast_at("TP").plan())


def _planner(seed=3):
    return ol.Planner(_planner_strategy, ol.ClientPlaceTree(dp=2, cp=1, tp=2), global_batch=12, seed=seed)


@pytest.fixture(scope="module")
def planned(corpus):
    """Real Source Loaders' metadata per step, their samples, and the plans, from one planned run."""
    loaders = [SourceLoader(s, buffer_size=16, image_token_id=corpus.image_token_id)
               for s in make_sources(corpus, seed=1, names=("web", "code", "caps"))]
    planner, steps = _planner(), []
    for _ in range(PLAN_STEPS):
        metas = [ld.metadata() for ld in loaders]
        plan = planner.plan(metas)
        samples = {}
        for ld in loaders:
            keys = [k for k in plan.sampled_keys() if k.source == ld.name]
            samples.update({ol.SampleKey(ld.name, i): rec for i, rec in ld.take([k.index for k in keys]).items()})
        steps.append((metas, plan, samples))
    for ld in loaders:
        ld.close()
    return steps


def planner(corpus, request):
    """Plans of the fixed real metadata of each step: a plan depends on the step, seed and carried mix state."""
    planned = request.getfixturevalue("planned")

    def read(p, k):
        return [p.plan(planned[p.step][0]).to_dict() for _ in range(k)]
    return ResumeCase(_planner, read, lambda p: p.state_dict(), lambda p, s: p.load_state_dict(s), n=PLAN_STEPS,
                      boundaries=[SCHEDULE_STEPS])


# -- the loader ---------------------------------------------------------------------------------

LOADER_BATCH = 24            # 12 samples of each of two 48-row sources a step: epoch 2 is taken from step 4
LOADER_STEPS = 5


def loader_strategy(g):
    """A VLM strategy (module level: the rpc runtime's workers unpickle it): mixed text over DP, every
    image embedded once over the whole world by the encoder module."""
    g = g.mix({"code": 0.5, "caps": 0.5})
    img = g.view("image").distribute("WORLD").cost(ol.encoder_cost).balance("greedy")
    return (g.view("text").distribute("DP").cost(ol.attention_flops)
            .balance("greedy", microbatches=2, max_tokens=2048, oversize="split").plan(encoder=img))


def loader_mesh():
    mesh = ol.ClientPlaceTree(pp=2, dp=2, cp=2, tp=2)
    mesh.attach("encoder", dp=mesh.world_size)
    return mesh


def loader_args(corpus):
    """OverlordLoader arguments shared by the local and the rpc case (the rpc one adds its runtime)."""
    return dict(sources=make_sources(corpus, names=("code", "caps")), strategy=loader_strategy, mesh=loader_mesh(),
                rank=None, global_batch=LOADER_BATCH, seq_len=None, buffer_size=12,
                image_token_id=corpus.image_token_id)


def loader_epoch_step(corpus):
    """The first step that takes samples of a second epoch (a half of the batch per 48-row source)."""
    rows = {_rows(corpus, "code"), _rows(corpus, "caps")}
    assert len(rows) == 1, f"the loader case assumes equally long sources, got {rows} rows"
    return rows.pop() // (LOADER_BATCH // 2)


def overlord_loader_local(corpus, request):
    return ResumeCase.for_stateful(lambda: ol.OverlordLoader(**loader_args(corpus)), n=LOADER_STEPS,
                                   boundaries=[loader_epoch_step(corpus)], n_random=1)


@pytest.mark.parametrize("back", [1, 2, LOADER_STEPS])
def test_rewinding_a_used_prefetching_vlm_loader(corpus, back):
    """Loading a state ``back`` steps before the consumed one into a loader whose prefetched steps
    (and the encoder's forwarded buckets) are in flight replays those steps (this once hung)."""
    with ol.OverlordLoader(**loader_args(corpus), prefetch=2) as loader:
        initial = loader.state_dict()
        first = [x for _, x in zip(range(back), loader)]
        loader.load_state_dict(initial)
        assert_identical([x for _, x in zip(range(back), loader)], first)


_RPC_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})              # before the fork server starts: workers unpickle loader_strategy
import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus
from torchdata_overlord.testing import ResumeCase, check_resume_contract
from test_resume_contract import LOADER_STEPS, loader_args, loader_epoch_step
corpus = build_demo_corpus({root!r}, scale="test", seed=0)
out = {{}}
with ol.OverlordLoader(**loader_args(corpus), runtime="rpc", n_workers=2) as loader:
    initial = loader.state_dict()
    case = ResumeCase.for_stateful(None, n=LOADER_STEPS, boundaries=[loader_epoch_step(corpus)], n_random=1)
    case.make = lambda: (case.load(loader, initial), loader)[1]   # one start: "fresh" is the loader rewound
    case.close = lambda obj: None
    out["points"] = check_resume_contract(case, seed=7)
    loader.load_state_dict(initial)
    out["stream"] = [x for _, x in zip(range(LOADER_STEPS), loader)]
    loader.load_state_dict(initial)
    out["head"] = [x for _, x in zip(range({mid}), loader)]
    out["state"] = loader.state_dict()
    # a second loader, with the default prefetch, joins the running group and resumes the state
    with ol.OverlordLoader(**loader_args(corpus), runtime="rpc", n_workers=2) as fresh:
        fresh.load_state_dict(out["state"])
        out["tail"] = [x for _, x in zip(range(LOADER_STEPS - {mid}), fresh)]
torch.save(out, {out!r})
"""


@pytest.mark.slow
def test_resume_contract_rpc_runtime(corpus, tmp_path):
    """runtime="rpc": the contract on one started loader (each "fresh" object is it, rewound), its stream equals the local
    runtime's, and a second rpc loader (default prefetch) resumes a midpoint state into the local tail."""
    mid = loader_epoch_step(corpus) - 1
    with ol.OverlordLoader(**loader_args(corpus)) as local:
        expected = [x for _, x in zip(range(LOADER_STEPS), local)]
    path = tmp_path / "rpc.pt"
    script = _RPC_SCRIPT.format(tests=str(TESTS), root=str(corpus.root), mid=mid, out=str(path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(path, weights_only=False)
    assert {0, mid, mid + 1} <= set(got["points"])
    assert_identical(got["stream"], expected)
    assert_identical(got["head"] + got["tail"], expected)


CASES = {
    "ParquetSource": parquet_source,
    "FileSource.jsonl": file_source("jsonl"),
    "FileSource.arrow": file_source("arrow"),
    "NodeSource": node_source,
    "SourceLoader.next over FileSource": source_loader_files,
    "SourceLoader.next": source_loader_stream,
    "SourceLoader.take": source_loader_takes,
    "Planner": planner,
    "OverlordLoader.local": overlord_loader_local,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_contract(name, corpus, request):
    case = CASES[name](corpus, request)
    points = check_resume_contract(case, seed=7)
    assert {0, *case.boundaries, *(b - 1 for b in case.boundaries)} <= set(points)


def test_the_data_constructor_has_no_state_so_nothing_to_resume(planned, corpus):
    """The Data Constructor keeps nothing between steps (a plan and its samples fully define a step's
    output): it exposes no state API, and a constructor that built earlier steps builds a step exactly
    as a fresh one does, so the contract's checkpoints need no constructor entry."""
    assert not any(hasattr(DataConstructor, a) for a in ("state_dict", "load_state_dict", "get_state", "reset"))
    image_token_id = corpus.image_token_id
    used = DataConstructor(seq_len=None, image_token_id=image_token_id)
    for _, plan, samples in planned[:-1]:
        for b in range(len(plan.buckets)):
            used.build(plan, b, samples)
    _, plan, samples = planned[-1]
    for b in range(len(plan.buckets)):
        assert_identical(used.build(plan, b, samples), DataConstructor(seq_len=None, image_token_id=image_token_id).build(plan, b, samples))


# -- the contract itself catches what it claims to ----------------------------------------------

class _Counter:
    """A resumable counter whose defect is chosen by the test."""

    def __init__(self, defect=None):
        self.i, self.defect = 0, defect

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return self.i

    def state_dict(self):
        if self.defect == "saving_advances":
            self.i += 1
        return {"i": self.i + (1 if self.defect == "off_by_one" else 0)}

    def load_state_dict(self, s):
        if self.defect == "keeps_the_loaded_dict":
            self.loaded, self.i = s, 0
            self.__class__ = _AliasingCounter
        elif self.defect != "ignores_load":
            self.i = s["i"]


class _AliasingCounter(_Counter):
    """Counts on from a loaded dict it kept a reference to instead of copying."""

    def __next__(self):
        self.i += 1
        return self.loaded["i"] + self.i

    def state_dict(self):
        return {"i": self.loaded["i"] + self.i}


@pytest.mark.parametrize("defect", ["off_by_one", "saving_advances", "ignores_load", "keeps_the_loaded_dict"])
def test_the_contract_fails_a_broken_resume(defect):
    check_resume_contract(ResumeCase.for_stateful(_Counter, n=5))           # the sound one passes
    with pytest.raises(AssertionError, match="midpoint|initial state"):
        check_resume_contract(ResumeCase.for_stateful(lambda: _Counter(defect), n=5))


def test_assert_identical_names_the_differing_path():
    a = {"x": [torch.tensor([1, 2]), {"y": 1.5}]}
    assert_identical(a, {"x": (torch.tensor([1, 2]), {"y": 1.5})})
    with pytest.raises(AssertionError, match=r"\$\['x'\]\[0\]"):
        assert_identical(a, {"x": [torch.tensor([1, 3]), {"y": 1.5}]})
    with pytest.raises(AssertionError, match=r"\$\['x'\]\[0\]: torch.int64\(2,\) vs torch.int32\(2,\)"):
        assert_identical(a, {"x": [torch.tensor([1, 2], dtype=torch.int32), {"y": 1.5}]})
    with pytest.raises(AssertionError, match=r"\$\['x'\]\[1\]\['y'\]: float 1.5 vs int 1"):
        assert_identical(a, {"x": [torch.tensor([1, 2]), {"y": 1}]})
    with pytest.raises(AssertionError, match="only right"):
        assert_identical(a, {"x": a["x"], "z": 0})
