"""Memory: disaggregated against colocated loading (paper 7.2, 7.4, Fig. 12, 14, 15).

Both sides read the same S sources of real Parquet files (text rows in row groups of about
``row_group_kib``, written once under a cache folder) with ``ParquetSource`` (pyarrow: every file's
footer, one open file and one decoded row group per source) and tokenize every sample with the same
sentencepiece ``Tokenize``. A sampler thread reads ``/proc/<pid>/smaps_rollup`` of every process in
the run's tree every ``--interval`` s: *peak* is the largest sum seen (``peak_running``: after the
first batch, i.e. without start-up), *steady* the median of the sums after warm-up.

What is summed: anonymous PSS (``Pss_Anon + Pss_Shmem``; pages shared after a fork are split among
the sharers, so the sum counts each once), minus the trainer's own before the loader was built, so
the trainer's imports (torch, pyarrow, sentencepiece, this package) count on neither side.
File-backed PSS (shared libraries) is recorded per measured run (``file_mib``; ``pss_mib`` is both)
but not in the totals: every trainer rank on a node maps the same libraries whichever loader it uses,
so they do not multiply with ranks, and on a shared machine their PSS moves by hundreds of MiB as
other processes map libtorch.

* colocated (the baseline): one trainer rank runs ``torch.utils.data.DataLoader(num_workers=W)``
  over an ``IterableDataset`` in which every worker opens all S sources and mixes them round-robin.
  Measured: one rank, in a fresh process (the trainer plus W forked workers), warmed up until every
  worker has drawn from every source (so each holds S row groups). Derived: a job of D x CP x PP
  ranks runs one such DataLoader per rank (the parallelism redundancy: CP and PP ranks load the same
  data again), so its total is ranks x the measured rank.
* this library: ``OverlordLoader(runtime="rpc", rank=None)`` on a ``dp=D`` mesh at its default
  placement: the Planner, one Source Loader per source and one Data Constructor per DP group as
  actors in as many worker processes as the cores the trainer leaves free (at most one per role),
  forked from the runtime's fork server (it and multiprocessing's resource tracker are counted as
  helpers).
  Measured: a real job per (S, D) for S in ``library_sources`` and each (S, D) in ``library_extra``; *plane* = every process but the
  trainer, *client* = the trainer's growth (its RPC agent, sources' footers, fetched batches).
  Derived: the roles do not depend on CP, PP or W (a measured job on a CP x PP mesh checks it);
  every trainer rank of a real job is a client of its own, so total = plane + ranks x client. For an
  (S, D) not measured, plane and client come from per-unit costs fitted over all measured jobs
  (least squares: intercept + per source x S + per DP group x D; coefficients and residuals in the
  JSON) and the row says ``fitted`` (``extrapolated`` for an S beyond every measured one).

Derived peaks add per-unit peaks, as if every unit peaked at once (an upper bound, on both sides).
Prints a table, writes ``benchmarks/results/memory.json`` and ``memory.png``; exits non-zero if a run
failed or left a process behind, never because a figure disappointed.

    python benchmarks/memory.py                           # S in {10, 50, 100, 300}, (D, W) in {(4, 2), (8, 4)}
    python benchmarks/memory.py --quick --out /tmp/m.json  # CI smoke: S in {4, 10}, (4, 2), small row groups
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
from common import write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
PAPER_RATIO = 13.5
SIZES = {
    "full": {"sources": [10, 50, 100, 300], "dw": [[4, 2], [8, 4]], "cp_pp": [[1, 1], [4, 1], [4, 4]],
             "library_sources": [10, 50, 100], "library_extra": [[300, 4]], "library_mesh_check": [10, 4, 4, 4],   # [S, D, CP, PP]
             "row_group_kib": 1024, "files": 2, "row_groups": 2},
    "quick": {"sources": [4, 10], "dw": [[4, 2]], "cp_pp": [[1, 1], [4, 4]],
              "library_sources": [4, 10], "library_extra": [], "library_mesh_check": None, "row_group_kib": 64, "files": 2, "row_groups": 2},
}
GLOBAL_BATCH = 64          # samples per step over the DP ranks: a colocated rank's batch is GLOBAL_BATCH // D
KEYS = ("peak", "peak_running", "steady")     # whole run, after the first batch, median after warm-up
STEPS = {"warm": 3, "steady": 8}                # library steps: warm-up (buffers filled), then measured
STRATEGY = "torchdata_overlord.sim.fault_run.Strategy: equal Constant mix, distribute DP, greedy balance"
BUFFER = 16                # a Source Loader's buffer (samples): the library's read-ahead per source
CORPUS_VERSION = 1
STARTUP_TIMEOUT = 600      # 300 loader processes take ~1-2 min to start and fill on 2 cores
METHOD = {
    "metric": "sum over every process of Pss_Anon + Pss_Shmem (smaps_rollup), minus the trainer's before the "
              "loader existed; file-backed PSS (shared libraries) is per run in file_mib / pss_mib, not in totals",
    "colocated": "measured: one rank (trainer + W forked DataLoader workers, each holding all S sources); "
                 "derived: D x CP x PP ranks x that rank",
    "library": "measured: one rpc job per (S, D): plane = Planner + S loaders + D constructors + fork server + "
               "resource tracker, client = the trainer's growth; derived: plane + D x CP x PP x client; S not "
               "measured: least squares intercept + per_source x S + per_dp x D over the measured jobs (fitted; extrapolated beyond the largest measured S)",
    "peak": "largest sum over the run (peak_running: after the first batch); derived peaks add per-unit peaks",
    "steady": "median sum after warm-up",
}


# ------------------------------------------------------------------------------ the corpus

def build_corpus(root: Path, n_sources: int, row_group_kib: int, files: int, row_groups: int, seed: int = 0) -> dict:
    """S sources of text rows in real Parquet files under ``root`` (reused while the configuration
    matches its manifest), plus a sentencepiece model trained on the same text; the manifest."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchdata_overlord.testing import make_text_corpus, train_sentencepiece

    config = {"version": CORPUS_VERSION, "sources": n_sources, "row_group_kib": row_group_kib, "files": files,
              "row_groups": row_groups, "seed": seed}
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        if manifest["config"] == config and all(Path(root, f).is_file() for fs in manifest["files"] for f in fs):
            return {**manifest, "root": str(root)}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if root.exists():
        ours = re.compile(r"manifest\.json|tokenizer\.(model|vocab)|s\d{3}")
        foreign = [p.name for p in root.iterdir() if not ours.fullmatch(p.name)]
        if foreign:
            raise RuntimeError(f"{root} holds files this benchmark did not write ({foreign[:3]}); pass another --root")
    t0 = time.perf_counter()
    tmp = root.parent / f".{root.name}.build-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        rng = np.random.default_rng(seed)
        sentences = make_text_corpus(20_000, seed=seed, min_words=8, max_words=30)
        sizes = np.clip(rng.lognormal(np.log(12), 0.6, 4000), 2, 80).astype(int)     # sentences per document
        pool = [" ".join(sentences[j] for j in rng.integers(0, len(sentences), k)) for k in sizes]
        train_sentencepiece(pool[:1500], tmp / "tokenizer", vocab_size=1000)
        mean_bytes = sum(map(len, pool)) / len(pool)
        per_rg = max(8, round(row_group_kib * 1024 / mean_bytes))
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
            out.append(paths)
        manifest = {"config": config, "files": out, "spm": "tokenizer.model", "rows_per_row_group": per_rg,
                    "mean_doc_bytes": round(mean_bytes, 1), "build_s": round(time.perf_counter() - t0, 1)}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        if root.exists():
            shutil.rmtree(root)
        os.rename(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"corpus: {n_sources} sources x {files} files x {row_groups} row groups of {per_rg} rows "
          f"(~{row_group_kib} KiB) written to {root} in {manifest['build_s']} s", flush=True)
    return {**manifest, "root": str(root)}


