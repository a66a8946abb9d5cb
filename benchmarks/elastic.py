"""Elastic resume (issue 14): from ``load_state_dict`` to the first batch at another mesh, for S sources.

Data: the memory benchmark's corpus (S sources x 2 files x 2 row groups of ~1 MiB of text,
``benchmarks/memory.py``; ``--quick``: 64 KiB row groups), tokenized with its sentencepiece model.

For each S (``--sources``, default 10 and 300) and runtime (local, rpc), one process saves: a loader at
dp=4, global batch 64, runs ``--steps`` steps and writes its ``state_dict()``. Then, each in a fresh
process (the loader built and started before the clock):

* ``elastic``: a loader at dp=3 cp=2, global batch 48, ``load_state_dict(state)`` then ``next(iter(loader))``;
* ``same``: a loader at the saved mesh and batch, the same two calls: the cost of any resume, beside it.

Reported: ``load_state_dict`` seconds, from it to the first batch, and the ratio of the two resumes'
totals. The state of S sources is also sized (bytes of ``torch.save``).

    python benchmarks/elastic.py                        # S in {10, 300}
    python benchmarks/elastic.py --quick --out /tmp/e.json   # CI smoke: S = 4, small row groups
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
from common import spawn_one, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MARK = "@@ELASTIC-RESULT@@"
SIZES = {"full": {"sources": [10, 300], "row_group_kib": 1024, "steps": 3, "repeat": 3},
         "quick": {"sources": [4], "row_group_kib": 64, "steps": 2, "repeat": 1}}
SAVED = {"mesh": {"dp": 4}, "global_batch": 64}
RESUMED = {"mesh": {"dp": 3, "cp": 2}, "global_batch": 48}


def strategy(g):
    """Equal weights over every source (module level: the rpc workers unpickle it by name)."""
    import torchdata_overlord as ol
    return (g.mix({s: 1.0 for s in g.sources}).distribute("DP").cost(ol.attention_flops)
            .balance("greedy", microbatches=2, max_tokens=16384, oversize="split").plan())


def make_loader(a: dict, mesh: dict, batch: int):
    import torchdata_overlord as ol
    tok = ol.Tokenize(a["spm"], field="text")
    sources = [ol.ParquetSource(name, paths, tok, seed=i) for i, (name, paths) in enumerate(a["sources"])]
    return ol.OverlordLoader(sources, strategy, ol.ClientPlaceTree(**mesh), rank=None, global_batch=batch,
                             seq_len=None, runtime=a["runtime"], startup_timeout=600, timeout=300)


def run_save(a: dict) -> dict:
    import torch
    with make_loader(a, SAVED["mesh"], SAVED["global_batch"]) as loader:
        for _, _ in zip(range(a["steps"]), loader):
            pass
        torch.save({"loader": loader.state_dict()}, a["state"])
    return {"state_bytes": os.path.getsize(a["state"])}


def run_resume(a: dict) -> dict:
    import torch
    to = RESUMED if a["kind"] == "elastic" else SAVED
    state = torch.load(a["state"])["loader"]
    with make_loader(a, to["mesh"], to["global_batch"]) as loader:
        t0 = time.perf_counter()
        changes = loader.load_state_dict(state)
        t1 = time.perf_counter()
        batch = next(iter(loader))
        t2 = time.perf_counter()
    assert batch is not None
    return {"load_s": t1 - t0, "first_batch_s": t2 - t1, "total_s": t2 - t0, "changes": changes,
            "step": next(iter(batch.values()))["step"]}


def spawn(kind: str, a: dict, timeout: float) -> dict:
    return spawn_one(__file__, kind, a, MARK, timeout, cwd=str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="S = 4, 64 KiB row groups, one repeat (CI smoke)")
    ap.add_argument("--out", type=Path, default=RESULTS / "elastic.json")
    ap.add_argument("--root", type=Path, default=None, help="corpus folder (default: the memory benchmark's)")
    ap.add_argument("--sources", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--one", choices=["save", "resume"], help=argparse.SUPPRESS)
    ap.add_argument("--args", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        r = {"save": run_save, "resume": run_resume}[args.one](json.loads(args.args))
        print(MARK + json.dumps(r), flush=True)
        return 0

    import memory

    size = "quick" if args.quick else "full"
    cfg = dict(SIZES[size], sources=args.sources or SIZES[size]["sources"], repeat=args.repeat or SIZES[size]["repeat"])
    root = args.root or memory.corpus_root(size, cfg["row_group_kib"] / 1024)
    t_all, load_start = time.perf_counter(), round(os.getloadavg()[0], 2)
    corpus = memory.build_corpus(root, max(cfg["sources"]), cfg["row_group_kib"] / 1024, 2, 2)
    files = [[str(Path(corpus["root"], f)) for f in fs] for fs in corpus["files"]]
    spm = str(Path(corpus["root"], corpus["spm"]))
    runs: dict[str, dict] = {}
    errors: dict[str, str] = {}
    work = Path(tempfile.mkdtemp(prefix="overlord-elastic-"))
    timeout = 300 if args.quick else 1200
    try:
        for s in cfg["sources"]:
            for runtime in ("local", "rpc"):
                name = f"{runtime}_{s}"
                a = {"spm": spm, "sources": [[f"s{i:03d}", fs] for i, fs in enumerate(files[:s])], "runtime": runtime,
                     "steps": cfg["steps"], "state": str(work / f"{name}.pt")}
                try:
                    saved = spawn("save", a, timeout)
                    got = {"elastic": [], "same": []}
                    for _ in range(cfg["repeat"]):          # interleaved: the machine's drift hits both alike
                        for kind in got:
                            got[kind].append(spawn("resume", {**a, "kind": kind}, timeout))
                    fig = {"sources": s, "runtime": runtime, "state_bytes": saved["state_bytes"]}
                    for kind, rs in got.items():
                        fig[kind] = {k: statistics.median(r[k] for r in rs) for k in ("load_s", "first_batch_s",
                                                                                       "total_s")}
                        fig[kind]["total_s_all"] = [r["total_s"] for r in rs]
                        fig[kind]["step"] = rs[0]["step"]
                        fig[kind]["changes"] = rs[0]["changes"]
                    fig["elastic_over_same"] = fig["elastic"]["total_s"] / fig["same"]["total_s"]
                    runs[name] = fig
                    print(f"  S={s:>4} {runtime:>5}: elastic {fig['elastic']['total_s']:.2f} s (load_state_dict "
                          f"{fig['elastic']['load_s']:.3f} s), same mesh {fig['same']['total_s']:.2f} s: "
                          f"{fig['elastic_over_same']:.2f}x; state {saved['state_bytes'] / 1024:.0f} KiB", flush=True)
                except Exception as e:  # noqa: BLE001 (recorded; the exit status says a run failed)
                    errors[name] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"benchmark": "elastic", "quick": args.quick,
           "config": {**cfg, "saved": SAVED, "resumed": RESUMED, "corpus_root": corpus["root"],
                      "strategy": "equal Constant mix over every source, distribute DP, greedy balance",
                      "transform": "Tokenize(field='text')"},
           "runs": runs, "errors": errors}
    write_results(args.out, out, started=t_all, load_start=load_start)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
