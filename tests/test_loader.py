"""The roles on real files and the drop-in loader: exact resume, no loss, clean shutdown."""

import json
import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import torchdata_overlord as ol
from torchdata_overlord.roles.source_loader import SourceLoader
from torchdata_overlord.sim.corpus import build_demo_corpus
from torchdata_overlord.sources import ParquetSource
from torchdata_overlord.testing import assert_identical
from torchdata_overlord.transforms import ImageText, Tokenize

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_demo_corpus(tmp_path_factory.mktemp("corpus"), scale="test", seed=0)


def make_sources(corpus, seed=0, epochs=None, names=("web", "code", "long", "caps")):
    out = []
    for name in names:
        if name == "caps":
            t = ImageText(corpus.spm_model, image_field="image", text_field="text", patch=14, max_side=112)
        else:
            t = Tokenize(corpus.spm_model, field=corpus.text_fields[name])
        out.append(ParquetSource(name, corpus.sources[name], t, seed=seed, epochs=epochs))
    return out


def strategy_for(kind):
    weights = {"web": 0.4, "code": 0.25, "long": 0.15, "caps": 0.2}

    def dp(g):
        return (g.mix(weights).distribute("DP").cost(ol.attention_flops)
                .balance("karmarkar_karp", microbatches=2, max_tokens=2048, oversize="split").broadcast_at("TP").plan())

    def cp(g):
        return (g.mix(ol.Linear(weights, {"web": 0.25, "code": 0.25, "long": 0.25, "caps": 0.25}, steps=6))
                .distribute("CP").cost(ol.attention_flops)
                .balance("greedy", microbatches=2, max_tokens=1024, oversize="truncate").plan())

    def vlm(g):
        g = g.mix(weights)
        img = g.view("image").distribute("WORLD").cost(ol.encoder_cost).balance("greedy")
        return (g.view("text").distribute("DP").cost(ol.attention_flops)
                .balance("greedy", microbatches=2, max_tokens=2048, oversize="split").plan(encoder=img))

    return {"dp": dp, "cp": cp, "vlm": vlm}[kind]


def make_loader(corpus, kind, mesh_sizes, seed=0, rank=None, **kw):
    mesh = ol.ClientPlaceTree(**mesh_sizes)
    if kind == "vlm":
        mesh.attach("encoder", dp=mesh.world_size)
    return ol.OverlordLoader(make_sources(corpus, seed=seed), strategy_for(kind), mesh, rank=rank, global_batch=16,
                             seq_len=None, seed=seed, image_token_id=corpus.image_token_id, **kw)


def test_source_loader_node_stream_and_metadata(corpus):
    src = ParquetSource("caps", corpus.sources["caps"], ImageText(corpus.spm_model, max_side=112), seed=0, epochs=1)
    loader = SourceLoader(src, buffer_size=5, image_token_id=corpus.image_token_id)
    meta = loader.metadata()
    assert len(meta) == 5 and (meta.num_images == 1).all() and (meta.patches > 0).all()
    assert (meta.tokens > meta.patches).all()                 # placeholders + caption tokens
    seen = [i for i, _ in loader]                              # BaseNode iteration drains the source
    assert len(seen) == len(set(seen)) == src.num_rows


# -- the drop-in loader ------------------------------------------------------------------------

# the VLM strategy's resume is covered by the contract (test_resume_contract.py, OverlordLoader cases)
CASES = [("dp", dict(pp=2, dp=2, cp=2, tp=2), 3), ("cp", dict(dp=2, cp=2), 2)]


