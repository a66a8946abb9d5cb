"""End-to-end throughput: the embedded ``OverlordLoader`` against a plain ``torch.utils.data.DataLoader``
and a ``torchdata.nodes`` pipeline mixing with ``MultiNodeWeightedSampler``.

Target (issue): on the demo corpus, the loader's added overhead (planning, packing, CP splitting,
bookkeeping) is at most 5% of the transform time it runs. All sides do the same work: they read
the four sources' Parquet files with ``ParquetSource`` (pyarrow) and apply the same sample
transforms (``Tokenize`` for web/code/long, ``ImageText`` for caps) with the same constant mixture,
and all are measured over the same number of samples (``steps x global_batch``) after a warm-up.

* baseline: an ``IterableDataset`` that, in each worker process, opens every source (the files
  sharded over the workers) and mixes them by smooth weighted round-robin with the same weights;
  ``DataLoader(num_workers=W, batch_size=global_batch // W, collate_fn=list)``. Two orders of the
  same picks: interleaved sample by sample (what a weighted sampler does) and grouped by source
  within each batch (the order a Source Loader transforms in: switching tokenizer and decoder at
  every sample costs transform time, so the two orders bracket the baseline).
* torchdata.nodes baseline (``torchdata_nodes``): per source an ``IterableWrapper`` over the
  ``ParquetSource``'s untransformed rows (every file, as the library reads them), mixed by
  ``MultiNodeWeightedSampler`` with the same weights (``torch.multinomial`` picks: the same mixture
  in expectation, not the same samples), then ``ParallelMapper(transform, num_workers=W,
  method="process", multiprocessing_context="fork", prebatch=global_batch // W)`` ->
  ``Batcher(global_batch)`` -> ``Loader``. Process mode works: W forked worker processes run the transforms, the main process
  reads and mixes in the mapper's reader thread and unpickles the results (W+1 processes, as for the
  DataLoader). ``prebatch`` sends a worker ``global_batch // W`` rows per task, the DataLoader's
  per-worker batch; ``--nodes-prebatch 0`` gives one row per task, the mapper's default, which paid
  for the per-row IPC with about half the samples/s here. Its threads and processes are stopped in a
  ``finally`` (reader and sort threads first, then the workers, terminated if they do not exit).
* this library: ``OverlordLoader(rank=None, workers=W, runtime="local")`` on a ``dp=4, cp=2`` mesh
  with a Karmarkar-Karp attention-FLOPs balance, every rank's output consumed. ``workers=W`` gives
  each Source Loader its own W-thread pool; the embedded runtime fills the sources one after
  another, so at most W transforms run at once, as with W DataLoader worker processes. They are
  threads in one process, not processes: transforms that hold the GIL do not run in parallel
  there (the ``thread_scaling`` probe measures this per source).
* serial runs of the DataLoader and the library (``num_workers=0`` / ``workers=0``) compare the two
  on one thread, free of the thread-vs-process difference.
* overhead: a serial pass of the library (``workers=0``, everything in the prefetch thread, the
  same seed, so the same samples) with the transforms, the Parquet reads and the roles' methods
  wrapped in timers. Over the measured steps, overhead = wall time - time inside the transforms -
  time inside ``ParquetSource.next_raw`` (the reading both sides do), and the overhead fraction is
  that over the transform time (the baseline's serial run reports the same figure for the
  DataLoader). A library thread running beside the transforms in this pass would lower the fraction
  without lowering the cost (the transforms then wait for the GIL, which counts as transform time):
  read it with the serial samples/s ratio. Each run is repeated (``--repeats``) and the median
  reported. When the target is missed, a cProfile of the library's own per-step work (buffers
  filled beforehand, so no reads or transforms in it) prints its top 10, saved in the JSON.

Prints a table and writes ``benchmarks/results/e2e_throughput.json``; exits non-zero only when a
run failed, never because a figure disappointed.

    python benchmarks/e2e_throughput.py                 # demo scale, 2 workers
    python benchmarks/e2e_throughput.py --quick --out /tmp/e2e.json   # CI smoke (scale "test")
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")          # one intra-op thread, as in DataLoader workers
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torchvision.io  # noqa: E402,F401  (ImageText imports it on first use: pay it here, not in a run)
from torch.utils.data import DataLoader, IterableDataset, get_worker_info  # noqa: E402

from common import write_results  # noqa: E402
import torchdata_overlord as ol  # noqa: E402
from torchdata_overlord.runtime.local import LocalJob  # noqa: E402
from torchdata_overlord.runtime.refs import PLANNER, LoaderRef, constructor_actor, loader_actor  # noqa: E402
from torchdata_overlord.sim.corpus import SOURCES, build_demo_corpus, default_corpus_root  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WEIGHTS = {"web": 0.50, "code": 0.15, "long": 0.10, "caps": 0.25}    # the demo's starting mixture, held constant
MESH = {"dp": 4, "cp": 2}
MICROBATCHES, MAX_TOKENS = 4, 16384
TARGET = {"overhead_fraction": 0.05}


def make_strategy(method: str):
    def strategy(g: ol.DGraph) -> ol.Plan:
        return (g.mix(WEIGHTS).distribute("DP").cost(ol.attention_flops)
                .balance(method, microbatches=MICROBATCHES, max_tokens=MAX_TOKENS, oversize="split").plan())
    return strategy


def backbone_tokens(rec: dict) -> int:
    """Tokens a sample occupies in a packed row: its text ids plus one placeholder per image patch."""
    return int(rec["tokens"]) + sum(int(p) for p in rec.get("image_patches", ()))


# ------------------------------------------------------------------------------------------------
# instrumentation
# ------------------------------------------------------------------------------------------------

class Recorder:
    """Collects ``(name, start, end)`` of wrapped calls (``list.append`` is atomic under the GIL)."""

    def __init__(self):
        self.events: list[tuple[str, float, float]] = []

    def wrap(self, name: str, fn):
        events, clock = self.events, time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                events.append((name, t0, clock()))
        return timed

    def starts(self, name: str) -> list[float]:
        return sorted(t0 for n, t0, _ in self.events if n == name)

    def total(self, name: str, t_lo: float, t_hi: float) -> float:
        return sum(t1 - t0 for n, t0, t1 in self.events if n == name and t_lo <= t0 < t_hi)

    def count(self, name: str, t_lo: float, t_hi: float) -> int:
        return sum(1 for n, t0, _ in self.events if n == name and t_lo <= t0 < t_hi)


class TimedTransform:
    """A transform proxy that records the time spent inside the wrapped transform."""

    def __init__(self, inner, recorder: Recorder):
        self.inner, self.columns = inner, getattr(inner, "columns", None)
        self._call = recorder.wrap("transform", inner)

    def __call__(self, row):
        return self._call(row)


# ------------------------------------------------------------------------------------------------
# baseline: a plain DataLoader doing the same reading and transforms
# ------------------------------------------------------------------------------------------------

class _Acc:
    """Seconds spent inside wrapped calls, by kind (one per worker process)."""

    def __init__(self):
        self.s = {"transform": 0.0, "read": 0.0}

    def wrap(self, kind: str, fn):
        s, clock = self.s, time.perf_counter

        def timed(*args):
            t0 = clock()
            try:
                return fn(*args)
            finally:
                s[kind] += clock() - t0
        return timed


class _AccTransform:
    def __init__(self, inner, acc: _Acc):
        self.columns, self._call = getattr(inner, "columns", None), acc.wrap("transform", inner)

    def __call__(self, row):
        return self._call(row)


def wrr(weights: dict, n: int, credit: dict) -> list[str]:
    """The next ``n`` picks of smooth weighted round-robin (``credit`` carries over between calls)."""
    names, total, out = list(weights), sum(weights.values()), []
    for _ in range(n):
        for k in names:
            credit[k] += weights[k]
        pick = max(names, key=credit.__getitem__)
        credit[pick] -= total
        out.append(pick)
    return out


class MixedParquetDataset(IterableDataset):
    """Every worker opens all sources (files sharded over the workers) and mixes them by smooth
    weighted round-robin, yielding ``(sample, transform seconds, read seconds)`` forever.

    ``group``: per block of ``group`` picks, yield each source's samples together (the same picks
    and mixture, reordered), as a Source Loader transforms a source's share of a step in one go;
    1 interleaves the sources sample by sample.
    """

    def __init__(self, corpus, weights: dict, seed: int, group: int = 1):
        self.corpus, self.weights, self.seed, self.group = corpus, dict(weights), seed, max(1, int(group))

    def __iter__(self):
        info = get_worker_info()
        w, nw = (0, 1) if info is None else (info.id, info.num_workers)
        acc, sources = _Acc(), {}
        for name in self.weights:
            files = self.corpus.files(name)
            if len(files) >= nw:      # a disjoint share of the files per worker
                mine, seed = files[w::nw], self.seed
            else:                     # fewer files than workers: every worker reads all, in its own order
                mine, seed = files, self.seed + w
            src = ol.ParquetSource(name, mine, _AccTransform(self.corpus.transform(name), acc), seed=seed)
            src.next_raw = acc.wrap("read", src.next_raw)
            sources[name] = src
        order = list(self.weights)
        credit = dict.fromkeys(order, 0.0)
        last = dict(acc.s)
        while True:
            picks = wrr(self.weights, self.group, credit)
            if self.group > 1:
                picks.sort(key=order.index)
            for pick in picks:
                _, rec = next(sources[pick])
                now = dict(acc.s)
                yield rec, now["transform"] - last["transform"], now["read"] - last["read"]
                last = now


def as_list(batch):
    return batch


def timed_pass(it, global_batch: int, warmup: int, steps: int, t_start: float, on_item=None) -> dict:
    """Draw ``warmup`` global batches from ``it``, then time ``steps`` more; each item ends with
    ``(record, transform seconds, read seconds)`` (``on_item`` sees every measured item). The
    measured steps' figures, and ``startup_s``: from ``t_start`` to the first batch."""
    n = tokens = 0
    t_transform = t_read = 0.0
    first = None
    while n < warmup * global_batch:
        n += len(next(it))
        first = first or time.perf_counter() - t_start
    n0, t0 = n, time.perf_counter()
    while n - n0 < steps * global_batch:
        batch = next(it)
        n += len(batch)
        for item in batch:
            rec, tt, tr = item[-3:]
            tokens += backbone_tokens(rec)
            t_transform += tt
            t_read += tr
            if on_item is not None:
                on_item(item)
    elapsed = time.perf_counter() - t0
    samples = n - n0
    return {"samples": samples, "tokens": tokens, "seconds": elapsed, "samples_per_s": samples / elapsed,
            "tokens_per_s": tokens / elapsed, "startup_s": first, "transform_s": t_transform, "read_s": t_read,
            "transform_ms_per_sample": 1e3 * t_transform / samples}


