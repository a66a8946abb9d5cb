"""Start-up (issue 13): opening one source of 100,000 small Parquet files, and a job's time to its first
step with it and with many ordinary sources, in both runtimes.

Corpora, written once under a cache folder and reused while their manifest matches:

* *many files*: one source of ``files`` tiny Parquet files (``rows`` short text rows each, one row
  group, 1,000 files per folder) and a sentencepiece model trained on the same sentences;
* *many sources*: the memory benchmark's corpus (S sources x 2 files x 2 row groups of ~1 MiB of
  text, ``benchmarks/memory.py``; ``--quick``: 64 KiB row groups), shared with it when configured alike.

Every figure comes from a fresh subprocess (``--one KIND``), imports done before its clock starts;
each is run ``--repeat`` times, interleaved, and the median is reported with every value:

* ``construct_cold`` / ``construct_warm``: ``ParquetSource(...)`` over the many files with an empty
  file-metadata journal folder (every footer read; the files themselves are in the page cache) and
  with the journal the cold run wrote; seconds, footers read (``metadata_reads``) and one
  ``state_dict()`` call (what a checkpoint of a Source Loader takes; it keeps a ``position()`` per buffered row);
* ``construct_warm.spec``: then, what the rpc runtime does to ship the source to a worker:
  ``SourceSpec.from_source`` through pickle (bytes, seconds), built again from it (seconds, footers read);
* ``first_{local,rpc}_{cold,warm}``: from ``ParquetSource(...)`` to the first batch of
  ``OverlordLoader(..., runtime=...)`` over it (Tokenize, equal mixture, ``dp=2``, ``rank=None``,
  global batch ``--global-batch``, default settings otherwise), split into the source's opening
  and the loader's part (constructing it and its first batch);
* ``many_{local,rpc}_S``: the same to the first batch with S ordinary sources (``--sources``), a
  warm file-metadata journal, global batch 64; ``many_rpc_S_cold``: rpc with an empty profile journal (a
  job's first start: its placement profiles every source), ``many_rpc_S`` with the journal that wrote.

Targets (issue 13): the 100,000-file source's first step within 5 s in both runtimes (warm journal);
100 sources within 15 s and 300 within 30 s.
Prints a table and writes ``benchmarks/results/startup.json``; exits non-zero only when a run failed,
never because a figure disappointed.

    python benchmarks/startup.py                          # 100,000 files; S in {100, 300}
    python benchmarks/startup.py --quick --out /tmp/s.json  # CI smoke: 2,000 files; S = 4
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import building, spawn_one, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
MARK = "@@STARTUP-RESULT@@"
SIZES = {
    "full": {"files": 100_000, "rows": 4, "per_dir": 1000, "sources": [100, 300], "global_batch": 16, "repeat": 3,
             "source_corpus": {"row_group_kib": 1024, "files": 2, "row_groups": 2}},
    "quick": {"files": 2000, "rows": 4, "per_dir": 500, "sources": [4], "global_batch": 8, "repeat": 1,
              "source_corpus": {"row_group_kib": 64, "files": 2, "row_groups": 2}},
}
MANY_BATCH = 64
TARGET_S = 5.0
MANY_TARGET_S = {100: 15.0, 300: 30.0}     # issue 13: S sources to the first step
CORPUS_VERSION = 1
MESH = {"dp": 2}


# ------------------------------------------------------------------------------ the corpora

def build_many_files(root: Path, files: int, rows: int, per_dir: int, seed: int = 0) -> dict:
    """``files`` Parquet files of ``rows`` text rows under ``root/files`` (reused while the manifest
    matches) and ``root/tokenizer.model``; the manifest."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchdata_overlord.testing import make_text_corpus, train_sentencepiece

    config = {"version": CORPUS_VERSION, "files": files, "rows": rows, "per_dir": per_dir, "seed": seed}
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        if manifest["config"] == config and (root / "tokenizer.model").is_file():
            return {**manifest, "root": str(root)}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if root.exists() and any(p.name not in ("manifest.json", "files", "tokenizer.model", "tokenizer.vocab")
                             for p in root.iterdir()):
        raise RuntimeError(f"{root} holds files this benchmark did not write; pass another --root")
    t0 = time.perf_counter()
    with building(root) as tmp:
        sentences = make_text_corpus(5000, seed=seed, min_words=8, max_words=30)
        train_sentencepiece(sentences[:2000], tmp / "tokenizer", vocab_size=500)
        rng = np.random.default_rng(seed)
        for i in range(files):
            folder = tmp / "files" / f"d{i // per_dir:04d}"
            if i % per_dir == 0:
                folder.mkdir(parents=True)
            text = pa.array([sentences[j] for j in rng.integers(0, len(sentences), rows)], pa.string())
            ids = pa.array(np.arange(i * rows, (i + 1) * rows, dtype=np.int64))
            pq.write_table(pa.table({"id": ids, "text": text}), folder / f"part-{i:06d}.parquet")
        manifest = {"config": config, "build_s": round(time.perf_counter() - t0, 1)}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
    print(f"corpus: {files:,} files of {rows} rows written to {root} in {manifest['build_s']} s", flush=True)
    return {**manifest, "root": str(root)}