@pytest.mark.parametrize("kind,mesh,k", CASES)
def test_resume_is_bit_identical_for_every_rank(corpus, kind, mesh, k, tmp_path):
    total = k + 3
    with make_loader(corpus, kind, mesh) as ref:
        stream = [item for _, item in zip(range(total), ref)]
    with make_loader(corpus, kind, mesh) as first:
        head = [item for _, item in zip(range(k), first)]
        state = first.state_dict()
        assert first.state_dict() == state                    # side-effect free
    path = tmp_path / "loader.pt"
    torch.save(state, path)
    restored = torch.load(path, weights_only=True)             # plain types only
    with make_loader(corpus, kind, mesh) as second:
        second.load_state_dict(restored)
        tail = [item for _, item in zip(range(total - k), second)]
    for a, b in zip(head + tail, stream):
        assert_identical(a, b)


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_resume_random_mesh_strategy_and_midpoint(corpus, seed, tmp_path):
    rng = np.random.default_rng(seed)
    kind = str(rng.choice(["dp", "cp", "vlm"]))
    mesh = {a: int(rng.integers(1, 3)) for a in ("pp", "dp", "cp", "tp")}
    if kind == "cp":
        mesh["cp"] = 2
    k, total = int(rng.integers(0, 4)), 5
    with make_loader(corpus, kind, mesh, seed=seed) as ref:
        stream = [x for _, x in zip(range(total), ref)]
    with make_loader(corpus, kind, mesh, seed=seed) as first:
        head = [x for _, x in zip(range(k), first)]
        torch.save(first.state_dict(), tmp_path / "s.pt")
    with make_loader(corpus, kind, mesh, seed=seed) as second:
        second.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
        tail = [x for _, x in zip(range(total - k), second)]
    assert len(head + tail) == total
    for a, b in zip(head + tail, stream):
        assert_identical(a, b)


def test_resume_in_a_new_process(corpus, tmp_path):
    mesh = dict(pp=1, dp=2, cp=2, tp=1)
    with make_loader(corpus, "dp", mesh) as ref:
        stream = [item for _, item in zip(range(4), ref)]
    with make_loader(corpus, "dp", mesh) as first:
        next(iter(first))
        torch.save(first.state_dict(), tmp_path / "state.pt")
    script = f"""
import sys, torch
sys.path.insert(0, {str(ROOT / 'tests')!r})
from test_loader import make_loader
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({str(Path(corpus.root))!r}, scale="test", seed=0)
with make_loader(corpus, "dp", {mesh!r}) as loader:
    loader.load_state_dict(torch.load({str(tmp_path / 'state.pt')!r}, weights_only=True))
    torch.save([item for _, item in zip(range(3), loader)], {str(tmp_path / 'tail.pt')!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tail = torch.load(tmp_path / "tail.pt", weights_only=False)
    for a, b in zip(tail, stream[1:]):
        assert_identical(a, b)


def test_single_rank_loader_matches_the_simulation(corpus):
    mesh = dict(pp=2, dp=2, cp=2, tp=2)
    with make_loader(corpus, "dp", mesh) as sim:
        steps = [item for _, item in zip(range(2), sim)]
    for rank in (0, 3, 5, 14):
        with make_loader(corpus, "dp", mesh, rank=rank) as one:
            for s, item in zip(steps, one):
                assert_identical(item, s[rank])


def test_prefetch_zero_builds_each_step_in_next_and_resumes(corpus):
    """prefetch=0: no producer thread; the same stream, and the same state after each step."""
    mesh = dict(dp=2, cp=2)
    with make_loader(corpus, "dp", mesh, prefetch=3) as ref:
        expected = [item for _, item in zip(range(5), ref)]
    before = {t.name for t in threading.enumerate()}
    with make_loader(corpus, "dp", mesh, prefetch=0) as sync:
        it = iter(sync)
        got = [next(it) for _ in range(3)]
        assert "overlord-prefetch" not in {t.name for t in threading.enumerate()} - before   # no producer
        assert sync.stats()["planner"]["next_step"] == 3                  # nothing planned ahead of the trainer
        state = sync.state_dict()
    assert_identical(got, expected[:3])
    with make_loader(corpus, "dp", mesh, prefetch=0) as again:
        again.load_state_dict(state)
        assert_identical([item for _, item in zip(range(2), again)], expected[3:])
    with pytest.raises(ol.ConfigError, match="prefetch"):
        make_loader(corpus, "dp", mesh, prefetch=-1)


def test_no_sample_lost_or_repeated_within_an_epoch(corpus, caplog):
    mesh = ol.ClientPlaceTree(dp=2, cp=2, tp=2)
    sources = make_sources(corpus, epochs=1, names=("web", "code"))

    def strategy(g):
        return (g.mix({"web": 0.5, "code": 0.5}).distribute("DP").cost(ol.token_count)
                .balance("greedy", microbatches=2).broadcast_at("TP").plan())

    seen = Counter()
    with ol.OverlordLoader(sources, strategy, mesh, rank=None, global_batch=8, seq_len=None) as loader, \
            caplog.at_level(logging.WARNING, logger="torchdata_overlord"):
        for item in loader:
            for rank, out in item.items():
                c = mesh.coords(rank)
                if out["delivery"] == "data" and c["cp"] == 0:   # one client per bucket
                    for mb in out["microbatches"]:
                        seen.update(mb["sample_keys"])
        stats = loader.stats()
        assert loader.exhausted_reason and "finished" in loader.exhausted_reason
    # a mixture cut short by one source is said where the default log level shows it
    assert [r.levelno for r in caplog.records if "the stream ends" in r.getMessage()] == [logging.WARNING]
    assert seen and max(seen.values()) == 1                      # nothing repeated
    served = sum(s["served"] for s in stats["sources"].values())
    assert len(seen) == served                                   # nothing taken from a loader and lost


def test_stats_report_fetch_waits_sources_and_processes(corpus):
    with make_loader(corpus, "dp", dict(dp=2), prefetch=2) as loader:
        for _ in zip(range(4), loader):
            pass
        st = loader.stats()
    assert st["step"] == 4 and st["fetch_wait"]["steps"] == 4
    assert 0 <= st["fetch_wait"]["p50_ms"] <= st["fetch_wait"]["p99_ms"] <= st["fetch_wait"]["max_ms"]
    assert set(st["sources"]) == {"web", "code", "long", "caps"}
    assert all(s["served"] >= 0 and s["buffered"] >= 0 for s in st["sources"].values())
    pid = st["roles"]["planner"]
    assert pid in st["processes"] and st["processes"][pid]["rss_mib"] > 0


def test_a_consumed_step_is_freed_without_the_cyclic_garbage_collector(corpus):
    """No reference cycle holds a step's batch: with the collector off, every batch the trainer took is
    freed once it and the loader let go of it (a cycle kept every step's tensors, 200 a step in the e2e
    run, until the collector's next run, which then paid for them)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        with make_loader(corpus, "dp", dict(dp=2, cp=2), prefetch=2) as loader:
            it = iter(loader)
            refs = []
            for _ in range(6):
                item = next(it)
                refs += [weakref.ref(mb["input_ids"]) for out in item.values() for mb in out["microbatches"]]
                del item
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert refs and alive == 0, f"{alive} of {len(refs)} tensors alive"


def test_close_leaves_no_thread_and_is_idempotent(corpus):
    before = set(threading.enumerate())
    loader = make_loader(corpus, "dp", dict(dp=2), workers={"caps": 2})
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    loader.close()
    assert set(threading.enumerate()) <= before
    # closed: the steps prefetched before close() are not served, and nothing changes the consumed position
    for call in (lambda: next(it), lambda: iter(loader), lambda: loader.feedback({"web": 1.0}),
                 lambda: loader.load_state_dict(state)):
        with pytest.raises(ol.OverlordError, match=r"on a closed OverlordLoader"):
            call()
    assert loader.state_dict() == state and loader.stats()["closed"]


def test_exception_in_the_training_loop_still_cleans_up(corpus):
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="boom"):
        with make_loader(corpus, "dp", dict(dp=2), workers=2) as loader:
            for _ in loader:
                raise RuntimeError("boom")
    assert set(threading.enumerate()) <= before


