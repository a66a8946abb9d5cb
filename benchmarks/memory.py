"""Memory: disaggregated against colocated loading (paper 7.2, 7.4, Fig. 12, 14, 15).

Both sides read the same S sources of real Parquet files (text rows, written once per row-group size
under a cache folder) with ``ParquetSource`` (pyarrow: every file's footer and one decoded row group
per source) and tokenize every sample with the same sentencepiece ``Tokenize``. The sweep is repeated
for each row-group size in ``--row-group-mib`` (about that many MiB of decoded text per row group):
colocated memory grows with row-group size x sources x workers x ranks, the library's with sources.
A sampler thread reads ``/proc/<pid>/smaps_rollup`` of every process in the run's tree every
``--interval`` s: *peak* is the largest sum seen (``peak_running``: after the first batch, i.e.
without start-up), *steady* the median of the sums after warm-up.

What is summed: anonymous PSS (``Pss_Anon + Pss_Shmem``; pages shared after a fork are split among
the sharers, so the sum counts each once), minus the trainer's own before the loader was built, so
the trainer's imports (torch, pyarrow, sentencepiece, this package) count on neither side.
File-backed PSS (shared libraries) is recorded per measured run (``file_mib``; ``pss_mib`` is both)
but not in the totals: every trainer rank on a node maps the same libraries whichever loader it uses,
so they do not multiply with ranks, and on a shared machine their PSS moves by hundreds of MiB as
other processes map libtorch. Every run also records, at the end of its steady phase, each process's
anonymous PSS by kind of mapping (``anon_breakdown``) and its thread count.

* colocated (the baseline): one trainer rank runs ``torch.utils.data.DataLoader(num_workers=W)``
  over an ``IterableDataset`` in which every worker opens all S sources and mixes them round-robin.
  Measured: one rank, in a fresh process (the trainer plus W forked workers), warmed up until every
  worker has drawn from every source (so each holds S row groups). Where the rank would not fit the
  memory guard, the trainer with one worker is measured and the rank is that plus W - 1 times the
  worker's own pages (its anonymous pages not shared with the trainer; ``how``). Derived: a job of
  D x CP x PP ranks runs one such DataLoader per rank (the parallelism redundancy: CP and PP ranks
  load the same data again), so its total is ranks x the rank.
* this library: ``OverlordLoader(runtime="rpc", rank=None)`` on a ``dp=D`` mesh at its default
  placement (``placement="auto"``: the Planner, one Source Loader per source and one Data Constructor
  per DP group as actors in as many worker processes as the cores the trainer leaves free), forked
  from the runtime's fork server (it and multiprocessing's resource tracker are counted as helpers).
  The sources are profiled first in a process of their own (the cold profile: its time and memory
  are recorded), so the measured job finds them in its profile journal, as every rank but the first
  and every restart does. Measured: a real job per (S, D) for S in ``library_sources`` and each (S,
  D) in ``library_extra``, with its placement, role processes and start-up time to the first batch;
  *plane* = every process but the trainer, *client* = the trainer's growth (its RPC agent, sources'
  footers, fetched batches). Derived: the roles do not depend on CP, PP or W (a measured job on a
  CP x PP mesh checks it); every trainer rank of a real job is a client of its own, so total = plane
  + ranks x client. For an (S, D) not measured, plane and client come from per-unit costs fitted
  over the size's measured jobs (least squares: intercept + per source x S + per DP group x D;
  coefficients and residuals in the JSON) and the row says ``fitted`` (``extrapolated`` beyond every
  measured S). A row needs a measured colocated rank and a measured or fitted library.

Memory guard: a run whose estimated footprint exceeds what the machine can spare (``MEMORY_GUARD``)
is not started (a colocated rank falls back to one worker first; no corpus is written for an S too
large for any run), and a run during which ``MemAvailable`` falls below the floor is killed; both
are listed under ``skipped`` with the reason.
Derived peaks add per-unit peaks, as if every unit peaked at once (an upper bound, on both sides).
Prints a table per size and the targets, writes ``benchmarks/results/memory.json`` and ``memory.png``;
exits non-zero if a run failed or left a process behind, never because a figure disappointed.

    python benchmarks/memory.py                           # row groups of 1, 8 and 64 MiB (see SIZES)
    python benchmarks/memory.py --row-group-mib 8         # one size
    python benchmarks/memory.py --quick --out /tmp/m.json  # CI smoke: 64 and 256 KiB, S in {4, 10}
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")          # one intra-op thread, as in DataLoader workers

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import building, process_tree, reap, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
PAPER_RATIO = 13.5
_CP_PP = [[1, 1], [4, 1], [4, 4]]
# per size: the row-group sizes swept by default and, for a size up to the first bound (None: any), its plan
SIZES = {
    "full": {"row_group_mib": [1, 8, 64], "plans": [
        [1, {"sources": [10, 50, 100, 300], "dw": [[4, 2], [8, 4]], "cp_pp": _CP_PP, "library_sources": [10, 50, 100],
             "library_extra": [[300, 4], [300, 8]], "library_mesh_check": [10, 4, 4, 4],   # [S, D, CP, PP]
             "files": 2, "row_groups": 2}],
        [16, {"sources": [10, 100, 300], "dw": [[4, 2], [8, 4]], "cp_pp": _CP_PP, "library_sources": [10, 100],
              "library_extra": [[300, 8]], "library_mesh_check": None, "files": 1, "row_groups": 2}],
        # S=300 is here to say that it does not fit this machine (the guard skips it, in the JSON)
        [None, {"sources": [100, 300], "dw": [[4, 2]], "cp_pp": _CP_PP, "library_sources": [100],
                "library_extra": [[300, 4]], "library_mesh_check": None, "files": 1, "row_groups": 1}]]},
    "quick": {"row_group_mib": [0.0625, 0.25], "plans": [
        [0.0625, {"sources": [4, 10], "dw": [[4, 2]], "cp_pp": [[1, 1], [4, 4]], "library_sources": [4, 10],
                  "library_extra": [], "library_mesh_check": None, "files": 2, "row_groups": 2}],
        [None, {"sources": [4], "dw": [[4, 2]], "cp_pp": [[1, 1], [4, 4]], "library_sources": [4],
                "library_extra": [], "library_mesh_check": None, "files": 1, "row_groups": 2}]]},
}
# the targets, checked on the rows of a full run (CP = PP = 1; ratios colocated / library)
TARGETS = [
    {"name": "8 MiB row groups, S=100 D=4 W=2: library at least 4.3x below colocated", "row_group_mib": 8,
     "sources": 100, "dp": 4, "workers": 2, "min_ratio": 4.3, "keys": ["steady", "peak_running"]},
    {"name": "1 MiB row groups, S=100 D=4 W=2: library never above colocated", "row_group_mib": 1,
     "sources": 100, "dp": 4, "workers": 2, "min_ratio": 1.0, "keys": ["steady", "peak_running", "peak"]},
    {"name": "1 MiB row groups, S=300 D=8 W=4: library measured, at most 8 GiB", "row_group_mib": 1,
     "sources": 300, "dp": 8, "workers": 4, "max_library_mib": 8192, "keys": ["steady", "peak"]},
    {"name": "8 MiB row groups, S=300 D=8 W=4: library measured, at most 8 GiB", "row_group_mib": 8,
     "sources": 300, "dp": 8, "workers": 4, "max_library_mib": 8192, "keys": ["steady", "peak"]},
]
GLOBAL_BATCH = 64          # samples per step over the DP ranks: a colocated rank's batch is GLOBAL_BATCH // D
KEYS = ("peak", "peak_running", "steady")     # whole run, after the first batch, median after warm-up
STEPS = {"warm": 3, "steady": 8}                # library steps: warm-up (buffers filled), then measured
STRATEGY = "torchdata_overlord.sim.fault_run.Strategy: equal Constant mix, distribute DP, greedy balance"
BUFFER = 16                # a Source Loader's buffer (samples): the library's read-ahead per source
CORPUS_VERSION = 2
STARTUP_TIMEOUT = 600      # 300 loader actors take ~1-2 min to start and fill on 2 cores
RUN_TIMEOUT = 1200         # one measured run, start to end
# what a run may be expected to take: est. MiB per source held per process = per_mib x row group MiB + base
MEMORY_GUARD = {"reserve_gib": 3.0, "share_of_total": 0.6, "floor_gib": 1.5, "per_source_per_mib": 1.75,
                "per_source_base_mib": 0.6, "per_process_mib": 150, "library_fixed_mib": 800}
METHOD = {
    "metric": "sum over every process of Pss_Anon + Pss_Shmem (smaps_rollup), minus the trainer's before the "
              "loader existed; file-backed PSS (shared libraries) is per run in file_mib / pss_mib, not in totals",
    "colocated": "measured: one rank (trainer + W forked DataLoader workers, each holding all S sources), or where "
                 "that does not fit the memory guard the trainer + 1 worker, the rank being trainer + W x worker; "
                 "derived: D x CP x PP ranks x that rank",
    "library": "measured: one rpc job per (S, D) at the default placement, its sources profiled beforehand in a "
               "process of their own (journal warm): plane = every role process + fork server + resource tracker, "
               "client = the trainer's growth; derived: plane + D x CP x PP x client; (S, D) not measured: least "
               "squares intercept + per_source x S + per_dp x D over the size's measured jobs (fitted; "
               "extrapolated beyond the largest measured S)",
    "peak": "largest sum over the run (peak_running: after the first batch); derived peaks add per-unit peaks",
    "steady": "median sum after warm-up",
    "memory_guard": "a run estimated over min(MemAvailable - reserve, share x MemTotal) is not started; one during "
                    "which MemAvailable falls below the floor is killed; both are listed under skipped",
}


def plan_for(size: str, mib: float) -> dict:
    """The plan of one row-group size: the first of ``SIZES[size]["plans"]`` whose bound holds it."""
    return next(dict(p) for bound, p in SIZES[size]["plans"] if bound is None or mib <= bound)


# ------------------------------------------------------------------------------ the corpus

def build_corpus(root: Path, n_sources: int, row_group_mib: float, files: int, row_groups: int, seed: int = 0) -> dict:
    """S sources of text rows in real Parquet files under ``root``, row groups of about ``row_group_mib``
    MiB of decoded text, plus a sentencepiece model trained on the same text; the manifest. Reused while
    its configuration matches and it has at least S sources. Where the disk cannot hold ``files`` x
    ``row_groups`` row groups per source, fewer are written (row groups keep their size)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchdata_overlord.testing import make_text_corpus, train_sentencepiece

    kib = round(row_group_mib * 1024)
    root.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root.parent).free
    margin = min(4 << 30, free // 2)                                # left to everyone else: 4 GiB, or half a small disk
    free -= margin
    while files * row_groups > 1 and n_sources * files * row_groups * kib * 1024 > free:
        files, row_groups = (files, row_groups - 1) if row_groups > 1 else (files - 1, row_groups)
    if n_sources * kib * 1024 > free:
        raise RuntimeError(f"{root.parent}: {n_sources} row groups of {kib} KiB do not fit the free disk space "
                           f"({free / 2**30:.1f} GiB beyond a {margin / 2**30:.1f} GiB margin); pass another --root")
    config = {"version": CORPUS_VERSION, "row_group_kib": kib, "files": files, "row_groups": row_groups, "seed": seed}
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        if {k: v for k, v in manifest["config"].items() if k != "sources"} == config \
                and manifest["config"]["sources"] >= n_sources \
                and all(Path(root, f).is_file() for fs in manifest["files"][:n_sources] for f in fs):
            return {**manifest, "files": manifest["files"][:n_sources], "root": str(root)}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if root.exists():
        ours = re.compile(r"manifest\.json|tokenizer\.(model|vocab)|s\d{3}")
        foreign = [p.name for p in root.iterdir() if not ours.fullmatch(p.name)]
        if foreign:
            raise RuntimeError(f"{root} holds files this benchmark did not write ({foreign[:3]}); pass another --root")
        shutil.rmtree(root)                       # the old corpus goes first: two would not fit the disk
    t0 = time.perf_counter()
    with building(root) as tmp:
        rng = np.random.default_rng(seed)
        sentences = make_text_corpus(20_000, seed=seed, min_words=8, max_words=30)
        sizes = np.clip(rng.lognormal(np.log(12), 0.6, 4000), 2, 80).astype(int)     # sentences per document
        pool = [" ".join(sentences[j] for j in rng.integers(0, len(sentences), k)) for k in sizes]
        train_sentencepiece(pool[:1500], tmp / "tokenizer", vocab_size=1000)
        mean_bytes = sum(map(len, pool)) / len(pool)
        per_rg = max(8, round(kib * 1024 / mean_bytes))
        out = []
        for s in range(n_sources):
            (tmp / f"s{s:03d}").mkdir()
            paths = []
            for f in range(files):
                n = per_rg * row_groups
                text = pa.array([pool[i] for i in rng.integers(0, len(pool), n)], pa.string())
                table = pa.table({"id": pa.array(np.arange(n, dtype=np.int64) + f * n), "text": text})
                rel = f"s{s:03d}/part-{f:05d}.parquet"
                pq.write_table(table, tmp / rel, row_group_size=per_rg, use_dictionary=False, compression="snappy")
                paths.append(rel)
                del text, table
            out.append(paths)
        manifest = {"config": {**config, "sources": n_sources}, "files": out, "spm": "tokenizer.model",
                    "rows_per_row_group": per_rg, "mean_doc_bytes": round(mean_bytes, 1),
                    "disk_mib": round(sum(p.stat().st_size for p in tmp.rglob("*.parquet")) / 2**20, 1),
                    "build_s": round(time.perf_counter() - t0, 1)}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
    print(f"corpus: {n_sources} sources x {files} files x {row_groups} row groups of {per_rg} rows "
          f"(~{kib} KiB, {manifest['disk_mib']:.0f} MiB on disk) written to {root} in {manifest['build_s']} s",
          flush=True)
    return {**manifest, "root": str(root)}


# ------------------------------------------------------------------------------ measuring (child processes)

def smaps(pid: int) -> tuple[float, float, float] | None:
    """``(anonymous PSS, file PSS, anonymous RSS)`` of ``pid`` in MiB from ``/proc/<pid>/smaps_rollup``:
    Pss_Anon + Pss_Shmem, Pss_File and Anonymous (None if the process is gone)."""
    from torchdata_overlord.runtime.procstats import smaps_rollup

    got = smaps_rollup(pid)
    if not got:
        return None
    return got.get("Pss_Anon", 0.0) + got.get("Pss_Shmem", 0.0), got.get("Pss_File", 0.0), got.get("Anonymous", 0.0)


def anon_breakdown(pid: int) -> dict | None:
    """Anonymous PSS of ``pid`` in MiB by kind of mapping, from ``/proc/<pid>/smaps`` (a mapping's PSS
    times its anonymous share of RSS): ``huge_page_backed`` (mappings with transparent huge pages:
    pyarrow's mimalloc, which holds the decoded row groups, asks for them), ``heap`` (the brk heap:
    glibc's main arena), ``stacks`` (the main stack and mappings the size of a thread stack), ``shmem``
    (shared memory: torch tensors passed between processes), ``other`` (glibc's thread arenas, pymalloc,
    torch, ...); ``huge_pages``: the huge pages themselves (a 2 MiB page is resident whole once
    touched); ``threads``. None if the process is gone."""
    import resource

    stack_kib = resource.getrlimit(resource.RLIMIT_STACK)[0] // 1024
    out = {"huge_page_backed": 0.0, "heap": 0.0, "stacks": 0.0, "shmem": 0.0, "other": 0.0, "huge_pages": 0.0}
    try:
        with open(f"/proc/{pid}/smaps") as f:
            lines = f.read().splitlines()
        with open(f"/proc/{pid}/status") as f:
            threads = next(int(x.split()[1]) for x in f if x.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return None
    name, size, fields = "", 0, {}

    def close():
        rss, pss = fields.get("Rss", 0), fields.get("Pss", 0)
        if not rss:
            return
        if name.startswith(("/dev/shm", "/memfd:", "/SYSV", "[anon_shmem")):
            out["shmem"] += pss / 1024
            return
        anon = pss * fields.get("Anonymous", 0) / rss
        huge = fields.get("AnonHugePages", 0)
        kind = ("huge_page_backed" if huge else "heap" if name == "[heap]"
                else "stacks" if name.startswith("[stack") or (not name and size == stack_kib) else "other")
        out[kind] += anon / 1024
        out["huge_pages"] += huge / 1024
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):          # a mapping's header line
            close()
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            name, size, fields = " ".join(head[5:]), (hi - lo) // 1024, {}
        elif len(head) == 3 and head[2] == "kB":
            fields[head[0].rstrip(":")] = int(head[1])
    close()
    return {**{k: round(v, 1) for k, v in out.items()}, "threads": threads}


class Sampler(threading.Thread):
    """Every ``interval`` s (and at each :meth:`mark`), the PSS of each process in this process's tree,
    tagged with the run's phase: ``start`` (until the first batch), ``warm``, then ``steady``."""

    def __init__(self, interval: float):
        super().__init__(name="pss-sampler", daemon=True)
        self.interval, self.phase = interval, "start"
        self.sweeps: list[tuple[str, dict[int, tuple[float, float]]]] = []
        self._done = threading.Event()

    def sweep(self) -> None:
        pss = {p: smaps(p) for p in process_tree(os.getpid())}
        self.sweeps.append((self.phase, {p: v for p, v in pss.items() if v is not None}))

    def run(self) -> None:
        while not self._done.is_set():
            self.sweep()
            self._done.wait(self.interval)

    def mark(self, phase: str) -> None:
        """A sweep closing the current phase, then ``phase`` begins."""
        self.sweep()
        self.phase = phase

    def finish(self) -> None:
        """A last sweep, then stop (idempotent: the ``finally`` of a run calls it again)."""
        if not self._done.is_set():
            self.sweep()
            self._done.set()
            self.join(timeout=30)

    def summary(self, groups: dict[str, callable], before: tuple[float, ...], extra: dict | None = None) -> dict:
        """Anonymous PSS per group of pids (``groups[name](pid) -> bool``) in MiB: ``peak`` (whole run),
        ``peak_running`` (after the first batch) and ``steady`` (median of the steady sweeps); ``total``
        is every process minus ``before`` (the trainer's, before the loader existed); ``file`` and
        ``pss`` are that total for file-backed pages and for all of PSS; ``extra[name](sweep, sums)``
        adds a figure computed from each sweep and its sums."""
        def sums(sweep):
            out = {g: sum(v[0] for p, v in sweep.items() if pick(p)) for g, pick in groups.items()}
            out["total"] = sum(v[0] for v in sweep.values()) - before[0]
            out["file"] = sum(v[1] for v in sweep.values()) - before[1]
            out["pss"] = out["total"] + out["file"]
            for name, fn in (extra or {}).items():
                out[name] = fn(sweep, out)
            return out
        every = [(ph, sums(s)) for ph, s in self.sweeps]
        running = [x for ph, x in every if ph != "start"] or [every[-1][1]]
        steady = [x for ph, x in every if ph == "steady"] or [every[-1][1]]
        return {g: {"peak": round(max(x[g] for _, x in every), 1),
                    "peak_running": round(max(x[g] for x in running), 1),
                    "steady": round(statistics.median(x[g] for x in steady), 1)} for g in every[0][1]}


def _common_imports():
    """What a trainer process has imported before it builds a loader, the same on both sides."""
    import gc

    import pyarrow.parquet  # noqa: F401
    import sentencepiece  # noqa: F401
    import torch
    import torch.utils.data  # noqa: F401

    import torchdata_overlord  # noqa: F401
    torch.set_num_threads(1)
    gc.collect()


def _mixed_dataset(files: list[list[str]], spm: str, seed: int):
    import torch.utils.data as tud

    from torchdata_overlord import ParquetSource, Tokenize

    class Mixed(tud.IterableDataset):
        """Each worker opens every source (one ParquetSource each) and mixes them round-robin."""

        def __iter__(self):
            info = tud.get_worker_info()
            w = info.id if info else 0
            tok = Tokenize(spm, field="text")           # one tokenizer per worker, shared by its sources
            srcs = [ParquetSource(f"s{i:03d}", f, tok, seed=seed * 1000 + w * 7 + i) for i, f in enumerate(files)]
            i = w
            while True:
                yield next(srcs[i % len(srcs)])[1]
                i += 1
    return Mixed()


def run_colocated(cfg: dict) -> dict:
    """One trainer rank's DataLoader with ``measured_workers`` workers (W, or 1 standing in for each of
    W), each mixing all S sources: its PSS over time."""
    _common_imports()
    import warnings

    from torch.utils.data import DataLoader

    me, w, rank_w = os.getpid(), cfg["measured_workers"], cfg["workers"]
    # W workers per rank on this 2-core machine is the point of the measurement, not a mistake
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    before = smaps(me)
    sampler = Sampler(cfg["interval"])
    sampler.start()
    dl = DataLoader(_mixed_dataset(cfg["files"], cfg["spm"], cfg["seed"]), batch_size=cfg["batch"], num_workers=w,
                    collate_fn=list, prefetch_factor=2, timeout=300)
    # every worker has drawn from every source once it produced S samples: then each holds S row groups
    warm = -(-cfg["sources"] * w // cfg["batch"]) + w
    it, workers, tokens, t0, breakdown = None, [], 0, time.perf_counter(), {}
    try:
        it = iter(dl)
        workers = list(it._workers)
        next(it)
        first_s = time.perf_counter() - t0
        sampler.mark("warm")
        for _ in range(warm - 1):
            next(it)
        sampler.mark("steady")
        for i in range(warm):
            tokens += sum(r["tokens"] for r in next(it))
            if (i + 1) % max(1, warm // 8) == 0:
                sampler.sweep()
        breakdown = {str(p): anon_breakdown(p) for p in [me] + [x.pid for x in workers]}
        sampler.finish()
    finally:
        sampler.finish()
        if it is not None:
            it._shutdown_workers()
            del it
        for p in workers:
            p.join(timeout=30)
    stuck = [p.pid for p in workers if p.is_alive()]
    if stuck:
        raise RuntimeError(f"DataLoader workers {stuck} did not exit")
    pids = [me] + [p.pid for p in workers]
    seen = sorted({p for _, s in sampler.sweeps for p in s})

    def private(sweep, _):
        """A worker's own anonymous pages, the mean over workers: a page the trainer had before the fork
        is shared by all w + 1 processes, so PSS = own + shared / (w + 1) and RSS = own + shared."""
        return sum(((w + 1) * v[0] - v[2]) / w for p, v in sweep.items() if p != me) / w

    # one worker standing in for W: the trainer's pages once, then each worker's own pages
    mem = sampler.summary({"workers": lambda p: p != me}, before, {
        "worker_private": private, "rank": lambda sweep, x: x["total"] + (rank_w - w) * private(sweep, x)})
    how = ("rank measured" if w == rank_w
           else f"trainer + {w} worker measured, rank = that + {rank_w - w} x the worker's own pages")
    return {"sources": cfg["sources"], "workers": rank_w, "measured_workers": w, "batch": cfg["batch"], "how": how,
            "row_group_mib": cfg["row_group_mib"],
            "trainer_before_mib": {"anon": round(before[0], 1), "file": round(before[1], 1)},
            "processes": len(pids), "pids": pids, "pids_seen": seen, "batches": 2 * warm,
            "tokens_steady": tokens, "sweeps": len(sampler.sweeps), "seconds": round(time.perf_counter() - t0, 1),
            "first_batch_s": round(first_s, 2), "start_method": dl.multiprocessing_context or "default (fork)",
            "worker_pss_mib": {k: round(v / w, 1) for k, v in mem["workers"].items()},
            "worker_private_mib": mem["worker_private"], "per_rank_mib": mem["rank"],
            "measured_total_mib": mem["total"], "file_mib": mem["file"], "pss_mib": mem["pss"],
            "anon_breakdown": breakdown}


def _sources(cfg: dict) -> list:
    import torchdata_overlord as ol

    tok = ol.Tokenize(cfg["spm"], field="text")
    return [ol.ParquetSource(f"s{i:03d}", f, tok, seed=i) for i, f in enumerate(cfg["files"])]


def run_profile(cfg: dict) -> dict:
    """The cold profile of the job's sources, as ``placement="auto"`` would take it, into the journal the
    job will read (``$TORCHDATA_OVERLORD_CACHE``): its time and this process's memory growth."""
    _common_imports()
    os.environ["TORCHDATA_OVERLORD_CACHE"] = cfg["cache"]
    from torchdata_overlord.scaling.journal import ProfileJournal, default_journal_dir
    from torchdata_overlord.scaling.profile import profile_sources

    me = os.getpid()
    before = smaps(me)
    sampler = Sampler(cfg["interval"])
    sampler.start()
    try:
        sources = _sources(cfg)
        t0 = time.perf_counter()
        profiles = profile_sources(sources, ProfileJournal(default_journal_dir()))
        seconds = time.perf_counter() - t0
        sampler.finish()
    finally:
        sampler.finish()
    mem = sampler.summary({}, before)["total"]
    return {"sources": cfg["sources"], "seconds": round(seconds, 2), "peak_mib": mem["peak"],
            "end_mib": round(smaps(me)[0] - before[0], 1), "pids_seen": [me],
            "group_mib_max": round(max(p.group_bytes for p in profiles.values()) / 2**20, 2),
            "transform_ms_median": round(1e3 * statistics.median(p.transform_s for p in profiles.values()), 3)}


def run_library(cfg: dict) -> dict:
    """One OverlordLoader(runtime="rpc") job with S sources on a dp=D mesh at its default placement: PSS
    of every role process, the helpers and the trainer's client over time, the placement and the time
    to the first batch."""
    _common_imports()
    os.environ["TORCHDATA_OVERLORD_CACHE"] = cfg["cache"]         # the journal the profile run wrote
    import torchdata_overlord as ol
    from torchdata_overlord.sim.fault_run import Strategy

    me = os.getpid()
    journal = Path(cfg["cache"], "profiles")
    journal_entries = len(list(journal.glob("*.json"))) if journal.is_dir() else 0
    before = smaps(me)
    sampler = Sampler(cfg["interval"])
    sampler.start()
    t0 = time.perf_counter()
    breakdown = {}
    try:
        sources = _sources(cfg)
        t_open = time.perf_counter()
        mesh = ol.ClientPlaceTree(dp=cfg["dp"], cp=cfg.get("cp", 1), pp=cfg.get("pp", 1))
        with ol.OverlordLoader(sources, Strategy([s.name for s in sources]), mesh, rank=None,
                               global_batch=cfg["global_batch"], seq_len=None, runtime="rpc", prefetch=2,
                               buffer_size=cfg["buffer"], timeout=120,
                               startup_timeout=cfg["startup_timeout"]) as loader:
            t_built = time.perf_counter()
            placement = loader.placement.to_dict()
            it = iter(loader)
            next(it)
            t_first = time.perf_counter()
            sampler.mark("warm")
            for _ in range(cfg["warm"] - 1):
                next(it)
            sampler.mark("steady")
            for _ in range(cfg["steady"]):
                next(it)
                sampler.sweep()
            stats = loader.stats()
            breakdown = {str(p): anon_breakdown(p) for p in process_tree(me)}
            sampler.finish()
    finally:
        sampler.finish()
    roles = stats["roles"]
    role_pids = set(roles.values())
    seen = sorted({p for _, s in sampler.sweeps for p in s})
    helpers = [p for p in seen if p != me and p not in role_pids]
    by_pid = sampler.summary({str(p): (lambda q, p=p: q == p) for p in seen}, before)
    mem = sampler.summary({"trainer": lambda p: p == me, "roles": lambda p: p in role_pids,
                           "helpers": lambda p: p in helpers, "plane": lambda p: p != me}, before)
    client = {k: round(v - before[0], 1) for k, v in mem.pop("trainer").items()}
    count = {k: sum(1 for a in roles if a.split(":")[0] == k) for k in ("planner", "loader", "constructor")}
    processes = []
    for p in seen:
        actors = {k: sum(1 for a, q in roles.items() if q == p and a.split(":")[0] == k)
                  for k in ("planner", "loader", "constructor")}
        processes.append({"pid": p, "what": "trainer" if p == me else "roles" if p in role_pids else "helper",
                          "actors": actors, "cmdline": _cmdline(p) if p in helpers else None,
                          "anon_mib": by_pid[str(p)], "anon_breakdown": breakdown.get(str(p))})
    held = sum(s.get("buffer_bytes", 0) for s in stats["sources"].values())
    return {"sources": cfg["sources"], "dp": cfg["dp"], "cp": cfg.get("cp", 1), "pp": cfg.get("pp", 1),
            "row_group_mib": cfg["row_group_mib"],
            "trainer_before_mib": {"anon": round(before[0], 1), "file": round(before[1], 1)},
            "roles": {a: int(p) for a, p in roles.items()}, "role_processes": len(role_pids),
            "placement": placement, "journal_entries_before": journal_entries,
            "open_sources_s": round(t_open - t0, 2), "loader_built_s": round(t_built - t_open, 2),
            "startup_s": round(t_first - t_open, 2),
            "counts": {**count, "helpers": len(helpers)}, "helper_cmdlines": [_cmdline(p) for p in helpers],
            "pids": sorted(role_pids | set(helpers) | {me}), "pids_seen": seen, "steps": cfg["warm"] + cfg["steady"],
            "sweeps": len(sampler.sweeps), "seconds": round(time.perf_counter() - t0, 1),
            "plane_mib": mem.pop("plane"), "client_mib": client, "total_mib": mem.pop("total"),
            "roles_mib": mem.pop("roles"), "helpers_mib": mem.pop("helpers"),
            "file_mib": mem.pop("file"), "pss_mib": mem.pop("pss"), "by_process": processes,
            "held_by_sources_mib": round(held / 2**20, 1),
            "buffered_samples": sum(s.get("buffered", 0) for s in stats["sources"].values())}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


# ------------------------------------------------------------------------------ the sweep (parent process)

class Skipped(Exception):
    """A run not started, or stopped, because the machine could not spare its memory."""


def meminfo() -> dict[str, float]:
    """``/proc/meminfo`` in MiB."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) / 1024
    return out


def spare_mib() -> float:
    """What one run may take now: MemAvailable less the reserve, at most a share of the machine."""
    m, g = meminfo(), MEMORY_GUARD
    return min(m["MemAvailable"] - g["reserve_gib"] * 1024, g["share_of_total"] * m["MemTotal"])


def expected_mib(row_group_mib: float, sources: int, holders: int, processes: int) -> float:
    """A guess of a run's footprint: ``holders`` copies of S decoded row groups plus ``processes``
    process bases (from the 1 and 8 MiB measurements, on the high side)."""
    g = MEMORY_GUARD
    return holders * sources * (g["per_source_per_mib"] * row_group_mib + g["per_source_base_mib"]) \
        + processes * g["per_process_mib"]


def _kill_tree(pid: int) -> None:
    for p in reversed(process_tree(pid)):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def child(kind: str, cfg: dict, timeout: float) -> dict:
    """Run ``run_<kind>(cfg)`` in a fresh process (each run starts from the same footprint), killed
    (:class:`Skipped`) if ``MemAvailable`` falls below the guard's floor; its result, after checking
    that every process it recorded is gone."""
    floor = MEMORY_GUARD["floor_gib"] * 1024
    with tempfile.TemporaryDirectory(prefix="overlord-mem-") as tmp:
        (Path(tmp) / "cfg.json").write_text(json.dumps(cfg))
        out, err = Path(tmp) / "out.json", Path(tmp) / "stderr"
        with open(err, "w") as stderr:
            proc = subprocess.Popen([sys.executable, __file__, "--child", kind, str(Path(tmp) / "cfg.json"), str(out)],
                                    stdout=subprocess.DEVNULL, stderr=stderr, cwd=str(ROOT))
            deadline, low = time.monotonic() + timeout, None
            while True:
                try:
                    proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                avail = meminfo()["MemAvailable"]
                if avail < floor or time.monotonic() > deadline:
                    low = avail if avail < floor else None
                    _kill_tree(proc.pid)
                    proc.wait()
                    break
        if low is not None:
            raise Skipped(f"killed: MemAvailable fell to {low:.0f} MiB (floor {floor:.0f} MiB)")
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{kind} run failed (rc {proc.returncode}): {err.read_text()[-3000:]}")
        rep = json.loads(out.read_text())
    left = reap(rep["pids_seen"])
    if left:
        raise RuntimeError(f"{kind} run left processes behind: {left} (killed)")
    return rep


def fit_line(points: dict[int, float]) -> dict:
    """Least-squares ``intercept + slope x S`` over ``{S: MiB}``, with each point's residual."""
    xs, ys = list(points), list(points.values())
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if n > 1 and sxx else 0.0
    a = my - slope * mx
    return {"intercept": round(a, 3), "slope": round(slope, 4),
            "residuals": {str(x): round(y - (a + slope * x), 1) for x, y in zip(xs, ys)}}


def fit_units(points: list[tuple[int, int, float]]) -> dict:
    """Least squares ``intercept + per_source x S + per_dp x D`` over ``(S, D, MiB)`` points (no
    ``per_dp`` term when every point has the same D), with each point's residual."""
    import numpy as np

    ds = {d for _, d, _ in points}
    names = ["intercept", "per_source"] + (["per_dp"] if len(ds) > 1 else [])
    x = np.array([[1.0, s, d][:len(names)] for s, d, _ in points])
    y = np.array([v for _, _, v in points])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    coef = {n: round(float(c), 3) for n, c in zip(names, coef)}
    return {"coef": coef, "residuals": [{"sources": s, "dp": d, "mib": round(v - fitted(coef, s, d), 1)}
                                        for s, d, v in points]}


def fitted(coef: dict, s: int, d: int) -> float:
    return coef["intercept"] + coef["per_source"] * s + coef.get("per_dp", 0.0) * d


def library_fits(measured: list[dict]) -> dict | None:
    """For the plane (roles + helpers) and the client, each figure in :data:`KEYS`: per-unit costs
    fitted over every measured job (per source, per DP group, and what is left); None with too few
    jobs (two values of S, and a third job when D varies)."""
    ss, ds = {m["sources"] for m in measured}, {m["dp"] for m in measured}
    if len(ss) < 2 or len(measured) < 2 + (len(ds) > 1):
        return None
    return {part: {k: fit_units([(m["sources"], m["dp"], m[f"{part}_mib"][k]) for m in measured]) for k in KEYS}
            for part in ("plane", "client")}


def colocated_lines(colocated: list[dict], dw: list) -> list[dict]:
    """Per (D, W): one rank's MiB as a line in S, where two values of S were measured."""
    out = []
    for d, w in dw:
        pts = {m["sources"]: m for m in colocated if m["workers"] == w and m["batch"] == GLOBAL_BATCH // d}
        if len(pts) >= 2:
            out.append({"dp": d, "workers": w, "batch": GLOBAL_BATCH // d,
                        **{k: fit_line({s: m["per_rank_mib"][k] for s, m in pts.items()}) for k in KEYS}})
    return out


def derive(plan: dict, colocated: list[dict], library: list[dict], fits: dict | None) -> list[dict]:
    """One row per (S, D, W, CP, PP) with a measured colocated rank: both sides' totals from the measured
    units, and how. colocated = ranks x one rank; library = plane + ranks x client, from the job
    measured at (S, D), else from the fitted per-unit costs (fitted, or extrapolated beyond every
    measured S; no row without a fit)."""
    rows = []
    for s in plan["sources"]:
        for d, w in plan["dw"]:
            rank = next((m for m in colocated if m["sources"] == s and m["workers"] == w
                         and m["batch"] == GLOBAL_BATCH // d), None)
            lib = next((m for m in library if m["sources"] == s and m["dp"] == d), None)
            if rank is None or (lib is None and fits is None):
                continue
            if lib is not None:
                plane, client, how = lib["plane_mib"], lib["client_mib"], "measured"
            else:
                plane, client = ({k: round(fitted(fits[part][k]["coef"], s, d), 1) for k in KEYS}
                                 for part in ("plane", "client"))
                how = "fitted" if s <= max(m["sources"] for m in library) else "extrapolated"
            near = [m for m in library if m["dp"] == d] or library
            helpers = max(m["counts"]["helpers"] for m in near)
            procs = lib["role_processes"] if lib else max(m["role_processes"] for m in near)
            for cp, pp in plan["cp_pp"]:
                ranks = d * cp * pp
                col = {k: round(ranks * rank["per_rank_mib"][k], 1) for k in KEYS}
                libt = {k: round(plane[k] + ranks * client[k], 1) for k in KEYS}
                rows.append({"sources": s, "dp": d, "workers": w, "cp": cp, "pp": pp, "ranks": ranks,
                             "colocated_mib": col, "colocated_processes": ranks * (1 + w),
                             "colocated_how": rank["how"], "library_mib": libt,
                             "library_processes": procs + helpers + ranks, "library_role_processes": procs,
                             "library_roles": how, "ratio": {k: round(col[k] / libt[k], 2) for k in KEYS}})
    return rows


def crossovers(rows: list[dict], lines: list[dict], fits: dict | None) -> list[dict]:
    """Per (D, W, CP, PP) and for steady and peak: the swept S where the library uses less, and the S
    where the two lines cross (colocated per rank and the library's plane and client, linear in S)."""
    out = []
    for key in sorted({(r["dp"], r["workers"], r["cp"], r["pp"]) for r in rows}):
        d, w, cp, pp = key
        mine = sorted((r for r in rows if (r["dp"], r["workers"], r["cp"], r["pp"]) == key), key=lambda r: r["sources"])
        line = next((x for x in lines if (x["dp"], x["workers"]) == (d, w)), None)
        ranks = d * cp * pp
        entry = {"dp": d, "workers": w, "cp": cp, "pp": pp, "ranks": ranks}
        for k in ("steady", "peak"):
            wins = [r["sources"] for r in mine if r["library_mib"][k] < r["colocated_mib"][k]]
            where = None
            if line is not None and fits is not None:
                col, pl, cl = line[k], fits["plane"][k]["coef"], fits["client"][k]["coef"]
                # colocated - library = a + b S
                a = ranks * col["intercept"] - fitted(pl, 0, d) - ranks * fitted(cl, 0, d)
                b = ranks * col["slope"] - pl["per_source"] - ranks * cl["per_source"]
                if b > 0:
                    where = "library uses less at every S" if a >= 0 else round(-a / b, 1)
                else:
                    where = "library never uses less" if a < 0 else "library uses less at small S only"
            entry[k] = {"library_wins_at": wins, "smallest_swept_s": wins[0] if wins else None,
                        "crossover_s_fitted": where, "ratio_at_largest_s": mine[-1]["ratio"][k],
                        "ratio_at_smallest_s": mine[0]["ratio"][k]}
        out.append(entry)
    return out


def per_source_costs(lines: list[dict], fits: dict | None) -> dict:
    """Steady MiB per source: in every colocated worker, and per Source Loader in the library."""
    if not lines or fits is None:
        return {}
    per_worker = statistics.mean(f["steady"]["slope"] / f["workers"] for f in lines)
    coef = fits["plane"]["steady"]["coef"]
    return {"colocated_mib_per_worker_per_source": round(per_worker, 2),
            "library_mib_per_loader": coef["per_source"], "library_mib_per_constructor": coef.get("per_dp"),
            "library_mib_once": coef["intercept"],
            "break_even_workers": round(coef["per_source"] / per_worker, 1) if per_worker > 0 else None}


def check_targets(sizes: list[dict]) -> list[dict]:
    """Each of :data:`TARGETS` whose row-group size was run: its row's figures and whether it is met."""
    out = []
    for t in TARGETS:
        size = next((z for z in sizes if z["row_group_mib"] == t["row_group_mib"]), None)
        if size is None:
            continue
        row = next((r for r in size["rows"] if (r["sources"], r["dp"], r["workers"], r["cp"], r["pp"])
                    == (t["sources"], t["dp"], t["workers"], 1, 1)), None)
        lib = next((m for m in size["library_measured"] if (m["sources"], m["dp"]) == (t["sources"], t["dp"])), None)
        entry = {**t, "met": False}
        if "max_library_mib" in t:
            if lib is None:
                why = size["skipped"].get(_lib_name(t["sources"], t["dp"]))
                entry["why"] = "library job not measured" + (f" ({why})" if why else "")
            else:
                total = {k: round(lib["plane_mib"][k] + t["dp"] * lib["client_mib"][k], 1) for k in KEYS}
                entry.update(library_mib=total, measured=True,
                             met=all(total[k] <= t["max_library_mib"] for k in t["keys"]))
        elif row is None:
            entry["why"] = "no row (a side was not measured)"
        else:
            entry.update(colocated_mib=row["colocated_mib"], library_mib=row["library_mib"], ratio=row["ratio"],
                         library_roles=row["library_roles"], colocated_how=row["colocated_how"],
                         met=all(row["ratio"][k] >= t["min_ratio"] for k in t["keys"]))
        out.append(entry)
    return out


def _lib_name(s: int, d: int) -> str:
    return f"library S={s} D={d}"


def corpus_root(size: str, mib: float, base_root: Path | None = None) -> Path:
    """The corpus folder of one size and row-group size (``startup.py`` and ``elastic.py`` read the one
    configured like theirs, 2 files x 2 row groups per source)."""
    from torchdata_overlord.sim.corpus import default_corpus_root

    return (base_root or default_corpus_root().parent / f"memory-corpus-{size}") / f"rg-{mib:g}mib"


def sweep(size: str, mib: float, base_root: Path, interval: float, errors: dict) -> dict:
    """Every measured run of one row-group size, and what is derived from them."""
    plan = plan_for(size, mib)
    # no corpus for an S whose every run (one copy of its row groups at least) would be skipped anyway
    room_now = spare_mib()
    wanted = sorted(set(plan["sources"] + plan["library_sources"] + [s for s, _ in plan["library_extra"]]))
    n_max = max([s for s in wanted if expected_mib(mib, s, 1, 2) <= room_now] or wanted[:1])
    root = corpus_root(size, mib, base_root)
    print(f"\n=== row groups of {mib:g} MiB ===", flush=True)
    corpus = build_corpus(root, n_max, mib, plan["files"], plan["row_groups"])
    files = [[str(Path(corpus["root"], f)) for f in fs] for fs in corpus["files"]]
    base = {"spm": str(Path(corpus["root"], corpus["spm"])), "interval": interval, "seed": 0, "row_group_mib": mib}
    colocated, library, skipped, profiles = [], [], {}, {}
    tag = f"{mib:g} MiB: "

    def attempt(name, kind, cfg, into, expect):
        t0 = time.perf_counter()
        try:
            if cfg["sources"] > n_max:
                raise Skipped(f"not started: one copy of its row groups alone was expected to take "
                              f"~{expected_mib(mib, cfg['sources'], 1, 2):,.0f} MiB, the machine could spare "
                              f"{room_now:,.0f} MiB (its corpus was not written)")
            room = spare_mib()
            if expect > room:
                raise Skipped(f"not started: expected ~{expect:,.0f} MiB, the machine can spare {room:,.0f} MiB now")
            into.append(child(kind, cfg, timeout=RUN_TIMEOUT))
            r = into[-1]
            fig = (r["per_rank_mib"] if kind == "colocated" else r["total_mib"] if kind == "library"
                   else {"peak": r["peak_mib"], "steady": r["end_mib"]})
            extra = f", {r['how']}" if kind == "colocated" else (f", startup {r['startup_s']:.1f} s, "
                                                                 f"{r['role_processes']} role process(es)"
                                                                 if kind == "library" else f", {r['seconds']:.1f} s")
            print(f"  {name}: peak {fig['peak']:,.0f} MiB, steady {fig['steady']:,.0f} MiB "
                  f"({time.perf_counter() - t0:.1f} s{extra})", flush=True)
            return True
        except Skipped as e:
            skipped[name] = str(e)
            print(f"  {name}: SKIPPED {e}", flush=True)
        except Exception as e:   # noqa: BLE001 (recorded; the exit status says a run failed)
            errors[tag + name] = f"{type(e).__name__}: {e}"
            print(f"  {name}: FAILED {errors[tag + name][:400]}", flush=True)
        return False

    print("colocated, one rank measured (trainer + W DataLoader workers):", flush=True)
    for s in plan["sources"]:
        for d, w in plan["dw"]:
            name = f"colocated S={s} W={w} batch={GLOBAL_BATCH // d}"
            cfg = dict(base, files=files[:s], sources=s, workers=w, batch=GLOBAL_BATCH // d)
            mw = w if expected_mib(mib, s, w, 1 + w) <= spare_mib() else 1
            attempt(name, "colocated", dict(cfg, measured_workers=mw), colocated, expected_mib(mib, s, mw, 1 + mw))
    print("library, measured jobs (cold profile, then the job at its default placement):", flush=True)
    lib = dict(base, global_batch=GLOBAL_BATCH, buffer=BUFFER, startup_timeout=STARTUP_TIMEOUT, **STEPS)
    jobs = [(s, d, 1, 1) for d in sorted({d for d, _ in plan["dw"]}) for s in plan["library_sources"]]
    jobs += [(s, d, 1, 1) for s, d in plan["library_extra"] if (s, d, 1, 1) not in jobs]
    mesh_check = []
    if plan["library_mesh_check"]:
        jobs.append(tuple(plan["library_mesh_check"]))
    for s, d, cp, pp in jobs:
        with tempfile.TemporaryDirectory(prefix="overlord-mem-cache-") as cache:
            cfg = dict(lib, files=files[:s], sources=s, dp=d, cp=cp, pp=pp, cache=cache)
            expect = expected_mib(mib, s, 1, 3) + MEMORY_GUARD["library_fixed_mib"]
            name = _lib_name(s, d) + (f" CP={cp} PP={pp} (every rank's output fetched by this trainer)"
                                      if (cp, pp) != (1, 1) else "")
            got: list = []
            if not attempt(f"profile S={s}", "profile", cfg, got, expected_mib(mib, 8, 1, 1)):
                if f"profile S={s}" in skipped:
                    skipped[name] = skipped.pop(f"profile S={s}")
                continue
            into = mesh_check if (cp, pp) != (1, 1) else library
            if attempt(name, "library", cfg, into, expect):
                into[-1]["profile"] = got[0]

    fits = library_fits(library)
    rows = derive(plan, colocated, library, fits)
    lines = colocated_lines(colocated, plan["dw"])
    check = None
    if mesh_check:
        m = mesh_check[0]
        flat = next((x for x in library if (x["sources"], x["dp"]) == (m["sources"], m["dp"])), None)
        if flat is not None:
            check = {"sources": m["sources"], "dp": m["dp"], "cp": m["cp"], "pp": m["pp"],
                     "plane_mib": m["plane_mib"], "plane_mib_cp1_pp1": flat["plane_mib"],
                     "client_mib": m["client_mib"], "client_mib_cp1_pp1": flat["client_mib"], "run": m}
    return {"row_group_mib": mib,
            "config": {**plan, "rows_per_row_group": corpus["rows_per_row_group"], "row_group_kib": round(mib * 1024),
                       "files": corpus["config"]["files"], "row_groups": corpus["config"]["row_groups"],
                       "mean_doc_bytes": corpus["mean_doc_bytes"], "corpus": corpus["root"],
                       "corpus_disk_mib": corpus.get("disk_mib")},
            "colocated_measured": colocated, "colocated_fit": lines, "library_measured": library,
            "library_fit": fits, "library_mesh_check": check, "per_source": per_source_costs(lines, fits),
            "rows": rows, "crossover": crossovers(rows, lines, fits), "skipped": skipped}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="row groups of 64 and 256 KiB, S in {4, 10}, one (D, W) "
                                                         "(CI smoke)")
    ap.add_argument("--row-group-mib", type=float, nargs="+", default=None, metavar="MIB",
                    help="row-group sizes to sweep, MiB of decoded text (default: 1 8 64; --quick: 0.0625 0.25)")
    ap.add_argument("--out", type=Path, default=RESULTS / "memory.json")
    ap.add_argument("--root", type=Path, default=None,
                    help="folder of the corpora, one per row-group size (default: beside the demo corpus cache)")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between PSS sweeps")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "CFG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, cfg_path, out_path = args.child
        run = {"colocated": run_colocated, "library": run_library, "profile": run_profile}[kind]
        Path(out_path).write_text(json.dumps(run(json.loads(Path(cfg_path).read_text()))))
        return 0

    size = "quick" if args.quick else "full"
    mibs = args.row_group_mib or SIZES[size]["row_group_mib"]
    t_all, load_start = time.perf_counter(), round(os.getloadavg()[0], 2)
    errors: dict = {}
    sizes = [sweep(size, mib, args.root, args.interval, errors) for mib in mibs]
    targets = check_targets(sizes)
    for z in sizes:
        print_table(z)
    print_targets(targets)
    plot_path = args.out.with_suffix(".png")
    if any(z["rows"] for z in sizes):
        plot(plot_path, sizes)
        print(f"plot: {plot_path}")
    out = {"benchmark": "memory", "quick": args.quick,
           "config": {"row_group_mib": mibs, "global_batch": GLOBAL_BATCH, "buffer_size": BUFFER,
                      "interval_s": args.interval, "library_steps": STEPS, "strategy": STRATEGY,
                      "memory_guard": MEMORY_GUARD, "memory_total_mib": round(meminfo()["MemTotal"])},
           "method": METHOD, "sizes": sizes, "targets": targets, "paper_ratio": PAPER_RATIO,
           "skipped": {f"{z['row_group_mib']:g} MiB: {k}": v for z in sizes for k, v in z["skipped"].items()},
           "errors": errors, "plot": str(plot_path) if any(z["rows"] for z in sizes) else None}
    write_results(args.out, out, started=t_all, load_start=load_start)
    return 1 if errors else 0


def print_table(z: dict) -> None:
    """One size's rows, crossovers, per-source costs and CP/PP check, as the run ends."""
    print(f"\nrow groups of {z['row_group_mib']:g} MiB ({z['config']['rows_per_row_group']} rows): sum of anonymous "
          f"PSS in MiB (peak / steady); colocated = ranks x one rank, library = roles + ranks x client\n"
          f"{'S':>4} {'D x W':>6} {'CP x PP':>7} {'colocated':>19} {'library':>17} {'ratio':>11}  library roles")
    for r in z["rows"]:
        c, lb, q = r["colocated_mib"], r["library_mib"], r["ratio"]
        print(f"{r['sources']:>4} {r['dp']:>2} x {r['workers']:<2} {r['cp']:>3} x {r['pp']:<2} "
              f"{c['peak']:>9,.0f} / {c['steady']:>7,.0f} {lb['peak']:>7,.0f} / {lb['steady']:>7,.0f} "
              f"{q['peak']:>5.2f}/{q['steady']:<5.2f}  {r['library_roles']}"
              + ("" if r["colocated_how"] == "rank measured" else "  (colocated: one worker measured)"))
    for c in z["crossover"]:
        st, pk = c["steady"], c["peak"]
        print(f"  D={c['dp']} W={c['workers']} CP={c['cp']} PP={c['pp']}: steady: library uses less at swept S "
              f"{st['library_wins_at']} (fitted crossover: {st['crossover_s_fitted']}); peak: at "
              f"{pk['library_wins_at']} (fitted: {pk['crossover_s_fitted']})")
    u = z["per_source"]
    if u:
        print(f"  per source (steady): {u['colocated_mib_per_worker_per_source']:.2f} MiB in every colocated worker, "
              f"{u['library_mib_per_loader']:.1f} MiB per Source Loader in the library: the library's is smaller "
              f"once D x CP x PP x W > {u['break_even_workers']}")
    check = z["library_mesh_check"]
    if check:
        print(f"  CP/PP check, S={check['sources']} D={check['dp']}: roles {check['plane_mib']['steady']} MiB steady "
              f"with CP={check['cp']} PP={check['pp']}, {check['plane_mib_cp1_pp1']['steady']} MiB with CP=PP=1")
    for name, why in z["skipped"].items():
        print(f"  skipped {name}: {why}")


def print_targets(targets: list[dict]) -> None:
    for t in targets:
        if "max_library_mib" in t:
            fig = (f"library {t['library_mib']['peak']:,.0f} MiB peak / {t['library_mib']['steady']:,.0f} steady"
                   if "library_mib" in t else t.get("why", ""))
        else:
            fig = (f"ratio {t['ratio']['steady']:.2f}x steady, {t['ratio']['peak_running']:.2f}x peak after start, "
                   f"{t['ratio']['peak']:.2f}x peak" if "ratio" in t else t.get("why", ""))
        print(f"target {'MET' if t['met'] else 'MISSED'}: {t['name']}: {fig}")


def plot(path: Path, sizes: list[dict]) -> None:
    """Steady total (GiB) against S, one panel per row-group size: a colour per (D, W, CP, PP), colocated
    solid, library dashed (hollow markers: library rows from the fitted costs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    sizes = [z for z in sizes if z["rows"]]
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 5.5), squeeze=False)
    keys = sorted({(r["dp"], r["workers"], r["cp"], r["pp"]) for z in sizes for r in z["rows"]})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax, z in zip(axes[0], sizes):
        for i, key in enumerate(keys):
            mine = sorted((r for r in z["rows"] if (r["dp"], r["workers"], r["cp"], r["pp"]) == key),
                          key=lambda r: r["sources"])
            if not mine:
                continue
            xs, c = [r["sources"] for r in mine], colours[i % len(colours)]
            first = ax is axes[0][0]
            ax.plot(xs, [r["colocated_mib"]["steady"] / 1024 for r in mine], "-o", color=c,
                    label=f"D={key[0]} W={key[1]} CP={key[2]} PP={key[3]}: colocated" if first else None)
            ax.plot(xs, [r["library_mib"]["steady"] / 1024 for r in mine], "--", color=c,
                    label=f"D={key[0]} CP={key[2]} PP={key[3]}: library" if first else None)
            for r in mine:
                ax.plot(r["sources"], r["library_mib"]["steady"] / 1024, "s", color=c,
                        fillstyle="none" if r["library_roles"] != "measured" else "full")
        ax.set(xscale="log", yscale="log", xlabel="sources S", ylabel="sum of anonymous PSS, steady (GiB)",
               title=f"row groups of {z['row_group_mib']:g} MiB")
        ax.set_xticks(sorted({r["sources"] for r in z["rows"]}))
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", lw=0.3)
    fig.suptitle("colocated DataLoaders (solid: one rank measured, x ranks) against the library's roles at the "
                 "default placement + a client per rank (dashed; hollow: fitted)", fontsize=10)
    fig.legend(loc="lower center", ncol=min(4, 2 * len(keys)), fontsize=8)
    fig.tight_layout(rect=(0, 0.02 + 0.04 * -(-2 * len(keys) // 4), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