# ------------------------------------------------------------------------------ one run (a subprocess)

def _imports():
    import gc

    import pyarrow.parquet  # noqa: F401
    import sentencepiece  # noqa: F401
    import torch

    import torchdata_overlord  # noqa: F401
    from torchdata_overlord.runtime.job_config import SourceSpec  # noqa: F401
    from torchdata_overlord.sim.fault_run import Strategy  # noqa: F401
    torch.set_num_threads(1)
    gc.collect()


def run_construct(a: dict) -> dict:
    """Open the big source; with ``a["spec"]``, then ship it as the rpc runtime does (pickle and rebuild)."""
    import pickle

    import torchdata_overlord as ol
    from torchdata_overlord.runtime.job_config import SourceSpec

    tok = ol.Tokenize(a["spm"], field="text")
    t0 = time.perf_counter()
    src = ol.ParquetSource("many", a["paths"], tok, metadata_cache=a["journal"])
    dt = time.perf_counter() - t0
    t1 = time.perf_counter()
    src.state_dict()
    out = {"seconds": dt, "footers_read": src.metadata_reads, "files": len(src.files), "rows": src.num_rows,
           "state_dict_s": time.perf_counter() - t1}
    if a.get("spec"):
        t0 = time.perf_counter()
        blob = pickle.dumps(SourceSpec.from_source(src))
        t1 = time.perf_counter()
        table = pickle.dumps(src.spec_args()[2]["file_table"])
        t2 = time.perf_counter()
        again = pickle.loads(blob).build()
        t3 = time.perf_counter()
        assert again.files == src.files and again.state_dict() == src.state_dict()
        out["spec"] = {"pickle_s": t1 - t0, "spec_mib": len(blob) / 2**20, "file_table_mib": len(table) / 2**20,
                       "rebuild_s": t3 - t2, "footers_read": again.metadata_reads}
    return out


def run_first(a: dict) -> dict:
    """From opening the sources to the first batch of an OverlordLoader over them (``a["profiles"]``: the
    cache folder whose ``profiles`` journal the rpc runtime's placement reads and writes)."""
    if a.get("profiles"):
        os.environ["TORCHDATA_OVERLORD_CACHE"] = a["profiles"]
    import torchdata_overlord as ol
    from torchdata_overlord.sim.fault_run import Strategy

    tok = ol.Tokenize(a["spm"], field="text")
    t0 = time.perf_counter()
    sources = [ol.ParquetSource(name, paths, tok, seed=i, metadata_cache=a["journal"])
               for i, (name, paths) in enumerate(a["sources"])]
    t1 = time.perf_counter()
    with ol.OverlordLoader(sources, Strategy([s.name for s in sources]), ol.ClientPlaceTree(**MESH), rank=None,
                           global_batch=a["global_batch"], seq_len=None, runtime=a["runtime"],
                           startup_timeout=600, timeout=300) as loader:
        t2 = time.perf_counter()
        batch = next(iter(loader))
        t3 = time.perf_counter()
        processes = 1 + len(loader._job.transport.worker_pids)
    assert batch is not None
    return {"runtime": a["runtime"], "sources": len(sources), "files": sum(len(s.files) for s in sources),
            "footers_read": sum(s.metadata_reads for s in sources), "open_s": t1 - t0, "construct_s": t2 - t1,
            "loader_s": t3 - t1, "total_s": t3 - t0, "processes": processes}


def one(kind: str, a: dict) -> int:
    _imports()
    r = {"construct": run_construct, "first": run_first}[kind](a)
    print(MARK + json.dumps(r), flush=True)
    return 0