def run_baseline(corpus, workers: int, global_batch: int, warmup: int, steps: int, seed: int, grouped: bool) -> dict:
    per_batch = max(1, global_batch // max(workers, 1))
    ds = MixedParquetDataset(corpus, WEIGHTS, seed, group=per_batch if grouped else 1)
    dl = DataLoader(ds, batch_size=per_batch, num_workers=workers, collate_fn=as_list,
                    prefetch_factor=2 if workers else None)
    t_start = time.perf_counter()
    it = iter(dl)
    try:
        figures = timed_pass(it, global_batch, warmup, steps, t_start)
    finally:
        del it                         # shuts the worker processes down
    out = {"side": "DataLoader", "workers": workers, "worker_kind": "processes" if workers else "main process",
           "order": f"grouped by source in blocks of {per_batch}" if grouped else "interleaved sample by sample",
           "batch_size": per_batch, **figures}
    if not workers:                    # one thread: the rest of the wall time is the DataLoader's own
        out["other_s"] = out["seconds"] - out["transform_s"] - out["read_s"]
        out["other_fraction"] = out["other_s"] / out["transform_s"]
    return out


# ------------------------------------------------------------------------------------------------
# baseline: a torchdata.nodes pipeline mixing the sources with MultiNodeWeightedSampler
# ------------------------------------------------------------------------------------------------

class _RawRows:
    """One source's rows before the transform, forever: ``(source name, row, read seconds)``. Read in the
    ``ParallelMapper``'s reader thread; the read time travels with the row."""

    def __init__(self, src):
        self.src = src

    def __iter__(self):
        src, name, clock = self.src, self.src.name, time.perf_counter
        while True:
            t0 = clock()
            _, row, _ = src.next_raw()
            yield name, row, clock() - t0


class _TransformByName:
    """The ``ParallelMapper``'s ``map_fn``, run in its worker processes: the source's transform on the
    row, returning ``(source name, record, transform seconds, read seconds)``."""

    def __init__(self, transforms: dict):
        self.transforms = transforms

    def __call__(self, item):
        name, row, t_read = item
        t0 = time.perf_counter()
        rec = self.transforms[name](row)
        return name, rec, time.perf_counter() - t0, t_read


def _stop_nodes(mapper, started: set) -> None:
    """Stop a ``ParallelMapper``'s reader and sort threads, then its worker processes. The threads go
    first: a worker that exits while the sort thread is still unpickling one of its tensors (shared by
    file descriptor, fetched from that worker) makes the sort thread raise. Then the mapper's own
    shutdown, and any worker process still alive (one blocked flushing its results into a full pipe
    would hang at exit) is terminated; rows left in the input queue are drained, so this process's
    feeder thread ends, and the queues closed."""
    from torchdata.nodes.map import _ParallelMapperImpl

    impl = getattr(mapper, "_it", None)
    if not isinstance(impl, _ParallelMapperImpl):          # prebatch: Unbatcher(_ParallelMapperImpl)
        impl = getattr(impl, "source", None)
    it = getattr(impl, "_it", None)                         # the _ParallelMapperIter of the last reset()
    if hasattr(it, "_stop"):
        it._stop.set()
        for th in (getattr(it, "_read_thread", None), getattr(it, "_sort_thread", None)):
            if th is not None and th.is_alive():
                th.join(timeout=10.0)
    if hasattr(it, "_shutdown"):
        it._shutdown()                                      # sets the workers' stop event, joins briefly
    procs = [p for p in torch.multiprocessing.active_children() if p.pid not in started]
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join()
    if hasattr(it, "_workers"):
        # stopped: empty the list, or this iterator's __del__ (run by the garbage collector, possibly in a
        # process forked later, where is_alive() on another process's child raises) would inspect them again
        it._workers = []
    for q in (getattr(it, "_in_q", None), getattr(it, "_intermed_q", None)):
        if not hasattr(q, "cancel_join_thread"):
            continue
        if q is it._in_q:              # rows no worker took: drain them so this process's feeder thread can finish
            try:
                while True:
                    q.get(timeout=0.05)
            except Exception:  # noqa: BLE001 (queue.Empty, or a pipe already closed)
                pass
        q.close()
        feeder = getattr(q, "_thread", None)
        if feeder is not None:
            feeder.join(timeout=5.0)
        q.cancel_join_thread()


def run_nodes(corpus, workers: int, global_batch: int, warmup: int, steps: int, seed: int,
              prebatch: int | None) -> dict:
    """``IterableWrapper`` per source over ``ParquetSource.next_raw`` (every file, as the library reads)
    -> ``MultiNodeWeightedSampler(WEIGHTS)`` -> ``ParallelMapper(transform, num_workers=W,
    method="process", fork, prebatch)`` -> ``Batcher(global_batch)`` -> ``Loader``. ``prebatch``: rows
    per task sent to a worker process (None: one row per task, the mapper's default)."""
    import torchdata.nodes as tn

    started = {p.pid for p in torch.multiprocessing.active_children()}
    transforms = {name: corpus.transform(name) for name in WEIGHTS}
    sources, mapper = {}, None
    picks = dict.fromkeys(WEIGHTS, 0)
    try:
        for name in WEIGHTS:
            sources[name] = ol.ParquetSource(name, corpus.sources[name], None, columns=transforms[name].columns,
                                             seed=seed)
        per_source = {name: tn.IterableWrapper(_RawRows(src)) for name, src in sources.items()}
        mixed = tn.MultiNodeWeightedSampler(per_source, dict(WEIGHTS), stop_criteria=tn.StopCriteria.CYCLE_FOREVER,
                                            rank=0, world_size=1, seed=seed)
        mapper = tn.ParallelMapper(mixed, _TransformByName(transforms), num_workers=workers, in_order=True,
                                   method="process", multiprocessing_context="fork", prebatch=prebatch)
        loader = tn.Loader(tn.Batcher(mapper, batch_size=global_batch, drop_last=True))
        t_start = time.perf_counter()
        it = iter(loader)              # starts the reader thread, the W worker processes and the sort thread

        def count(item):
            picks[item[0]] += 1

        figures = timed_pass(it, global_batch, warmup, steps, t_start, count)
    finally:
        _stop_nodes(mapper, started)
        for src in sources.values():
            src.close()
    return {"side": "torchdata.nodes", "workers": workers,
            "worker_kind": f"processes (ParallelMapper method='process', fork): {workers} transform processes; "
                           f"the main process reads and mixes in the mapper's reader thread",
            "pipeline": "IterableWrapper(ParquetSource rows) per source -> MultiNodeWeightedSampler -> "
                        f"ParallelMapper(transform, method='process', prebatch={prebatch}) -> "
                        f"Batcher({global_batch}) -> Loader", "prebatch": prebatch,
            "order": "interleaved sample by sample (torch.multinomial picks)", "batch_size": global_batch,
            **figures, "mixture": {k: v / figures["samples"] for k, v in picks.items()}}


# ------------------------------------------------------------------------------------------------
# this library
# ------------------------------------------------------------------------------------------------

def make_sources(corpus, seed: int, recorder: Recorder | None):
    out = []
    for name in SOURCES:
        t = corpus.transform(name)
        out.append(ol.ParquetSource(name, corpus.sources[name], t if recorder is None else TimedTransform(t, recorder),
                                    seed=seed))
    return out


def role_objects(job: LocalJob) -> tuple:
    """(Planner actor, SourceLoaders, DataConstructors) of an in-process job."""
    return (job.actor(PLANNER), [job.actor(loader_actor(n)).loader for n in job.names],
            [job.actor(constructor_actor(c)).constructor for c in range(len(job._constructors))])


class SerialLoaderRef(LoaderRef):
    """A loader reference whose deliveries run on the caller's thread (the Planner's), one loader
    after another, instead of on each loader's own thread."""

    def deliver(self, gen, step, indices, routes, where, timeout=None):
        return self._now("deliver", gen, step, indices, routes, where, timeout=timeout)


def instrument(job: LocalJob, rec: Recorder, fine: bool) -> None:
    """Wrap the roles' methods (instance attributes only; the library is not modified). In one
    process the Planner's thread runs each step: the plan, then the dispatch (every loader's
    delivery, which sends its samples to the constructor and refills the buffer for the next step,
    then the commit, in which the constructor builds the step on that thread). The ``fine``
    (serial) pass also runs the deliveries on the Planner's thread instead of each loader's own, so
    that the timers add up to the wall time."""
    planner, loaders, constructors = role_objects(job)
    planner._plan_one = rec.wrap("step", planner._plan_one)
    for l in loaders:
        l.fill = rec.wrap("fill", l.fill)
    if not fine:
        return
    planner.planner.plan = rec.wrap("plan", planner.planner.plan)
    recovery = planner.recovery
    recovery.loader_ref = lambda name: SerialLoaderRef(recovery.peers, name, recovery.timeout)
    planner._dispatch = rec.wrap("dispatch", planner._dispatch)
    for c in constructors:
        c.build = rec.wrap("build", c.build)
    for l in loaders:
        l.metadata = rec.wrap("metadata", l.metadata)
        l.source.next_raw = rec.wrap("read", l.source.next_raw)


def consume(item: dict) -> tuple[int, int]:
    """(samples, tokens) of one step, touching every rank's microbatches."""
    keys, tokens = set(), 0
    for out in item.values():
        for mb in out["microbatches"] or ():
            tokens += int((mb["segment_ids"] >= 0).sum())
            keys.update(mb["sample_keys"])
    return len(keys), tokens


def run_library(corpus, workers: int, global_batch: int, warmup: int, steps: int, seed: int, fine: bool,
                method: str) -> dict:
    """``fine``: serial instrumented pass (transform/read/role timers); else the throughput pass."""
    rec = Recorder()
    mesh = ol.ClientPlaceTree(**MESH)
    loader = ol.OverlordLoader(make_sources(corpus, seed, rec if fine else None), make_strategy(method), mesh,
                               rank=None,
                               global_batch=global_batch, seq_len=None, seed=seed, workers=workers,
                               image_token_id=corpus.image_token_id, prefetch=2)
    instrument(loader._job, rec, fine)
    n = tokens = 0
    t_start = time.perf_counter()
    first = None
    with loader:
        it = iter(loader)
        for _ in range(warmup):
            next(it)
            first = first or time.perf_counter() - t_start
        t0 = time.perf_counter()
        t_consume = 0.0
        for _ in range(steps):
            item = next(it)
            t1 = time.perf_counter()
            s, k = consume(item)
            t_consume += time.perf_counter() - t1
            n, tokens = n + s, tokens + k
        elapsed = time.perf_counter() - t0
        next(it)                       # so that step warmup + steps has started: it closes the window
    out = {"side": "OverlordLoader", "workers": workers,
           "worker_kind": f"{workers} threads per source ({len(SOURCES)} pools, sources filled one after another: "
                          f"at most {workers} transforms at once)" if workers else "the prefetch thread",
           "mesh": MESH, "samples": n, "tokens": tokens, "seconds": elapsed, "samples_per_s": n / elapsed,
           "tokens_per_s": tokens / elapsed, "startup_s": first, "samples_per_step_ok": n == steps * global_batch,
           "consume_s": t_consume}
    # producer-side window: from the start of step `warmup` to the start of step `warmup + steps`
    starts = rec.starts("step")
    lo, hi = starts[warmup], starts[warmup + steps]
    window = hi - lo
    out["producer"] = {"window_s": window, "samples_per_s": steps * global_batch / window,
                       "fill_s": rec.total("fill", lo, hi), "non_fill_s": window - rec.total("fill", lo, hi)}
    if fine:
        T = {k: rec.total(k, lo, hi) for k in ("transform", "read", "fill", "metadata", "plan", "dispatch", "build",
                                               "step")}
        overhead = window - T["transform"] - T["read"]
        out["phases_s"] = {
            "transform": T["transform"], "read (ParquetSource.next_raw)": T["read"],
            "loader fill bookkeeping": T["fill"] - T["transform"] - T["read"],
            "metadata report": T["metadata"] - T["fill"],
            "plan (Planner.plan)": T["plan"],
            "dispatch (deliver to the constructor, commit the state)": T["dispatch"] - T["build"] - T["metadata"],
            "construct (pack, CP split)": T["build"],
            "rest of the Planner's step": T["step"] - T["plan"] - T["dispatch"],
            "outside the Planner's step (requests, packaging, threads)": window - T["step"]}
        out["transformed_samples"] = rec.count("transform", lo, hi)
        out["transform_s"], out["read_s"] = T["transform"], T["read"]
        out["transform_ms_per_sample"] = 1e3 * T["transform"] / max(1, out["transformed_samples"])
        out["overhead_s"] = overhead
        out["overhead_fraction"] = overhead / T["transform"]
    return out


# ------------------------------------------------------------------------------------------------
# profile and thread-scaling probe
# ------------------------------------------------------------------------------------------------

def _fmt_func(key) -> str:
    file, line, fn = key
    parts = Path(file).parts
    short = "/".join(parts[parts.index("torchdata_overlord"):]) if "torchdata_overlord" in parts else \
        "/".join(parts[-2:]) if len(parts) > 1 else file
    return f"{short}:{line}({fn})" if line else fn


def profile_library(corpus, global_batch: int, warmup: int, steps: int, seed: int, method: str) -> dict:
    """cProfile of the library's own work per step, serial, on the Planner's thread (where one step
    runs: the plan, the deliveries, made serial as in the ``fine`` pass, and the commit with its
    build; ``state_dict()`` too): the loaders are filled (read + transform) before each step with the
    profiler off, so the step finds full buffers and what is profiled is metadata, planning, staging,
    construction and ``state_dict()`` only (a delivery's refill for the next step is left out too)."""
    mesh = ol.ClientPlaceTree(**MESH)
    job = LocalJob(make_sources(corpus, seed, None), make_strategy(method), mesh, global_batch, None, seed=seed, workers=0,
                   image_token_id=corpus.image_token_id)
    prof = cProfile.Profile()
    on = [False]
    planner = role_objects(job)[0]
    recovery = planner.recovery
    recovery.loader_ref = lambda name: SerialLoaderRef(recovery.peers, name, recovery.timeout)

    def while_profiling(fn, profile: bool):
        """``fn`` with the profiler on (``profile``) or off while it runs, during the profiled steps."""
        def run(*args, **kwargs):
            if on[0]:
                prof.enable() if profile else prof.disable()
            try:
                return fn(*args, **kwargs)
            finally:
                if on[0]:
                    prof.disable() if profile else prof.enable()
        return run

    planner._plan_one = while_profiling(planner._plan_one, True)
    planner.state_dict = while_profiling(planner.state_dict, True)
    for loader in role_objects(job)[1]:          # a delivery's refill reads and transforms: not the library's own
        loader.fill = while_profiling(loader.fill, False)
    wall = 0.0
    try:
        for i in range(warmup + steps):
            on[0] = False
            for loader in role_objects(job)[1]:
                loader.fill()
            on[0] = i >= warmup
            t0 = time.perf_counter()
            job.step()
            job.state_dict()
            if on[0]:
                wall += time.perf_counter() - t0
    finally:
        job.close()
    st = pstats.Stats(prof)
    rows = [{"function": _fmt_func(k), "ncalls": v[1], "tottime_s": v[2], "cumtime_s": v[3]}
            for k, v in st.stats.items()]
    library = [r for r in rows if r["function"].startswith("torchdata_overlord/")]
    return {"steps": steps, "profiled_wall_s": st.total_tt, "steps_wall_s": wall,
            "note": "cProfile inflates per-call costs; compare shares",
            "top_tottime": sorted(rows, key=lambda r: -r["tottime_s"])[:10],
            "top_library_cumtime": sorted(library, key=lambda r: -r["cumtime_s"])[:10]}


def thread_scaling(corpus, workers: int, rows: int, seed: int, rounds: int = 3) -> dict:
    """Per source: the same rows transformed by one thread and by ``workers`` threads of this process,
    best of ``rounds`` each (a probe of how far the transforms release the GIL)."""
    out = {}
    for name in SOURCES:
        src = corpus.source(name, seed=seed)
        raws = [src.next_raw() for _ in range(rows)]

        def apply(r, src=src):
            return src.apply(r[1], r[2])

        for r in raws[:4]:
            apply(r)                   # load the tokenizer / decoders
        one = many = float("inf")
        with ThreadPoolExecutor(workers) as ex:
            for _ in range(rounds):
                t0 = time.perf_counter()
                for r in raws:
                    apply(r)
                one = min(one, time.perf_counter() - t0)
                t0 = time.perf_counter()
                list(ex.map(apply, raws))
                many = min(many, time.perf_counter() - t0)
        src.close()
        out[name] = {"ms_per_sample_1_thread": 1e3 * one / rows, f"ms_per_sample_{workers}_threads": 1e3 * many / rows,
                     "speedup": one / many}
    return out


# ------------------------------------------------------------------------------------------------

RUNS = {   # key: (label, side, serial?, baseline grouped?)
    "dataloader_serial": ("DataLoader, main process, interleaved", "DataLoader", True, False),
    "dataloader_serial_grouped": ("DataLoader, main process, grouped", "DataLoader", True, True),
    "overlord_serial": ("OverlordLoader, workers=0", "OverlordLoader", True, None),
    "dataloader": ("DataLoader, W processes, interleaved", "DataLoader", False, False),
    "dataloader_grouped": ("DataLoader, W processes, grouped", "DataLoader", False, True),
    "torchdata_nodes": ("torchdata.nodes MultiNodeWeightedSampler, W processes", "nodes", False, None),
    "overlord": ("OverlordLoader, W threads/source", "OverlordLoader", False, None),
}


def median_run(reps: list[dict], key: str) -> dict:
    """The repeat with the median ``key`` (lower middle for an even count), plus every repeat's value."""
    ordered = sorted(reps, key=lambda r: r[key])
    pick = dict(ordered[(len(ordered) - 1) // 2])
    pick["repeats"] = len(reps)
    pick[f"{key}_all"] = [r[key] for r in reps]
    if key != "samples_per_s":
        pick["samples_per_s_all"] = [r["samples_per_s"] for r in reps]
    return pick


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help='scale "test" and few steps (CI smoke run)')
    ap.add_argument("--scale", default=None, choices=["demo", "test"], help="corpus scale (default demo; test with --quick)")
    ap.add_argument("--root", type=Path, default=None,
                    help="corpus cache (default: default_corpus_root() for demo, a sibling demo-corpus-<scale> otherwise)")
    ap.add_argument("--workers", type=int, default=2, help="W: DataLoader worker processes = OverlordLoader threads per source")
    ap.add_argument("--global-batch", type=int, default=None, help="samples per step (default 128; 32 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 40; 4 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 4; 1 with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats of every run, the median is reported "
                    "(default 3; 1 with --quick)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads in this process "
                    "(DataLoader workers always use 1)")
    ap.add_argument("--nodes-prebatch", type=int, default=None, help="rows per task the torchdata.nodes "
                    "ParallelMapper sends a worker process (default global_batch // W, the DataLoader's per-worker "
                    "batch; 0: one row per task, the mapper's default)")
    ap.add_argument("--method", default="karmarkar_karp", choices=["karmarkar_karp", "greedy"], help="balancing method")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="always run the cProfile pass (else only if the target is missed)")
    ap.add_argument("--out", type=Path, default=RESULTS / "e2e_throughput.json")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers must be >= 1 (the serial runs are always made)")
    if args.nodes_prebatch is not None and args.nodes_prebatch < 0:
        ap.error("--nodes-prebatch must be >= 0")
    scale = args.scale or ("test" if args.quick else "demo")
    gb = args.global_batch or (32 if args.quick else 128)
    steps = args.steps or (4 if args.quick else 40)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 4)
    repeats = args.repeats or (1 if args.quick else 3)
    root = args.root or (default_corpus_root() if scale == "demo" else
                         default_corpus_root().parent / f"demo-corpus-{scale}")
    torch.set_num_threads(args.torch_threads)
    W = args.workers
    prebatch = max(1, gb // W) if args.nodes_prebatch is None else (args.nodes_prebatch or None)

    t_all = time.perf_counter()
    load_start = round(os.getloadavg()[0], 2)      # other jobs on the machine skew the W-worker runs most
    corpus = build_demo_corpus(root, scale=scale, seed=args.seed)
    # Everything imported so far (torch, torchvision, pyarrow: ~10^6 objects) is long-lived: freeze it, so
    # the occasional full collection (0.1-0.3 s on this heap) does not land in one side's window at random.
    gc.collect()
    gc.freeze()
    print(f"corpus {corpus.root} (scale {scale}); mixture {WEIGHTS}; global batch {gb}, {warmup} warm-up + "
          f"{steps} measured steps ({steps * gb} samples) x {repeats} repeats; mesh {MESH}, {args.method}; W={W}; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    reps: dict[str, list] = {k: [] for k in RUNS}
    errors: dict[str, str] = {}

    def attempt(key, fn, *a):
        t0 = time.perf_counter()
        try:
            r = fn(*a)
            r["run_s"] = time.perf_counter() - t0
            return r
        except Exception as e:  # noqa: BLE001 (recorded; the exit status says a run failed)
            errors[key] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            return None
        finally:
            print(f"  {key}: {'failed' if key in errors else 'done'} in {time.perf_counter() - t0:.1f} s", flush=True)

    for rep in range(repeats):
        # a library run closes its pools and prefetch thread before the next DataLoader forks its workers
        for key, (_, side, serial, grouped) in RUNS.items():
            if key in errors:
                continue
            w = 0 if serial else W
            if side == "DataLoader":
                r = attempt(key, run_baseline, corpus, w, gb, warmup, steps, args.seed, grouped)
            elif side == "nodes":
                r = attempt(key, run_nodes, corpus, w, gb, warmup, steps, args.seed, prebatch)
            else:
                r = attempt(key, run_library, corpus, w, gb, warmup, steps, args.seed, serial, args.method)
            if r is not None:
                reps[key].append(r)
    runs = {k: median_run(v, "overhead_fraction" if k == "overlord_serial" else "samples_per_s")
            for k, v in reps.items() if v and k not in errors}
    probe = attempt("thread_scaling", thread_scaling, corpus, W, 16 if args.quick else 64, args.seed)

    print()
    print(f"{'run':>54} {'samples/s':>10} {'tokens/s':>11} {'transform ms/sample':>19} {'startup s':>9}")
    for key, (label, *_rest) in RUNS.items():
        r = runs.get(key)
        if r:
            print(f"{label.replace('W ', f'{W} '):>54} {r['samples_per_s']:>10.1f} {r['tokens_per_s']:>11.0f} "
                  f"{r.get('transform_ms_per_sample', float('nan')):>19.3f} {r['startup_s']:>9.2f}")
    verdict = {}
    ser = runs.get("overlord_serial")
    if ser:
        ph = ser["phases_s"]
        print(f"\nserial library pass (median of {ser['repeats']}), {steps} steps, {ser['transformed_samples']} "
              f"samples transformed:")
        for k, v in ph.items():
            print(f"  {k:>45}: {v:8.3f} s  ({100 * v / ph['transform']:6.2f}% of transform)")
        frac = ser["overhead_fraction"]
        verdict = {"overhead_fraction": frac, "overhead_fraction_all": ser["overhead_fraction_all"],
                   "meets_target": frac <= TARGET["overhead_fraction"], "transform_s": ph["transform"],
                   "overhead_s": ser["overhead_s"],
                   "overhead_ms_per_step": 1e3 * ser["overhead_s"] / steps,
                   "overhead_ms_per_sample": 1e3 * ser["overhead_s"] / (steps * gb)}
        for k in ("dataloader_serial", "dataloader_serial_grouped"):
            if k in runs:
                verdict[f"{k}_other_fraction"] = runs[k]["other_fraction"]
        par = runs.get("overlord")
        if par:
            verdict["parallel_non_fill_fraction"] = par["producer"]["non_fill_s"] / ph["transform"]
        for a, b in (("dataloader_serial", "overlord_serial"), ("dataloader_serial_grouped", "overlord_serial"),
                     ("dataloader", "overlord"), ("dataloader_grouped", "overlord"),
                     ("torchdata_nodes", "overlord")):
            if a in runs and b in runs:
                verdict[f"ratio_{b}_over_{a}"] = runs[b]["samples_per_s"] / runs[a]["samples_per_s"]
        print(f"overhead (wall - transform - read) = {ser['overhead_s']:.3f} s = {100 * frac:.2f}% of the transform "
              f"time ({verdict['overhead_ms_per_step']:.1f} ms per step of {gb}; repeats "
              f"{', '.join(f'{100 * x:.1f}%' for x in ser['overhead_fraction_all'])}): "
              f"{'MEETS' if verdict['meets_target'] else 'MISSES'} the <= {100 * TARGET['overhead_fraction']:.0f}% target")
        for k in ("dataloader_serial", "dataloader_serial_grouped"):
            if f"{k}_other_fraction" in verdict:
                print(f"  for comparison, {k}: wall - transform - read = "
                      f"{100 * verdict[f'{k}_other_fraction']:.2f}% of its transform time")
        if "parallel_non_fill_fraction" in verdict:
            print(f"  W={W} run: producer time outside the loaders' fill = "
                  f"{100 * verdict['parallel_non_fill_fraction']:.2f}% of the serial transform time (cross-check)")
        for k, v in verdict.items():
            if k.startswith("ratio_"):
                print(f"  samples/s {k[6:].replace('_over_', ' / ')}: {v:.3f}")
    if probe:
        print(f"\nthread scaling of the transforms (the same rows, 1 thread vs {W} threads in one process):")
        for name, r in probe.items():
            if isinstance(r, dict):
                print(f"  {name:>5}: {r['ms_per_sample_1_thread']:.3f} ms/sample, x{r['speedup']:.2f} with {W} threads")

    profile = None
    if args.profile or (verdict and not verdict["meets_target"]):
        profile = attempt("profile", profile_library, corpus, gb, warmup, 2 if args.quick else 10, args.seed,
                          args.method)
        if profile:
            print(f"\ncProfile of the library's own work (buffers pre-filled, {profile['steps']} steps, "
                  f"{profile['profiled_wall_s']:.2f} s under the profiler), top 10 by own time:")
            for r in profile["top_tottime"]:
                print(f"  {r['tottime_s']:7.3f} s own {r['cumtime_s']:7.3f} s cum {r['ncalls']:>8}  {r['function']}")
            print("top 10 library functions by cumulative time:")
            for r in profile["top_library_cumtime"]:
                print(f"  {r['tottime_s']:7.3f} s own {r['cumtime_s']:7.3f} s cum {r['ncalls']:>8}  {r['function']}")

    out = {"benchmark": "e2e_throughput", "quick": args.quick, "scale": scale, "target": TARGET,
           "config": {"weights": WEIGHTS, "global_batch": gb, "steps": steps, "warmup": warmup, "repeats": repeats,
                      "workers": W, "mesh": MESH, "microbatches": MICROBATCHES, "max_tokens": MAX_TOKENS,
                      "nodes_prebatch": prebatch, "seed": args.seed, "seq_len": None, "image_placeholders": True, "gc_freeze_after_imports": True, "corpus_root": str(corpus.root),
                      "strategy": "mix(constant) -> distribute(DP) -> cost(attention_flops) -> "
                                  f"balance({args.method}, oversize=split)", "method": args.method},
           "labels": {k: v[0].replace("W ", f"{W} ") for k, v in RUNS.items()},
           "workers_note": (f"DataLoader: W={W} worker processes (fork), each reading and transforming a disjoint "
                            f"share of every source's files, batches of global_batch/W, the main process only "
                            f"receives. OverlordLoader: workers=W gives every Source Loader its own W-thread pool "
                            f"({len(SOURCES)} pools); the embedded runtime fills the sources one after another, so "
                            f"at most W transforms run at once, as threads of one process (transforms that hold "
                            f"the GIL, e.g. sentencepiece encoding, do not overlap), and planning, packing and "
                            f"bookkeeping run serially in the prefetch thread between fills."),
           "nodes_note": (f"torchdata.nodes: one IterableWrapper per source over ParquetSource rows (every file, "
                          f"as the library reads them), MultiNodeWeightedSampler with the same weights (torch."
                          f"multinomial picks, so the same mixture in expectation, not the same samples), "
                          f"ParallelMapper(method='process', fork, num_workers=W={W}, in_order=True, prebatch="
                          f"{prebatch}) applying the same transforms, Batcher(global_batch), Loader. W worker "
                          f"processes transform; the main process reads and mixes in the mapper's reader thread "
                          f"and unpickles the results, so W+1 processes as for the DataLoader. prebatch "
                          f"{prebatch} rows per task (global_batch/W: the DataLoader's per-worker batch); "
                          f"--nodes-prebatch 0 sends one row per task, the mapper's default."),
           "runs": runs, "thread_scaling": probe, "errors": errors, "verdict": verdict, "profile": profile}
    write_results(args.out, out, started=t_all, load_start=load_start)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