# ------------------------------------------------------------------------------ measuring (child processes)

def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, from ``/proc/<pid>/task/*/children``."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                continue
    return out


def smaps(pid: int) -> tuple[float, float] | None:
    """``(anonymous, file)`` PSS of ``pid`` in MiB from ``/proc/<pid>/smaps_rollup``: Pss_Anon + Pss_Shmem,
    and Pss_File (None if the process is gone)."""
    from torchdata_overlord.runtime.procstats import smaps_rollup

    got = smaps_rollup(pid)
    return (got.get("Pss_Anon", 0.0) + got.get("Pss_Shmem", 0.0), got.get("Pss_File", 0.0)) if got else None


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

    def summary(self, groups: dict[str, callable], before: tuple[float, float]) -> dict:
        """Anonymous PSS per group of pids (``groups[name](pid) -> bool``) in MiB: ``peak`` (whole run),
        ``peak_running`` (after the first batch) and ``steady`` (median of the steady sweeps); ``total``
        is every process minus ``before`` (the trainer's, before the loader existed); ``file`` and
        ``pss`` are that total for file-backed pages and for all of PSS."""
        def sums(sweep):
            out = {g: sum(v[0] for p, v in sweep.items() if pick(p)) for g, pick in groups.items()}
            out["total"] = sum(v[0] for v in sweep.values()) - before[0]
            out["file"] = sum(v[1] for v in sweep.values()) - before[1]
            out["pss"] = out["total"] + out["file"]
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
    """One trainer rank's DataLoader with W workers, each mixing all S sources: its PSS over time."""
    _common_imports()
    import warnings

    from torch.utils.data import DataLoader

    me, w = os.getpid(), cfg["workers"]
    # W workers per rank on this 2-core machine is the point of the measurement, not a mistake
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    before = smaps(me)
    sampler = Sampler(cfg["interval"])
    sampler.start()
    dl = DataLoader(_mixed_dataset(cfg["files"], cfg["spm"], cfg["seed"]), batch_size=cfg["batch"], num_workers=w,
                    collate_fn=list, prefetch_factor=2, timeout=120)
    # every worker has drawn from every source once it produced S samples: then each holds S row groups
    warm = -(-cfg["sources"] * w // cfg["batch"]) + w
    it, workers, tokens, t0 = None, [], 0, time.perf_counter()
    try:
        it = iter(dl)
        workers = list(it._workers)
        next(it)
        sampler.mark("warm")
        for _ in range(warm - 1):
            next(it)
        sampler.mark("steady")
        for i in range(warm):
            tokens += sum(r["tokens"] for r in next(it))
            if (i + 1) % max(1, warm // 8) == 0:
                sampler.sweep()
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
    mem = sampler.summary({}, before)
    return {"sources": cfg["sources"], "workers": w, "batch": cfg["batch"],
            "trainer_before_mib": {"anon": round(before[0], 1), "file": round(before[1], 1)},
            "processes": len(pids), "pids": pids, "pids_seen": seen, "batches": 2 * warm,
            "tokens_steady": tokens, "sweeps": len(sampler.sweeps), "seconds": round(time.perf_counter() - t0, 1),
            "start_method": dl.multiprocessing_context or "default (fork)",
            "per_rank_mib": mem["total"], "file_mib": mem["file"], "pss_mib": mem["pss"]}


def run_library(cfg: dict) -> dict:
    """One OverlordLoader(runtime="rpc") job with S sources on a dp=D mesh: PSS of every role,
    the helpers and the trainer's client over time."""
    _common_imports()
    import torchdata_overlord as ol
    from torchdata_overlord.sim.fault_run import Strategy

    me = os.getpid()
    before = smaps(me)
    sampler = Sampler(cfg["interval"])
    sampler.start()
    t0 = time.perf_counter()
    try:
        tok = ol.Tokenize(cfg["spm"], field="text")
        sources = [ol.ParquetSource(f"s{i:03d}", f, tok, seed=i) for i, f in enumerate(cfg["files"])]
        mesh = ol.ClientPlaceTree(dp=cfg["dp"], cp=cfg.get("cp", 1), pp=cfg.get("pp", 1))
        with ol.OverlordLoader(sources, Strategy([s.name for s in sources]), mesh, rank=None,
                               global_batch=cfg["global_batch"], seq_len=None, runtime="rpc", prefetch=2,
                               buffer_size=cfg["buffer"], timeout=120,
                               startup_timeout=cfg["startup_timeout"]) as loader:
            it = iter(loader)
            next(it)
            sampler.mark("warm")
            for _ in range(cfg["warm"] - 1):
                next(it)
            sampler.mark("steady")
            for _ in range(cfg["steady"]):
                next(it)
                sampler.sweep()
            stats = loader.stats()
            sampler.finish()
    finally:
        sampler.finish()
    roles = stats["roles"]
    role_pids = set(roles.values())
    kind = {pid: a.split(":")[0] for a, pid in roles.items()}
    seen = sorted({p for _, s in sampler.sweeps for p in s})
    helpers = [p for p in seen if p != me and p not in role_pids]
    mem = sampler.summary({"trainer": lambda p: p == me, "planner": lambda p: kind.get(p) == "planner",
                           "loaders": lambda p: kind.get(p) == "loader",
                           "constructors": lambda p: kind.get(p) == "constructor",
                           "helpers": lambda p: p in helpers, "plane": lambda p: p != me}, before)
    client = {k: round(v - before[0], 1) for k, v in mem.pop("trainer").items()}
    count = {k: sum(1 for a in roles if a.split(":")[0] == k) for k in ("planner", "loader", "constructor")}
    return {"sources": cfg["sources"], "dp": cfg["dp"], "cp": cfg.get("cp", 1), "pp": cfg.get("pp", 1),
            "trainer_before_mib": {"anon": round(before[0], 1), "file": round(before[1], 1)},
            "roles": {a: int(p) for a, p in roles.items()}, "role_processes": len(role_pids),
            "counts": {**count, "helpers": len(helpers)}, "helper_cmdlines": [_cmdline(p) for p in helpers],
            "pids": sorted(role_pids | set(helpers) | {me}), "pids_seen": seen, "steps": cfg["warm"] + cfg["steady"],
            "sweeps": len(sampler.sweeps), "seconds": round(time.perf_counter() - t0, 1),
            "plane_mib": mem.pop("plane"), "client_mib": client, "total_mib": mem.pop("total"),
            "file_mib": mem.pop("file"), "pss_mib": mem.pop("pss"), "by_kind_mib": mem}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


# ------------------------------------------------------------------------------ the sweep (parent process)

def child(kind: str, cfg: dict, timeout: float) -> dict:
    """Run ``run_<kind>(cfg)`` in a fresh process (each run starts from the same
    footprint); its result, after checking that every process it recorded is gone."""
    from torchdata_overlord.runtime.procstats import process_running as alive

    with tempfile.TemporaryDirectory(prefix="overlord-mem-") as tmp:
        (Path(tmp) / "cfg.json").write_text(json.dumps(cfg))
        out = Path(tmp) / "out.json"
        proc = subprocess.run([sys.executable, __file__, "--child", kind, str(Path(tmp) / "cfg.json"), str(out)],
                              capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{kind} run failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
        rep = json.loads(out.read_text())
    deadline = time.monotonic() + 20                 # orphans see their parent's exit within a few seconds
    left = [p for p in rep["pids_seen"] if alive(p)]
    while left and time.monotonic() < deadline:
        threading.Event().wait(0.1)                  # polling /proc for the exits, bounded by the deadline
        left = [p for p in left if alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
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


def library_fits(measured: list[dict]) -> dict:
    """For the plane (roles + helpers) and the client, each figure in :data:`KEYS`: per-unit costs
    fitted over every measured job (per source, per DP group, and what is left)."""
    return {part: {k: fit_units([(m["sources"], m["dp"], m[f"{part}_mib"][k]) for m in measured]) for k in KEYS}
            for part in ("plane", "client")}


def derive(cfgs: dict, colocated: list[dict], library: list[dict], fits: dict) -> list[dict]:
    """One row per (S, D, W, CP, PP): both sides' totals from the measured units, and how.

    colocated = ranks x one measured rank; library = plane + ranks x client, from the job measured at
    (S, D), else from the fitted per-unit costs (fitted, or extrapolated beyond every measured S)."""
    rows = []
    for s in cfgs["sources"]:
        for d, w in cfgs["dw"]:
            rank = next(m for m in colocated if m["sources"] == s and m["workers"] == w
                        and m["batch"] == GLOBAL_BATCH // d)
            lib = next((m for m in library if m["sources"] == s and m["dp"] == d), None)
            if lib is not None:
                plane, client, how = lib["plane_mib"], lib["client_mib"], "measured"
            else:
                plane, client = ({k: round(fitted(fits[part][k]["coef"], s, d), 1) for k in KEYS}
                                 for part in ("plane", "client"))
                how = "fitted" if s <= max(m["sources"] for m in library) else "extrapolated"
            helpers = max(m["counts"]["helpers"] for m in library if m["dp"] == d)
            for cp, pp in cfgs["cp_pp"]:
                ranks = d * cp * pp
                col = {k: round(ranks * rank["per_rank_mib"][k], 1) for k in KEYS}
                libt = {k: round(plane[k] + ranks * client[k], 1) for k in KEYS}
                rows.append({"sources": s, "dp": d, "workers": w, "cp": cp, "pp": pp, "ranks": ranks,
                             "colocated_mib": col, "colocated_processes": ranks * (1 + w),
                             "library_mib": libt, "library_processes": 1 + s + d + helpers + ranks,
                             "library_roles": how, "ratio": {k: round(col[k] / libt[k], 2) for k in KEYS}})
    return rows


def crossovers(rows: list[dict], colocated: list[dict], fits: dict) -> list[dict]:
    """Per (D, W, CP, PP) and for steady and peak: the swept S where the library uses less, and the S
    where the two lines cross (colocated per rank and the library's plane and client, linear in S)."""
    out = []
    for key in sorted({(r["dp"], r["workers"], r["cp"], r["pp"]) for r in rows}):
        d, w, cp, pp = key
        mine = sorted((r for r in rows if (r["dp"], r["workers"], r["cp"], r["pp"]) == key), key=lambda r: r["sources"])
        ranks = d * cp * pp
        entry = {"dp": d, "workers": w, "cp": cp, "pp": pp, "ranks": ranks}
        for k in ("steady", "peak"):
            wins = [r["sources"] for r in mine if r["library_mib"][k] < r["colocated_mib"][k]]
            col = fit_line({m["sources"]: m["per_rank_mib"][k] for m in colocated
                            if m["workers"] == w and m["batch"] == GLOBAL_BATCH // d})
            pl, cl = fits["plane"][k]["coef"], fits["client"][k]["coef"]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="S in {4, 10}, one (D, W), small row groups (CI smoke)")
    ap.add_argument("--out", type=Path, default=RESULTS / "memory.json")
    ap.add_argument("--root", type=Path, default=None, help="corpus folder (default: beside the demo corpus cache)")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between PSS sweeps")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "CFG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, cfg_path, out_path = args.child
        rep = {"colocated": run_colocated, "library": run_library}[kind](json.loads(Path(cfg_path).read_text()))
        Path(out_path).write_text(json.dumps(rep))
        return 0

    from torchdata_overlord.sim.corpus import default_corpus_root
    size = "quick" if args.quick else "full"
    cfgs = SIZES[size]
    root = args.root or default_corpus_root().parent / f"memory-corpus-{size}"
    t_all, load_start = time.perf_counter(), round(os.getloadavg()[0], 2)
    n_max = max(cfgs["sources"] + cfgs["library_sources"] + [s for s, _ in cfgs["library_extra"]])
    corpus = build_corpus(root, n_max, cfgs["row_group_kib"], cfgs["files"], cfgs["row_groups"])
    files = [[str(Path(corpus["root"], f)) for f in fs] for fs in corpus["files"]]
    spm = str(Path(corpus["root"], corpus["spm"]))
    base = {"spm": spm, "interval": args.interval, "seed": 0}
    colocated, library, errors = [], [], {}

    def attempt(name, kind, cfg, into):
        t0 = time.perf_counter()
        try:
            into.append(child(kind, cfg, timeout=600))
            r = into[-1]
            fig = r["per_rank_mib"] if kind == "colocated" else r["total_mib"]
            print(f"  {name}: peak {fig['peak']:.0f} MiB, steady {fig['steady']:.0f} MiB "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as e:   # noqa: BLE001 (recorded; the exit status says a run failed)
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"  {name}: FAILED {errors[name][:400]}", flush=True)

    print("colocated, one rank measured (trainer + W DataLoader workers):", flush=True)
    for s in cfgs["sources"]:
        for d, w in cfgs["dw"]:
            cfg = dict(base, files=files[:s], sources=s, workers=w, batch=GLOBAL_BATCH // d)
            attempt(f"colocated S={s} W={w} batch={GLOBAL_BATCH // d}", "colocated", cfg, colocated)
    print("library, measured jobs (Planner + S loaders + D constructors + helpers, and the trainer's client):",
          flush=True)
    lib = dict(base, global_batch=GLOBAL_BATCH, buffer=BUFFER, startup_timeout=STARTUP_TIMEOUT, **STEPS)
    for d in sorted({d for d, _ in cfgs["dw"]}):
        for s in cfgs["library_sources"]:
            attempt(f"library S={s} D={d}", "library", dict(lib, files=files[:s], sources=s, dp=d), library)
    for s, d in cfgs["library_extra"]:
        attempt(f"library S={s} D={d}", "library", dict(lib, files=files[:s], sources=s, dp=d), library)
    mesh_check = []
    if cfgs["library_mesh_check"]:
        s, d, cp, pp = cfgs["library_mesh_check"]
        attempt(f"library S={s} D={d} CP={cp} PP={pp} (every rank's output fetched by this trainer)", "library",
                dict(lib, files=files[:s], sources=s, dp=d, cp=cp, pp=pp), mesh_check)

    rows, cross, fits, check, per_rank, unit = [], [], {}, None, [], {}
    if not errors:
        fits = library_fits(library)
        rows = derive(cfgs, colocated, library, fits)
        cross = crossovers(rows, colocated, fits)
        per_rank = [{"dp": d, "workers": w, "batch": GLOBAL_BATCH // d,
                     **{k: fit_line({m["sources"]: m["per_rank_mib"][k] for m in colocated
                                     if m["workers"] == w and m["batch"] == GLOBAL_BATCH // d}) for k in KEYS}}
                    for d, w in cfgs["dw"]]
        per_worker = statistics.mean(f["steady"]["slope"] / f["workers"] for f in per_rank)
        coef = fits["plane"]["steady"]["coef"]
        unit = {"colocated_mib_per_worker_per_source": round(per_worker, 2),
                "library_mib_per_loader": coef["per_source"], "library_mib_per_constructor": coef.get("per_dp"),
                "library_mib_once": coef["intercept"],
                "break_even_workers": round(coef["per_source"] / per_worker, 1) if per_worker > 0 else None}
        if mesh_check:
            m = mesh_check[0]
            flat = next(x for x in library if (x["sources"], x["dp"]) == (m["sources"], m["dp"]))
            check = {"sources": m["sources"], "dp": m["dp"], "cp": m["cp"], "pp": m["pp"],
                     "plane_mib": m["plane_mib"], "plane_mib_cp1_pp1": flat["plane_mib"],
                     "client_mib": m["client_mib"], "client_mib_cp1_pp1": flat["client_mib"], "run": m}
        print_table(rows, cross, check, unit)
    plot_path = args.out.with_suffix(".png")
    if rows:
        plot(plot_path, rows)
        print(f"plot: {plot_path}")
    out = {"benchmark": "memory", "quick": args.quick,
           "config": {**cfgs, "global_batch": GLOBAL_BATCH, "buffer_size": BUFFER, "interval_s": args.interval,
                      "rows_per_row_group": corpus["rows_per_row_group"], "mean_doc_bytes": corpus["mean_doc_bytes"],
                      "corpus": corpus["root"], "library_steps": STEPS, "strategy": STRATEGY},
           "method": METHOD, "colocated_measured": colocated, "colocated_fit": per_rank, "library_measured": library,
           "library_fit": fits,
           "library_mesh_check": check, "per_source": unit, "rows": rows, "crossover": cross,
           "paper_ratio": PAPER_RATIO,
           "errors": errors, "plot": str(plot_path) if rows else None}
    write_results(args.out, out, started=t_all, load_start=load_start)
    return 1 if errors else 0


def print_table(rows: list[dict], cross: list[dict], check: dict | None, unit: dict) -> None:
    """The rows, the crossovers, the per-source costs and the CP/PP check, as the run ends."""
    print(f"\nsum of anonymous PSS in MiB (peak / steady); colocated derived = ranks x one measured rank, library = "
          f"roles + ranks x client\n{'S':>4} {'D x W':>6} {'CP x PP':>7} {'colocated':>19} {'library':>17} "
          f"{'ratio':>11}  library roles")
    for r in rows:
        c, lb, q = r["colocated_mib"], r["library_mib"], r["ratio"]
        print(f"{r['sources']:>4} {r['dp']:>2} x {r['workers']:<2} {r['cp']:>3} x {r['pp']:<2} "
              f"{c['peak']:>9,.0f} / {c['steady']:>7,.0f} {lb['peak']:>7,.0f} / {lb['steady']:>7,.0f} "
              f"{q['peak']:>5.2f}/{q['steady']:<5.2f}  {r['library_roles']}")
    for c in cross:
        st, pk = c["steady"], c["peak"]
        print(f"  D={c['dp']} W={c['workers']} CP={c['cp']} PP={c['pp']}: steady: library uses less at swept S "
              f"{st['library_wins_at']} (fitted crossover: {st['crossover_s_fitted']}); peak: at "
              f"{pk['library_wins_at']} (fitted: {pk['crossover_s_fitted']})")
    print(f"  per source (steady): {unit['colocated_mib_per_worker_per_source']:.2f} MiB in every colocated worker, "
          f"{unit['library_mib_per_loader']:.1f} MiB per Source Loader in the library: the library's is smaller "
          f"once D x CP x PP x W > {unit['break_even_workers']}")
    if check:
        print(f"  CP/PP check, S={check['sources']} D={check['dp']}: roles {check['plane_mib']['steady']} MiB steady "
              f"with CP={check['cp']} PP={check['pp']}, {check['plane_mib_cp1_pp1']['steady']} MiB with CP=PP=1")


def plot(path: Path, rows: list[dict]) -> None:
    """Total (GiB) against S, steady and peak: a colour per (D, W, CP, PP), colocated solid, library
    dashed (hollow markers: library rows from the fitted costs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    keys = sorted({(r["dp"], r["workers"], r["cp"], r["pp"]) for r in rows})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax, k in ((axes[0], "steady"), (axes[1], "peak")):
        for i, key in enumerate(keys):
            mine = sorted((r for r in rows if (r["dp"], r["workers"], r["cp"], r["pp"]) == key),
                          key=lambda r: r["sources"])
            xs, c = [r["sources"] for r in mine], colours[i % len(colours)]
            ax.plot(xs, [r["colocated_mib"][k] / 1024 for r in mine], "-o", color=c,
                    label=f"D={key[0]} W={key[1]} CP={key[2]} PP={key[3]}: colocated" if k == "steady" else None)
            ax.plot(xs, [r["library_mib"][k] / 1024 for r in mine], "--", color=c,
                    label=f"D={key[0]} CP={key[2]} PP={key[3]}: library" if k == "steady" else None)
            for r in mine:
                ax.plot(r["sources"], r["library_mib"][k] / 1024, "s", color=c,
                        fillstyle="none" if r["library_roles"] != "measured" else "full")
        ax.set(xscale="log", yscale="log", xlabel="sources S", ylabel=f"sum of anonymous PSS, {k} (GiB)",
               title=f"{k}: colocated (solid) vs library (dashed; hollow: fitted)")
        ax.set_xticks(sorted({r["sources"] for r in rows}))
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", lw=0.3)
    fig.suptitle("colocated DataLoaders (one rank measured, x ranks) against the library's roles (+ a client per "
                 "rank); colocated lines with equal D x CP x PP x W coincide", fontsize=10)
    fig.legend(loc="lower center", ncol=min(4, 2 * len(keys)), fontsize=8)
    fig.tight_layout(rect=(0, 0.02 + 0.04 * -(-2 * len(keys) // 4), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