# ------------------------------------------------------------------------------ driver

def spawn(kind: str, a: dict, timeout: float) -> dict:
    return spawn_one(__file__, kind, a, MARK, timeout, cwd=str(ROOT))


def median_of(runs: list[dict]) -> dict:
    """Each float figure's median over the runs (``<key>_all``: every value; nested dicts alike), other
    fields from the first run."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, float):
            vals = [r[k] for r in runs]
            out[k], out[f"{k}_all"] = statistics.median(vals), vals
        elif isinstance(v, dict):
            out[k] = median_of([r[k] for r in runs])
            out[k].pop("repeats")
    out["repeats"] = len(runs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2,000 files, S = 4, one repeat (CI smoke)")
    ap.add_argument("--out", type=Path, default=RESULTS / "startup.json")
    ap.add_argument("--root", type=Path, default=None,
                    help="corpora folder (default: beside the demo corpus cache; the many-sources corpus is the "
                         "memory benchmark's)")
    ap.add_argument("--files", type=int, default=None, help="files in the one big source")
    ap.add_argument("--sources", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated source counts for the many-sources runs")
    ap.add_argument("--global-batch", type=int, default=None, help="global batch of the big-source runs")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--one", choices=["construct", "first"], help=argparse.SUPPRESS)
    ap.add_argument("--args", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return one(args.one, json.loads(args.args))

    import memory
    from torchdata_overlord.sim.corpus import default_corpus_root

    size = "quick" if args.quick else "full"
    cfg = dict(SIZES[size])
    cfg["files"] = args.files or cfg["files"]
    cfg["sources"] = args.sources or cfg["sources"]
    cfg["global_batch"] = args.global_batch or cfg["global_batch"]
    cfg["repeat"] = args.repeat or cfg["repeat"]
    base = default_corpus_root().parent
    many_root = (args.root / "many-files") if args.root else base / f"startup-corpus-{size}"
    sc = cfg["source_corpus"]
    src_root = (args.root / "sources") if args.root else memory.corpus_root(size, sc["row_group_kib"] / 1024)
    t_all, load_start = time.perf_counter(), round(os.getloadavg()[0], 2)
    many = build_many_files(many_root, cfg["files"], cfg["rows"], cfg["per_dir"])
    corpus = memory.build_corpus(src_root, max(cfg["sources"]), sc["row_group_kib"] / 1024, sc["files"], sc["row_groups"])
    src_files = [[str(Path(corpus["root"], f)) for f in fs] for fs in corpus["files"]]
    spm = str(many_root / "tokenizer.model")
    paths = str(many_root / "files")
    print(f"one source of {cfg['files']:,} files ({paths}); sources of {corpus['config']['row_group_kib']} KiB row "
          f"groups ({corpus['root']}); {cfg['repeat']} repeat(s)", flush=True)

    runs: dict[str, list] = {}
    errors: dict[str, str] = {}
    timeout = 280 if args.quick else 900
    work = Path(tempfile.mkdtemp(prefix="overlord-startup-"))
    try:
        def attempt(name: str, kind: str, a: dict) -> None:
            t0 = time.perf_counter()
            try:
                runs.setdefault(name, []).append(spawn(kind, a, timeout))
                r = runs[name][-1]
                fig = r.get("total_s", r.get("seconds"))
                print(f"  {name}: {fig:.2f} s (footers read: {r['footers_read']}; run took "
                      f"{time.perf_counter() - t0:.1f} s)", flush=True)
            except Exception as e:  # noqa: BLE001 (recorded; the exit status says a run failed)
                errors[name] = f"{type(e).__name__}: {e}"
                traceback.print_exc()

        big = {"paths": paths, "spm": spm}
        first = {"spm": spm, "sources": [["many", paths]], "global_batch": cfg["global_batch"]}
        many_spm = str(Path(corpus["root"], corpus["spm"]))
        from torchdata_overlord import ParquetSource
        for fs in src_files[:max(cfg["sources"])]:         # the many-sources runs start with their journal written
            ParquetSource("warm-up", fs, metadata_cache=str(work / "journal-many"))
        for rep in range(cfg["repeat"]):
            journal = str(work / f"journal-{rep}")          # empty: the cold runs fill it, the warm ones read it
            attempt("construct_cold", "construct", {**big, "journal": journal})
            attempt("construct_warm", "construct", {**big, "journal": journal, "spec": True})
            for runtime in ("local", "rpc"):
                cold = str(work / f"journal-{runtime}-{rep}")
                attempt(f"first_{runtime}_cold", "first", {**first, "runtime": runtime, "journal": cold})
                attempt(f"first_{runtime}_warm", "first", {**first, "runtime": runtime, "journal": journal})
            for s in cfg["sources"]:
                a = {"spm": many_spm, "sources": [[f"s{i:03d}", fs] for i, fs in enumerate(src_files[:s])],
                     "global_batch": MANY_BATCH, "journal": str(work / "journal-many")}
                attempt(f"many_local_{s}", "first", {**a, "runtime": "local"})
                # rpc profiles the sources for its placement: first with an empty profile journal (a job's
                # first start), then with the journal that run wrote (every later start)
                profiles = str(work / f"profiles-{s}-{rep}")
                attempt(f"many_rpc_{s}_cold", "first", {**a, "runtime": "rpc", "profiles": profiles})
                attempt(f"many_rpc_{s}", "first", {**a, "runtime": "rpc", "profiles": profiles})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    figs = {name: median_of(rs) for name, rs in runs.items()}
    print(f"\none source of {cfg['files']:,} files (medians of {cfg['repeat']}):")
    print(f"{'run':>22} {'seconds':>8} {'footers read':>13}  detail")
    for name in ("construct_cold", "construct_warm"):
        if name in figs:
            f = figs[name]
            print(f"{name:>22} {f['seconds']:>8.2f} {f['footers_read']:>13,}  one state_dict(): {f['state_dict_s']:.3f} s")
    if "construct_warm" in figs and "spec" in figs["construct_warm"]:
        f = figs["construct_warm"]["spec"]
        print(f"{'spec rebuild':>22} {f['rebuild_s']:>8.2f} {f['footers_read']:>13,}  pickled spec {f['spec_mib']:.1f} MiB "
              f"({f['file_table_mib']:.1f} MiB file table) in {f['pickle_s']:.2f} s")
    verdict = {}
    for runtime in ("local", "rpc"):
        for temp in ("cold", "warm"):
            name = f"first_{runtime}_{temp}"
            if name in figs:
                f = figs[name]
                print(f"{name:>22} {f['total_s']:>8.2f} {f['footers_read']:>13,}  source {f['open_s']:.2f} s + loader "
                      f"{f['loader_s']:.2f} s to the first batch ({f['processes']} process(es))")
        w = figs.get(f"first_{runtime}_warm")
        if w:
            verdict[f"{runtime}_warm_meets_target"] = w["total_s"] <= TARGET_S
    if verdict:
        print("  target: the first step within " + f"{TARGET_S:g} s (warm): " + ", ".join(
            f"{k.split('_')[0]} {'MEETS' if v else 'MISSES'}" for k, v in verdict.items()))
    print(f"\nmany ordinary sources to the first batch (global batch {MANY_BATCH}):")
    for s in cfg["sources"]:
        names = {"local": f"many_local_{s}", "rpc, profiles journaled": f"many_rpc_{s}",
                 "rpc, first start (profiling)": f"many_rpc_{s}_cold"}
        print(f"  S={s:>4}: " + ", ".join(f"{r} {figs[n]['total_s']:.2f} s (open {figs[n]['open_s']:.2f} s, "
                                          f"{figs[n]['processes']} proc)" for r, n in names.items() if n in figs))
        target = MANY_TARGET_S.get(s)
        if target is not None:
            for n in names.values():
                if n in figs:
                    verdict[f"{n}_meets_target"] = figs[n]["total_s"] <= target
    out = {"benchmark": "startup", "quick": args.quick, "target_s": TARGET_S,
           "config": {**cfg, "mesh": MESH, "many_global_batch": MANY_BATCH, "many_files_root": str(many_root),
                      "sources_root": corpus["root"], "rows_per_row_group": corpus["rows_per_row_group"],
                      "strategy": "torchdata_overlord.sim.fault_run.Strategy: equal Constant mix, distribute DP, "
                                  "greedy balance", "transform": "Tokenize(field='text')"},
           "runs": figs, "verdict": verdict, "errors": errors}
    write_results(args.out, out, started=t_all, load_start=load_start)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