def test_state_of_another_seed_is_refused_and_of_another_mesh_resumes_elastically(corpus):
    with make_loader(corpus, "dp", dict(dp=2), seed=0) as a:
        next(iter(a))
        state = a.state_dict()
    with make_loader(corpus, "dp", dict(dp=2), seed=1) as b:
        with pytest.raises(ol.ConfigError, match="seed"):
            b.load_state_dict(state)
    with make_loader(corpus, "dp", dict(dp=4), seed=0) as c:           # tests/test_elastic.py has the rest
        assert c.load_state_dict(state) == ["mesh: saved pp=1 dp=2 cp=1 tp=1, now pp=1 dp=4 cp=1 tp=1 (buckets, "
                                            "constructors and routes re-derived)"]
        assert next(iter(c))[0]["step"] == 1


def test_bad_input_is_reported_before_iteration(corpus, tmp_path):
    with pytest.raises(ol.ConfigError, match="nomatch"):
        ParquetSource("web", str(tmp_path / "nomatch*.parquet"), Tokenize(corpus.spm_model))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ol.ConfigError, match="bad.parquet"):
        ParquetSource("bad", str(bad), Tokenize(corpus.spm_model))
    with pytest.raises(ol.ConfigError, match="grpc"):
        make_loader(corpus, "dp", dict(dp=2), runtime="grpc")
    with pytest.raises(ol.ConfigError, match="rank"):
        make_loader(corpus, "dp", dict(dp=2), rank=7)


def test_undecodable_image_is_skipped_and_counted(corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from torchdata_overlord.testing import make_image_bytes

    images = [make_image_bytes(40, 30, seed=i) for i in range(6)]
    images[2] = b"\xff\xd8 definitely not a jpeg"
    path = tmp_path / "caps.parquet"
    pq.write_table(pa.table({"image": images, "text": [f"caption {i}" for i in range(6)]}), path)
    src = ParquetSource("caps", str(path), ImageText(corpus.spm_model, max_side=56), on_error="skip", epochs=1)
    loader = SourceLoader(src, buffer_size=10)
    assert len(loader.metadata()) == 5
    assert len(src.skipped) == 1 and src.skipped[0]["row"] == 2 and "caps.parquet" in src.skipped[0]["file"]
    strict = ParquetSource("caps", str(path), ImageText(corpus.spm_model, max_side=56), epochs=1, shuffle=False)
    with pytest.raises(Exception, match=r"caps\.parquet row 2"):
        SourceLoader(strict, buffer_size=10).metadata()


def test_torch_distributed_checkpoint_round_trip(corpus, tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    with make_loader(corpus, "vlm", dict(dp=2, tp=2)) as ref:
        stream = [x for _, x in zip(range(5), ref)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with make_loader(corpus, "vlm", dict(dp=2, tp=2)) as a:
            it = iter(a)
            for _ in range(3):
                next(it)
            saved = a.state_dict()
            dcp.save({"loader": a}, checkpoint_id=str(tmp_path / "ckpt"))
        with make_loader(corpus, "vlm", dict(dp=2, tp=2)) as b:
            dcp.load({"loader": b}, checkpoint_id=str(tmp_path / "ckpt"))   # calls b.state_dict() first
            assert b.state_dict() == saved                                   # applied at the next iter()
            tail = [x for _, x in zip(range(2), b)]
            assert b.state_dict()["step"] == saved["step"] + 2
    for x, y in zip(tail, stream[3:]):
        assert_identical(x, y)


def test_ctrl_c_stops_the_loader_and_its_threads(corpus, tmp_path):
    import signal

    # a shell's background job starts with SIGINT ignored, and a child would inherit that: restore
    # the handler a trainer in a terminal has
    script = f"""
import signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {str(ROOT / 'tests')!r})
from test_loader import make_loader
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({str(Path(corpus.root))!r}, scale="test", seed=0)
try:
    with make_loader(corpus, "dp", dict(dp=2), workers=2) as loader:
        for i, _ in enumerate(loader):
            if i == 0:
                import faulthandler
                faulthandler.dump_traceback_later(45, exit=True)    # a hang shows every thread's stack
                print("ready", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
print("threads", len([t for t in threading.enumerate() if t is not threading.main_thread()]), flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "interrupted" in out, err
    assert "threads 0" in out, out + err
    assert proc.returncode == 0


class StuckAfter:
    """A transform that, from its ``n``-th row on, blocks until ``release`` is set: user code that does not
    return (``entered`` is set when the first row blocks)."""

    def __init__(self, inner, n, release, entered=None):
        self.inner, self.n, self.release, self.entered = inner, n, release, entered
        self.calls, self.lock = 0, threading.Lock()

    def __call__(self, row):
        with self.lock:
            self.calls += 1
            stuck = self.calls >= self.n
        if stuck:
            if self.entered is not None:
                self.entered.set()
            self.release.wait(300)
        return self.inner(row)


def _warm_up(corpus) -> None:
    """One step of a plain loader: a process's first step imports what the transforms use (torchvision, sympy:
    1.5-2 s on a loaded machine), inside the roles' calls, which the 2 s timeouts below also bound."""
    with make_loader(corpus, "dp", dict(dp=2)) as loader:
        next(iter(loader))


def _stuck_loader(corpus, release: threading.Event) -> ol.OverlordLoader:
    """A local loader (timeout=2) whose ``web`` transform blocks on its 40th row until ``release`` is set."""
    sources = make_sources(corpus)
    sources[0] = ParquetSource("web", corpus.sources["web"],
                               StuckAfter(Tokenize(corpus.spm_model, field=corpus.text_fields["web"]), 40, release))
    return ol.OverlordLoader(sources, strategy_for("dp"), ol.ClientPlaceTree(dp=2), rank=None, global_batch=16,
                             seq_len=None, image_token_id=corpus.image_token_id, workers={"web": 2}, timeout=2)


@pytest.mark.slow
def test_a_transform_stuck_in_user_code_times_out_next_and_close_is_bounded(corpus, caplog):
    """next() raises after ``timeout``; close() then returns within its bound (a role stuck in a call is
    named and left as a daemon thread, as Python cannot stop it) instead of waiting for the transform;
    once the transform returns, the abandoned threads end: nothing is left behind."""
    _warm_up(corpus)
    before = set(threading.enumerate())
    release = threading.Event()
    loader = _stuck_loader(corpus, release)
    try:
        # the stuck Source Loader is named (it was "raise the timeout for very slow sources" only)
        with pytest.raises(TimeoutError, match=r"no step produced within 2 s .*waiting for loader:web in deliver\(\) "
                                               r"for \d+ s: its source's read or transform is slow or does not return"):
            for _ in loader:
                pass
        closing = threading.Thread(target=loader.close, daemon=True)   # (without the bound: waits ~300 s)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="torchdata_overlord"):
            closing.start()
            closing.join(30)
        assert not closing.is_alive(), "close() did not return within 30 s of a stuck transform"
        assert time.monotonic() - t0 < 20
        assert "actor 'loader:web' is still in deliver()" in caplog.text
    finally:
        release.set()                                   # the transform returns: the threads left end on their own
    for t in set(threading.enumerate()) - before:
        t.join(30)
    assert set(threading.enumerate()) <= before


def _timed(fn, limit: float = 30.0):
    """``(seconds, what fn returned or raised)`` of ``fn()`` run on a daemon thread, waited for ``limit`` s at
    most (then ``(limit, None)``: still running)."""
    out = []

    def run():
        try:
            out.append(fn())
        except Exception as e:              # noqa: BLE001 - returned to the test
            out.append(e)

    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    return time.monotonic() - t0, (out[0] if out else None)


@pytest.mark.slow
def test_the_local_roles_wait_for_a_stuck_transform_only_the_loaders_timeout(corpus):
    """runtime="local" gave the calls between roles the local runtime's own timeout, 300 s, whatever
    ``OverlordLoader(timeout=)`` said: after next() timed out on a transform stuck in user code, the Planner
    kept waiting for the stuck Source Loader, and ``stats()`` and a retried ``next()`` waited for the Planner
    (measured: both still waiting after 40 s; 300 s and more). The roles now wait as long as ``next()`` does:
    both answer within a few timeouts, the retry with an error that says what holds the Planner up."""
    _warm_up(corpus)
    before = set(threading.enumerate())
    release = threading.Event()
    loader = _stuck_loader(corpus, release)
    try:
        with pytest.raises(TimeoutError, match="no step produced within 2 s"):
            for _ in loader:
                pass
        took, stats = _timed(loader.stats)
        assert took < 15 and isinstance(stats, dict), (took, stats)
        took, err = _timed(lambda: next(loader))           # the step again: the loader is still stuck
        assert took < 15 and isinstance(err, Exception), (took, err)
        if isinstance(err, ol.OverlordError) and "Planner" in str(err):
            assert "waiting for a role stuck in user code" in str(err), err
        assert "start the job with more spares" not in str(err), err     # no spares in one process
        took, _ = _timed(loader.close)
        assert took < 20, took
    finally:
        release.set()                                   # the transform returns: the threads left end on their own
        loader.close()
    for t in set(threading.enumerate()) - before:
        t.join(30)
    assert set(threading.enumerate()) <= before


@pytest.mark.slow
def test_ctrl_c_exits_promptly_while_a_transform_is_stuck(corpus):
    """A Ctrl-C while a transform is stuck in user code: KeyboardInterrupt reaches the trainer and the
    process exits within seconds (the stuck threads, the transform pool's too, are daemons that no exit
    joins), instead of waiting for the transform."""
    import signal

    script = f"""
import signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {str(ROOT / 'tests')!r})
from test_loader import ParquetSource, StuckAfter, Tokenize, make_sources, ol, strategy_for
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({str(Path(corpus.root))!r}, scale="test", seed=0)
entered = threading.Event()
sources = make_sources(corpus)
sources[0] = ParquetSource("web", corpus.sources["web"],
                           StuckAfter(Tokenize(corpus.spm_model, field=corpus.text_fields["web"]), 40, threading.Event(),
                                      entered))
threading.Thread(target=lambda: entered.wait() and print("stuck", flush=True), daemon=True).start()
try:
    with ol.OverlordLoader(sources, strategy_for("dp"), ol.ClientPlaceTree(dp=2), rank=None, global_batch=16,
                           seq_len=None, image_token_id=corpus.image_token_id, workers={{"web": 2}}) as loader:
        for _ in loader:
            pass
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "stuck", proc.stderr.read() if proc.poll() is not None else ""
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert "interrupted" in out, err
    assert proc.returncode == 0 and took < 20, (took, err)
    assert "actor 'loader:web' is still in deliver()" in err


def test_dynamic_schedule_feedback_through_the_loader_is_deterministic_and_resumable(corpus, tmp_path):
    mesh = ol.ClientPlaceTree(dp=2)

    def make(prefetch=2):
        schedule = ol.Dynamic({"web": 0.5, "code": 0.3, "long": 0.2}, lr=2.0)

        def strategy(g):
            return g.mix(schedule).distribute("DP").cost(ol.token_count).balance("greedy", microbatches=2).plan()
        return ol.OverlordLoader(make_sources(corpus, names=("web", "code", "long")), strategy, mesh, rank=None,
                                 global_batch=12, seq_len=None, prefetch=prefetch)

    def loss(step):                       # a deterministic stand-in for per-source training loss
        return {"web": 1.0 + (step % 3), "code": 2.0, "long": 0.5 * (step % 2)}

    def run(loader, steps, start=0):
        out = []
        for i, item in zip(range(steps), loader):
            out.append(item)
            loader.feedback(loss(start + i))
        return out

    with make() as ref:
        stream = run(ref, 7)
        weights = ref.last_plan.stats["mixture"]["weights"]      # step 6, planned after feedback from steps 0-4
    with make() as first:
        head = run(first, 3)
        torch.save(first.state_dict(), tmp_path / "s.pt")
    with make() as second:
        second.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
        tail = run(second, 4, start=3)
    for a, b in zip(head + tail, stream):
        assert_identical(a, b)
    assert abs(weights["long"] - 0.2) > 0.05                 # the feedback moved the mixture away from the start
    with pytest.warns(UserWarning, match=r"prefetch: saved 2, now 3: feedback\(\) given from here weighs the plan 3"):
        with make(prefetch=3) as other:
            other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    with make() as bad:                 # refused at the call, before it reaches a plan or a checkpoint
        it = iter(bad)
        next(it)
        for values, pattern in (({"web": 1.0, "wbe": 2.0}, r"unknown sources \['wbe'\]"),
                                ({"web": float("nan")}, r"value for 'web' is nan; it must be finite"),
                                ({"web": "low"}, r"value for 'web' is 'low', not a number"),
                                ([("web", 1.0)], r"takes a \{source: value\} dict, got list")):
            with pytest.raises(ol.ConfigError, match=pattern):
                bad.feedback(values)
        assert json.loads(bad.state_dict()["job"])["feedback"] == []
        for _ in range(3):
            next(it)
    with make() as plain:                                      # without feedback the stream differs
        other = [x for _, x in zip(range(7), plain)]
    keys = lambda items: [[mb["sample_keys"] for mb in x[0]["microbatches"]] for x in items]  # noqa: E731
    assert keys(other) != keys(stream)
    with ol.OverlordLoader(make_sources(corpus, names=("web",)), lambda g: g.mix({"web": 1.0}).distribute("DP").plan(),
                           mesh, rank=None, global_batch=4, seq_len=None) as static:
        with pytest.raises(ol.ConfigError, match="no schedule"):
            static.feedback({"web": 1.0})


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_state_loaded_inside_a_running_loop_applies_from_the_next_item(corpus, prefetch):
    """A rollback inside ``for batch in loader`` (load_state_dict of an earlier state): the loop's next item
    is the loaded step's, the stream from there is the uninterrupted one, and state_dict() describes what the
    loop consumed. (The loop used to go on with the old stream while state_dict() said the loaded step, so a
    checkpoint taken then repeated steps on resume.)"""
    mesh = ol.ClientPlaceTree(dp=2)

    def make():
        return ol.OverlordLoader(make_sources(corpus, names=("web", "code")),
                                 lambda g: g.mix({"web": 0.6, "code": 0.4}).distribute("DP").plan(),
                                 mesh, rank=0, global_batch=8, seq_len=None, prefetch=prefetch)

    with make() as ref:
        stream = [x for _, x in zip(range(8), ref)]
    got = []
    with make() as loader:
        for i, item in enumerate(loader):
            got.append(item)
            if i == 2:
                saved = loader.state_dict()
            if i == 5:
                loader.load_state_dict(saved)
            if len(got) == 9:
                end = loader.state_dict()
                break
    assert [x["step"] for x in got] == [0, 1, 2, 3, 4, 5, 3, 4, 5]
    for a, b in zip(got[6:], stream[3:6]):
        assert_identical(a, b)
    assert end["step"] == 6
    with make() as again:
        again.load_state_dict(end)
        assert_identical(next(iter(again)), stream[6])


def test_threads_sharing_a_fresh_loader_get_every_step_once(corpus):
    """Two threads calling next() on a loader nobody started: one of them starts the stream, and together they
    get every step once (both used to start it, and one failed with a JobReset that said nothing useful)."""
    import copy
    import pickle
    for _ in range(3):
        with ol.OverlordLoader(make_sources(corpus, names=("web", "code")), lambda g: g.mix({"web": 1, "code": 1})
                               .distribute("DP").plan(), ol.ClientPlaceTree(dp=2), rank=0, global_batch=4,
                               seq_len=None) as loader:
            got, errors, go = [[], []], [], threading.Barrier(2)

            def take(i):
                try:
                    go.wait(timeout=60)
                    for _ in range(20):
                        got[i].append(next(loader)["step"])
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)
            threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert errors == [] and sorted(got[0] + got[1]) == list(range(40))
            for copier in (copy.copy, copy.deepcopy, pickle.dumps):
                with pytest.raises(TypeError, match=r"cannot be pickled or copied.*loader.state_dict\(\)"):
                    copier(loader)


def test_feedback_given_right_after_load_state_dict_counts_after_the_loaded_step(corpus):
    """Feedback given between load_state_dict() and the first next() weighs the plan ``prefetch`` steps after
    the loaded step, as if given just before the state was saved (it used to be dropped when the state
    applied)."""
    mesh = ol.ClientPlaceTree(dp=2)

    def make():
        schedule = ol.Dynamic({"web": 0.5, "code": 0.3, "long": 0.2}, lr=2.0)

        def strategy(g):
            return g.mix(schedule).distribute("DP").cost(ol.token_count).balance("greedy", microbatches=2).plan()
        return ol.OverlordLoader(make_sources(corpus, names=("web", "code", "long")), strategy, mesh, rank=None,
                                 global_batch=12, seq_len=None, prefetch=1)

    def loss(step):
        return {"web": 3.0 * (step % 2), "code": 0.0, "long": 2.0 * (step % 3)}

    with make() as ref:
        stream = []
        for i, item in zip(range(6), ref):
            stream.append(item)
            ref.feedback(loss(i))
    with make() as first:
        for i, item in zip(range(3), first):
            if i < 2:
                first.feedback(loss(i))
        saved = first.state_dict()                  # before the feedback of step 2
    with make() as second:
        second.load_state_dict(saved)
        second.feedback(loss(2))
        for i, item in zip(range(3, 6), second):
            assert_identical(item, stream[i])
            second.feedback(loss(i))


@pytest.mark.slow
def test_a_failed_step_is_raised_never_read_as_the_end_of_the_stream(corpus):
    """The producer's last item is its failed step (or an end marker), so ``next()`` raises the
    step's error whatever the thread switch timing; it never infers the end from the thread having
    exited. A wide switch interval lets the producer queue its failure and exit while ``next()``
    is between two polls of the queue: the window in which the error used to become a bare
    ``StopIteration``."""
    script = f"""
import json, sys, time, random
sys.path.insert(0, {str(ROOT / 'tests')!r})
from test_loader import make_sources
import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus
corpus = build_demo_corpus({str(Path(corpus.root))!r}, scale="test", seed=0)
sys.setswitchinterval(0.5)                  # the planning thread keeps the GIL while it fails and exits
rng = random.Random(0)

def failing(g):                             # CPU-bound planning that ends in an error
    end = time.perf_counter() + rng.uniform(0.05, 0.3)
    while time.perf_counter() < end:
        pass
    raise RuntimeError("strategy failed")

outcomes = []
with ol.OverlordLoader(make_sources(corpus, names=("web",)), failing, ol.ClientPlaceTree(dp=1), rank=0,
                       global_batch=2, seq_len=None, prefetch=1) as loader:
    for _ in range(16):                     # each iter() restarts at step 0, whose plan fails again
        try:
            next(iter(loader))
            outcomes.append("item")
        except StopIteration:
            outcomes.append("StopIteration")
        except RuntimeError as e:             # the message, then where it was raised
            outcomes.append(str(e).split(" [raised by")[0])
print(json.dumps(outcomes))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    outcomes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcomes == ["strategy failed"] * 16, outcomes


def test_a_new_for_loop_continues_after_the_last_consumed_step(corpus):
    """iter() again (a new ``for`` after a ``break``) continues the stream: steps prefetched but not
    consumed are built again, so nothing is skipped or repeated."""
    with make_loader(corpus, "dp", dict(dp=2)) as ref:
        stream = [x for _, x in zip(range(4), ref)]
    got = []
    with make_loader(corpus, "dp", dict(dp=2), prefetch=2) as loader:
        for _ in range(2):
            for item in loader:
                got.append(item)
                if len(got) % 2 == 0:
                    break
    assert [x[0]["step"] for x in got] == [0, 1, 2, 3]
    for a, b in zip(got, stream):
        assert_identical(a, b)


def test_a_finite_stream_ends_with_its_first_finished_source_and_stays_ended(corpus):
    """epochs=1: the stream ends at the first step a finished source cannot fill its share of (the
    mixture is never bent to use up the others); next() then keeps raising StopIteration, iter()
    says why nothing comes, and a loaded state reads the stream again."""
    import pyarrow.parquet as pq

    rows = {n: sum(pq.ParquetFile(f).metadata.num_rows for f in sorted(Path(corpus.sources[n]).parent.glob("*.parquet")))
            for n in ("web", "code")}
    mesh = ol.ClientPlaceTree(dp=1)

    def strategy(g):
        return g.mix({"web": 0.5, "code": 0.5}).distribute("DP").cost(ol.token_count).balance("greedy").plan()

    def make():
        return ol.OverlordLoader(make_sources(corpus, epochs=1, names=("web", "code")), strategy, mesh, rank=0,
                                 global_batch=8, seq_len=None)

    with make() as loader:
        with pytest.raises(TypeError, match="islice"):
            len(loader)
        assert loader                                           # truthy without a length
        items, states = [], []
        for item in loader:
            items.append(item)
            states.append(loader.state_dict())
        taken = Counter(k.split(":")[0] for item in items for mb in item["microbatches"] for k in mb["sample_keys"])
        first = min(rows, key=lambda n: rows[n] - taken[n])
        assert rows[first] - taken[first] < 4                  # it could not give its 4 samples of one more step
        other = next(n for n in rows if n != first)
        assert rows[other] - taken[other] >= 4                 # the other had enough left: not used up
        assert first in loader.exhausted_reason
        with pytest.raises(StopIteration):
            next(loader)
        with pytest.raises(ol.OverlordError, match=f"ended after step {len(items) - 1}.*epochs"):
            for _ in loader:
                pass
        loader.load_state_dict(states[0])
        again = list(loader)
    for a, b in zip(again, items[1:]):
        assert_identical(a, b)
    assert len(again) == len(items) - 1


def test_feedback_to_a_strategy_without_a_dynamic_schedule_is_refused_at_the_call(corpus):
    """Only a schedule with ``update`` (ol.Dynamic) takes feedback: given to another strategy, feedback() raises at
    the call (the strategy's probe before the start tells), not prefetch steps later in next() when the Planner
    plans the step it weighs."""
    mesh = ol.ClientPlaceTree(dp=1)
    names = ("web", "code")

    def constant(g):
        return g.mix({"web": 0.5, "code": 0.5}).distribute("DP").plan()

    dynamic = ol.Dynamic({"web": 0.5, "code": 0.5}, lr=1.0)

    def moving(g):
        return g.mix(dynamic).distribute("DP").plan()

    with ol.OverlordLoader(make_sources(corpus, names=names), constant, mesh, rank=0, global_batch=4,
                           seq_len=None) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(ol.ConfigError, match=r"feedback\(\) given, but no schedule of this strategy takes"):
            loader.feedback({"web": 1.0, "code": 2.0})
        for _ in range(4):
            next(it)                                  # the stream goes on: nothing was recorded
    with ol.OverlordLoader(make_sources(corpus, names=names), moving, mesh, rank=0, global_batch=4,
                           seq_len=None) as loader:
        it = iter(loader)
        next(it)
        loader.feedback({"web": 1.0, "code": 2.0})
        for _ in range(4):
            next(it)
