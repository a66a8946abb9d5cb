"""Runtimes side by side (issue 4): ``OverlordLoader(runtime="rpc")`` vs ``runtime="local"`` vs a plain
``DataLoader``, the trainer-observed fetch latency with ``prefetch=2`` against a small model step, and
the per-sample transport cost of the RPC runtime.

Every run reads the demo corpus's four Parquet sources with ``ParquetSource`` and applies the same
transforms (``Tokenize`` / ``ImageText``) with the same constant mixture as ``e2e_throughput.py``;
each run is its own subprocess (``--one KIND``: each starts from the same footprint), which
prints its result as JSON on stdout. Same number of processes, three in all:

* ``dataloader``: the main process + 2 ``DataLoader`` worker processes (``e2e_throughput.run_baseline``,
  interleaved order, every worker opening every source), batches of global_batch / 2;
* ``local``: one process; ``OverlordLoader(runtime="local", workers=2)`` (a 2-thread transform pool per
  source, sources filled one after another, planning/packing in the prefetch thread);
* ``rpc``: the main process + ``n_workers=2`` RPC worker processes holding the Planner, the four Source
  Loaders and the two Data Constructors (one per DP group), round robin, every other setting at its
  default: each Source Loader's transform threads are measured (``chain_threads``: a source with more
  than half the loaders' CPU on 2 cores gets 2, the others transform inline; ``transform_workers`` in
  the JSON); between steps each loader reads and transforms the next step's rows ahead (``read_ahead``
  in the JSON: rows read ahead, and of those consumed, how many were ready, waited for or transformed by
  the refill itself); samples go loader -> constructor -> trainer.

The OverlordLoader runs plan a ``dp=2, cp=2`` mesh (Karmarkar-Karp on attention FLOPs, 4 microbatches)
with ``rank=None``: every rank's output is built and consumed in the trainer process, so every run
delivers the whole global batch each step (what one process feeding the whole mesh does).

Measured per OverlordLoader run, on one loader and one iterator:

1. throughput: after ``warmup`` steps, ``steps`` steps consumed as fast as possible -> samples/s; then
   ``THROUGHPUT_ROUNDS`` more throughput-only runs of the DataLoader, local and rpc, interleaved (a fresh
   subprocess each, ``throughput_steps`` steps: about 10 s, as a 40-step run of 2.5 s moved by 10-20%
   on this shared machine): the ratios to the DataLoader are the medians of the per-round ratios;
2. fetch latency: a simulated trainer step between ``next()`` calls: forward + backward + SGD step of a
   ``TransformerEncoderLayer`` on a fixed random batch (one torch thread), sized beforehand to take
   each of ``--model-ms`` (100 and 250 ms: about the loader's own pace for the whole global batch on
   this 2-core machine, and with headroom) with nothing else running. After ``latency_warmup`` steps,
   each of ``latency_steps`` ``next()`` calls is timed (the trainer's wait): p50/p99/max, the model step
   time during the run, the fraction of steps that waited > 1 ms and > 5% of the (isolated) model step,
   and the fraction of ``next()`` calls that found no built step in the prefetch queue (a wait for the
   producer, as opposed to ``next()``'s own cost, which contends for the GIL with the prefetch thread),
   and the fraction that both found the step not built and waited > 1 ms (a wait for data). For the
   local runtime also with prefetch 0 (``next()`` builds its own step) and 1, a fresh loader each,
   per step and per microbatch;
   Target (issue): with prefetch 2, the trainer waits on data in < 1% of steps once warm;
3. transport: the wall time of each step's hand-over of the planned samples from the Source Loaders
   to the Data Constructors, each loader's own timing from its take to every constructor's answer to
   its ``put`` (in ``local`` in-process calls; in ``rpc`` RPCs: serialisation, TensorPipe,
   deserialisation), averaged over the loaders (in ``rpc`` they send in parallel), per sample; with
   the tensor bytes moved. Also the throughput-derived per-sample difference
   ``1/rpc samples/s - 1/local samples/s`` (this includes every other RPC hop: metadata, plan, constructor
   build and its outputs, and the different transform parallelism, so it is not transport alone).

4. step rate (issue 12): steps/s of ``runtime="local"`` and ``runtime="rpc"`` at their default settings
   at global batch 8 on a ``dp=2`` mesh (``rank=None``, Karmarkar-Karp on attention FLOPs, 2
   microbatches), nothing but ``next()`` in the loop: the per-step cost of each runtime's request
   path, where the samples are few; the median of 5 interleaved runs of 300 steps each. Target: rpc
   >= 0.8x local.

Prints a table and writes ``benchmarks/results/runtimes.json``; exits non-zero only when a run failed.

    python benchmarks/runtimes.py                       # demo scale
    python benchmarks/runtimes.py --quick --out /tmp/runtimes.json    # CI smoke (scale "test")
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_throughput as e2e  # noqa: E402
from common import spawn_one, write_results  # noqa: E402

import torchdata_overlord as ol  # noqa: E402
from torchdata_overlord.sim.corpus import build_demo_corpus, default_corpus_root  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WEIGHTS = e2e.WEIGHTS
MESH = {"dp": 2, "cp": 2}
MICROBATCHES, MAX_TOKENS, METHOD = 4, 16384, "karmarkar_karp"
WORKERS = 2
TARGET = {"waited_fraction": 0.01, "prefetch": 2, "ready_p50_ms": 0.1}
MARK = "@@RUNTIMES-RESULT@@"
RUNS = {"dataloader": "DataLoader, 2 worker processes", "local": "OverlordLoader local, workers=2 (1 process)",
        "rpc": "OverlordLoader rpc, n_workers=2 (3 processes)"}
THROUGHPUT_ROUNDS = 4          # throughput-only runs of each kind besides the main one (ratios: medians)
STEPRATE = {"global_batch": 8, "mesh": {"dp": 2}, "microbatches": 2, "target_rpc_over_local": 0.8, "rounds": 5}


def strategy(g: ol.DGraph) -> ol.Plan:
    """Module level, so it pickles for runtime="rpc"."""
    return (g.mix(WEIGHTS).distribute("DP").cost(ol.attention_flops)
            .balance(METHOD, microbatches=MICROBATCHES, max_tokens=MAX_TOKENS, oversize="split").plan())


# ------------------------------------------------------------------------------------------------
# the simulated trainer step
# ------------------------------------------------------------------------------------------------

class ModelStep:
    """Forward + backward + SGD step of one TransformerEncoderLayer on a fixed random batch."""

    def __init__(self, batch: int, seq: int = 128, d: int = 256, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.opt = torch.optim.SGD(self.layer.parameters(), lr=1e-4)
        self.x = torch.randn(batch, seq, d, generator=g)
        self.batch, self.seq, self.d = batch, seq, d

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.layer(self.x).pow(2).mean().backward()
        self.opt.step()
        return time.perf_counter() - t0

    def median_ms(self, n: int) -> float:
        return 1e3 * float(np.median([self() for _ in range(n)]))


def calibrate(target_ms: float, reps: int) -> tuple[ModelStep, float]:
    """A model step whose isolated median time is near ``target_ms`` (batch scaled linearly)."""
    m = ModelStep(2)
    m.median_ms(3)
    ms = m.median_ms(reps)
    batch = int(min(256, max(1, round(2 * target_ms / max(ms, 1e-3)))))
    m = ModelStep(batch)
    m.median_ms(2)
    return m, m.median_ms(reps)


# ------------------------------------------------------------------------------------------------
# one run (in its own process)
# ------------------------------------------------------------------------------------------------

class TakeTimer:
    """The hand-over of each step's samples from the Source Loaders to the Data Constructors."""

    @staticmethod
    def totals(job) -> tuple:
        """The Source Loaders time their own sends (take -> every constructor's put answered), in
        both runtimes: (seconds summed over loaders / loaders, samples, bytes, steps) so far."""
        stats = job.stats()["sources"].values()
        sent = [st["sent"] for st in stats]
        return (sum(x["seconds"] for x in sent) / max(len(sent), 1), sum(x["samples"] for x in sent),
                sum(x["bytes"] for x in sent), max(st["steps_delivered"] for st in stats))

    @staticmethod
    def summary(seconds: float, samples: int, nbytes: int, steps: int) -> dict:
        return {"steps": steps, "seconds": seconds, "samples": samples, "bytes": nbytes,
                "ms_per_step": 1e3 * seconds / max(steps, 1), "us_per_sample": 1e6 * seconds / max(samples, 1),
                "kib_per_sample": nbytes / 1024 / max(samples, 1)}


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else float("nan")


def runtime_kwargs(runtime: str) -> dict:
    """3 processes for rpc (the trainer + WORKERS role workers; transform threads measured, the default);
    a WORKERS-thread transform pool per source for local."""
    return {"n_workers": WORKERS} if runtime == "rpc" else {"workers": WORKERS}


def overlord_loader(runtime: str, corpus, a: dict, prefetch: int = TARGET["prefetch"],
                    sources: list | None = None) -> ol.OverlordLoader:
    """The measured OverlordLoader (``sources``: made beforehand, out of a timed start-up)."""
    return ol.OverlordLoader(sources or e2e.make_sources(corpus, a["seed"], None), strategy, ol.ClientPlaceTree(**MESH),
                             rank=None, global_batch=a["global_batch"], seq_len=None, seed=a["seed"], runtime=runtime,
                             prefetch=prefetch, image_token_id=corpus.image_token_id, **runtime_kwargs(runtime))


def run_throughput(kind: str, corpus, a: dict) -> dict:
    """Samples/s alone, ``warmup`` + ``throughput_steps`` steps (no latency runs): one of the interleaved rounds whose
    per-round ratios give the median ``ratio_<runtime>_over_dataloader``."""
    torch.set_num_threads(1)
    steps = a.get("throughput_steps", a["steps"])
    if kind == "dataloader":
        return run_dataloader(corpus, a, steps)
    with overlord_loader(kind, corpus, a) as loader:
        it = iter(loader)
        for _ in range(a["warmup"]):
            e2e.consume(next(it))
        n, t0 = 0, time.perf_counter()
        for _ in range(steps):
            n += e2e.consume(next(it))[0]
        dt = time.perf_counter() - t0
    return {"runtime": kind, "samples": n, "seconds": dt, "samples_per_s": n / dt}


def run_overlord(runtime: str, corpus, a: dict) -> dict:
    torch.set_num_threads(1)
    models = [calibrate(ms, a["calib_reps"]) for ms in a["model_ms"]]
    sources = e2e.make_sources(corpus, a["seed"], None)
    kw = runtime_kwargs(runtime)
    gb = a["global_batch"]
    t_start = time.perf_counter()
    loader = overlord_loader(runtime, corpus, a, sources=sources)
    t_built = time.perf_counter()
    with loader:
        it = iter(loader)
        first = None
        for _ in range(a["warmup"]):
            e2e.consume(next(it))
            first = first or time.perf_counter() - t_start
        # 1. throughput
        n = tokens = 0
        before = TakeTimer.totals(loader._job)
        t0 = time.perf_counter()
        for _ in range(a["steps"]):
            s, k = e2e.consume(next(it))
            n, tokens = n + s, tokens + k
        t1 = time.perf_counter()
        # steps delivered in the window (the prefetch runs ahead by up to 2)
        take = TakeTimer.summary(*[x - y for x, y in zip(TakeTimer.totals(loader._job), before)])
        thr = {"samples": n, "tokens": tokens, "seconds": t1 - t0, "samples_per_s": n / (t1 - t0),
               "tokens_per_s": tokens / (t1 - t0), "samples_per_step_ok": n == a["steps"] * gb,
               "take": take}
        # 2. fetch latency under a model step, for each model size (the loader is the same, warm)
        lats = [latency_run(loader, it, model, model_ms, a) for model, model_ms in models]
        read_ahead = {n: st.get("read_ahead") for n, st in loader._job.stats()["sources"].items()}
    # 3. (local) the same latency with prefetch 0 and 1, a loader each, against the first model size
    sweep = {TARGET["prefetch"]: lats[0]}
    if runtime == "local":
        for p in (0, 1):
            with overlord_loader(runtime, corpus, a, prefetch=p) as other:
                it2 = iter(other)
                for _ in range(a["warmup"]):
                    e2e.consume(next(it2))
                sweep[p] = latency_run(other, it2, *models[0], a)
    for lat in sweep.values():
        lat["wait_p50_ms_per_microbatch"] = lat["wait_p50_ms"] / MICROBATCHES
        lat["wait_p99_ms_per_microbatch"] = lat["wait_p99_ms"] / MICROBATCHES
    return {"runtime": runtime, "processes": 1 + (WORKERS if runtime == "rpc" else 0),
            "workers": kw, "transform_workers": getattr(getattr(loader._job, "cfg", None), "workers", None),
            "read_ahead": read_ahead,
            "mesh": MESH, "rank": None, "startup_s": first, "construct_s": t_built - t_start,
            **thr, "latency": lats[0], "latencies": lats,
            "prefetch_sweep": {str(p): sweep[p] for p in sorted(sweep)}}


def latency_run(loader, it, model, model_ms: float, a: dict) -> dict:
    """Time each ``next()`` with a model step between calls (after ``latency_warmup`` steps)."""
    waits, steps_s, empty = [], [], []
    for i in range(a["latency_warmup"] + a["latency_steps"]):
        # no built step waiting: next() must wait for the producer (always, with prefetch 0)
        head = list(loader._ahead)[:1] if loader.prefetch else []
        was_empty = not head or not head[0].done()
        w0 = time.perf_counter()
        item = next(it)
        w = time.perf_counter() - w0
        e2e.consume(item)
        dt = model()
        if i >= a["latency_warmup"]:
            waits.append(w)
            steps_s.append(dt)
            empty.append(was_empty)
    wms = [1e3 * w for w in waits]
    # the machine's floor: the same model step, then Python of next()'s size that touches no loader (after a
    # model step, the first few hundred bytecodes run on cold caches: ~0.1-0.2 ms here, hot ~0.01 ms)
    floor = []
    for i in range(len(wms)):
        model()
        w0 = time.perf_counter()
        {r: {"step": i, **v} for r, v in item.items()}
        floor.append(1e3 * (time.perf_counter() - w0))
    thr_5 = max(1.0, 0.05 * model_ms)
    return {"steps": len(wms), "warmup": a["latency_warmup"], "prefetch": loader.prefetch,
            "wait_p50_ms": pct(wms, 50), "wait_p99_ms": pct(wms, 99), "wait_max_ms": max(wms),
            "wait_mean_ms": float(np.mean(wms)),
            "model_step_isolated_ms": model_ms, "model_batch": model.batch,
            "model": f"TransformerEncoderLayer(d=256, heads=4, ff=1024) fwd+bwd+SGD on ({model.batch}, 128, 256), "
                     f"1 torch thread",
            "model_step_in_run_p50_ms": pct([1e3 * s for s in steps_s], 50),
            "model_step_in_run_p99_ms": pct([1e3 * s for s in steps_s], 99),
            "waited_gt_1ms_fraction": float(np.mean([w > 1.0 for w in wms])),
            "queue_empty_fraction": float(np.mean(empty)),
            "waited_gt_1ms_queue_empty_fraction": float(np.mean([w > 1.0 and e for w, e in zip(wms, empty)])),
            "wait_p50_ms_when_ready": pct([w for w, e in zip(wms, empty) if not e], 50),
            "wait_p99_ms_when_ready": pct([w for w, e in zip(wms, empty) if not e], 99),
            "floor_p50_ms": pct(floor, 50), "floor_p99_ms": pct(floor, 99),
            "waited_gt_5pct_step_threshold_ms": thr_5,
            "waited_gt_5pct_step_fraction": float(np.mean([w > 0.05 * model_ms for w in wms])),
            "loader_stats_fetch_wait": loader.stats()["fetch_wait"]}


def steprate_strategy(g: ol.DGraph) -> ol.Plan:
    return (g.mix(WEIGHTS).distribute("DP").cost(ol.attention_flops)
            .balance(METHOD, microbatches=STEPRATE["microbatches"]).plan())


def run_steprate(runtime: str, corpus, a: dict) -> dict:
    """Steps/s of one runtime at its defaults, global batch 8, dp=2 (see the module docstring, 4.)."""
    torch.set_num_threads(1)
    with ol.OverlordLoader(e2e.make_sources(corpus, a["seed"], None), steprate_strategy,
                           ol.ClientPlaceTree(**STEPRATE["mesh"]), rank=None, global_batch=STEPRATE["global_batch"],
                           seq_len=None, seed=a["seed"], runtime=runtime, image_token_id=corpus.image_token_id) as loader:
        it = iter(loader)
        for _ in range(a["steprate_warmup"]):
            next(it)
        t0 = time.perf_counter()
        for _ in range(a["steprate_steps"]):
            next(it)
        dt = time.perf_counter() - t0
        processes = 1 + len(loader._job.transport.worker_pids)
    return {"runtime": runtime, "steps": a["steprate_steps"], "seconds": dt, "steps_per_s": a["steprate_steps"] / dt,
            "processes": processes}


def run_dataloader(corpus, a: dict, steps: int | None = None) -> dict:
    torch.set_num_threads(1)
    r = e2e.run_baseline(corpus, WORKERS, a["global_batch"], a["warmup"], steps or a["steps"], a["seed"], grouped=False)
    r["processes"] = 1 + WORKERS
    return r


def one(kind: str, a: dict) -> int:
    corpus = build_demo_corpus(a["root"], scale=a["scale"], seed=a["seed"])
    gc.collect()
    gc.freeze()
    if kind.startswith("steprate-"):
        r = run_steprate(kind.split("-", 1)[1], corpus, a)
    elif kind.startswith("throughput-"):
        r = run_throughput(kind.split("-", 1)[1], corpus, a)
    else:
        r = run_dataloader(corpus, a) if kind == "dataloader" else run_overlord(kind, corpus, a)
    print(MARK + json.dumps(r), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------

def spawn(kind: str, a: dict, timeout: float) -> dict:
    return spawn_one(__file__, kind, a, MARK, timeout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="test-scale corpus, few steps (CI smoke)")
    ap.add_argument("--out", type=Path, default=RESULTS / "runtimes.json")
    ap.add_argument("--root", type=Path, default=None, help="corpus directory (default: the shared cache)")
    ap.add_argument("--global-batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="measured throughput steps")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--latency-steps", type=int, default=None)
    ap.add_argument("--latency-warmup", type=int, default=None)
    ap.add_argument("--model-ms", default="100,250",
                    help="target isolated model step times, comma-separated (one latency run each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one", choices=list(RUNS) + ["steprate-local", "steprate-rpc"] + [f"throughput-{k}" for k in RUNS],
                    help=argparse.SUPPRESS)
    ap.add_argument("--args", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return one(args.one, json.loads(args.args))

    scale = "test" if args.quick else "demo"
    root = args.root or (default_corpus_root() if scale == "demo" else
                         default_corpus_root().parent / f"demo-corpus-{scale}")
    a = {"scale": scale, "root": str(Path(root).expanduser().absolute()), "seed": args.seed,
         "global_batch": args.global_batch or (32 if args.quick else 64),
         "steps": args.steps or (3 if args.quick else 40),
         "warmup": args.warmup if args.warmup is not None else (1 if args.quick else 4),
         "latency_steps": args.latency_steps or (6 if args.quick else 100),
         "latency_warmup": args.latency_warmup if args.latency_warmup is not None else (2 if args.quick else 5),
         "model_ms": [float(x) for x in str(args.model_ms).split(",")], "calib_reps": 3 if args.quick else 7,
         "steprate_warmup": 3 if args.quick else 10, "steprate_steps": 10 if args.quick else 300,
         "throughput_rounds": 1 if args.quick else THROUGHPUT_ROUNDS, "throughput_steps": 3 if args.quick else 150}
    t_all = time.perf_counter()
    load_start = round(os.getloadavg()[0], 2)
    corpus = build_demo_corpus(a["root"], scale=scale, seed=args.seed)    # build once, before the runs
    print(f"corpus {corpus.root} (scale {scale}); mixture {WEIGHTS}; global batch {a['global_batch']}; "
          f"{a['warmup']} warm-up + {a['steps']} throughput steps; latency: {a['latency_warmup']} warm-up + "
          f"{a['latency_steps']} steps with a model step of ~{a['model_ms']} ms, prefetch {TARGET['prefetch']}; "
          f"mesh {MESH} rank=None (all ranks)", flush=True)
    runs, errors = {}, {}
    for kind in RUNS:
        t0 = time.perf_counter()
        try:
            runs[kind] = spawn(kind, a, timeout=280 if args.quick else 600)
        except Exception as e:  # noqa: BLE001 (recorded; the exit status says a run failed)
            errors[kind] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(f"  {kind}: {'failed' if kind in errors else 'done'} in {time.perf_counter() - t0:.1f} s", flush=True)

    # samples/s again, alone and interleaved (the machine is shared: one run each moves by 10-20%): the ratios
    # to the DataLoader are the medians over the main runs and these rounds, each ratio within one round
    rounds: dict = {k: [runs[k]["samples_per_s"]] for k in RUNS if k in runs}
    for r in range(a["throughput_rounds"]):
        for kind in (list(RUNS) if r % 2 else list(RUNS)[::-1]):
            got = None                      # a failed run leaves its round out of the ratios (rounds stay paired)
            try:
                got = spawn(f"throughput-{kind}", a, timeout=280 if args.quick else 600)["samples_per_s"]
            except Exception as e:  # noqa: BLE001 (recorded; the exit status says a run failed)
                errors[f"throughput-{kind}"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            rounds.setdefault(kind, []).append(got)

    steprate = {}
    for _ in range(1 if args.quick else STEPRATE["rounds"]):   # interleaved: the machine is shared and noisy
        for kind in ("steprate-local", "steprate-rpc"):
            try:
                steprate.setdefault(kind.split("-", 1)[1], []).append(spawn(kind, a, timeout=280 if args.quick else 600))
            except Exception as e:  # noqa: BLE001 (recorded; the exit status says a run failed)
                errors[kind] = f"{type(e).__name__}: {e}"
                traceback.print_exc()

    print()
    print(f"{'run':>48} {'procs':>5} {'samples/s':>10} {'tokens/s':>10} {'startup s':>9}")
    for kind, label in RUNS.items():
        r = runs.get(kind)
        if r:
            print(f"{label:>48} {r['processes']:>5} {r['samples_per_s']:>10.1f} {r['tokens_per_s']:>10.0f} "
                  f"{r['startup_s']:>9.2f}")
    verdict: dict = {}
    lat_rows = [(k, l) for k in ("local", "rpc") if k in runs for l in runs[k]["latencies"]]
    if lat_rows:
        print(f"\ntrainer-observed fetch wait (prefetch {TARGET['prefetch']}), model step between next() calls:")
        print(f"{'runtime':>8} {'model ms (iso/in run)':>22} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
              f"{'>1 ms':>7} {'>5% step':>9} {'queue empty':>11} {'>1ms+empty':>10} {'ready p50/p99':>14} "
              f"{'floor p50/p99':>14}")
        for k, l in lat_rows:
            print(f"{k:>8} {l['model_step_isolated_ms']:>10.1f} / {l['model_step_in_run_p50_ms']:>9.1f} "
                  f"{l['wait_p50_ms']:>8.3f} {l['wait_p99_ms']:>8.3f} {l['wait_max_ms']:>8.1f} "
                  f"{100 * l['waited_gt_1ms_fraction']:>6.1f}% {100 * l['waited_gt_5pct_step_fraction']:>8.1f}% "
                  f"{100 * l['queue_empty_fraction']:>10.1f}% {100 * l['waited_gt_1ms_queue_empty_fraction']:>9.1f}% "
                  f"{l['wait_p50_ms_when_ready']:>6.3f}/{l['wait_p99_ms_when_ready']:<7.3f} "
                  f"{l['floor_p50_ms']:>6.3f}/{l['floor_p99_ms']:<7.3f}")
        # keyed by the model step asked for: two calibrated steps measured on a loaded machine may round alike
        for (k, l), asked in zip(lat_rows, [ms for k in ("local", "rpc") if k in runs for ms in a["model_ms"]]):
            tag = f"{k}_{asked:g}ms"
            verdict[f"{tag}_meets_target_gt_1ms"] = l["waited_gt_1ms_fraction"] < TARGET["waited_fraction"]
            verdict[f"{tag}_meets_target_data_not_ready"] = \
                l["waited_gt_1ms_queue_empty_fraction"] < TARGET["waited_fraction"]
            verdict[f"{tag}_meets_target_ready_p50"] = l["wait_p50_ms_when_ready"] <= TARGET["ready_p50_ms"]
            # can the loader keep up at all? its unloaded step time vs the model step
            loader_ms = 1e3 * a["global_batch"] / runs[k]["samples_per_s"]
            verdict[f"{k}_loader_ms_per_step_unloaded"] = loader_ms
            print(f"  {k}, {l['model_step_isolated_ms']:.0f} ms model step: "
                  f"{'MEETS' if verdict[f'{tag}_meets_target_gt_1ms'] else 'MISSES'} the < "
                  f"{100 * TARGET['waited_fraction']:.0f}% target counting every wait > 1 ms; "
                  f"{'MEETS' if verdict[f'{tag}_meets_target_data_not_ready'] else 'MISSES'} it counting waits > 1 ms "
                  f"for a step not yet built; the loader alone needs {loader_ms:.0f} ms per step of "
                  f"{a['global_batch']} (throughput run); a ready step's next() p50 {l['wait_p50_ms_when_ready']:.3f} ms "
                  f"({'MEETS' if verdict[f'{tag}_meets_target_ready_p50'] else 'MISSES'} <= {TARGET['ready_p50_ms']} ms; "
                  f"the machine's floor after a model step {l['floor_p50_ms']:.3f} ms)")
    if "local" in runs and runs["local"].get("prefetch_sweep"):
        print(f"\nlocal, fetch wait per step and per microbatch ({MICROBATCHES} a step) by prefetch:")
        for p, l in runs["local"]["prefetch_sweep"].items():
            print(f"  prefetch {p}: p50 {l['wait_p50_ms']:.2f} ms ({l['wait_p50_ms_per_microbatch']:.2f} per "
                  f"microbatch), p99 {l['wait_p99_ms']:.2f} ms, steps not ready {100 * l['queue_empty_fraction']:.0f}%")
    transport = {}
    if "local" in runs and "rpc" in runs:
        lo, rp = runs["local"], runs["rpc"]
        transport = {
            "throughput_delta_us_per_sample": 1e6 * (1 / rp["samples_per_s"] - 1 / lo["samples_per_s"]),
            "take_local_us_per_sample": lo["take"]["us_per_sample"],
            "take_rpc_us_per_sample": rp["take"]["us_per_sample"],
            "take_delta_us_per_sample": rp["take"]["us_per_sample"] - lo["take"]["us_per_sample"],
            "take_local_ms_per_step": lo["take"]["ms_per_step"], "take_rpc_ms_per_step": rp["take"]["ms_per_step"],
            "kib_per_sample": rp["take"]["kib_per_sample"],
            "rpc_take_mib_per_s": (rp["take"]["bytes"] / 2**20) / max(rp["take"]["seconds"], 1e-9)}
        print(f"\nper-sample transport (throughput windows): take phase {transport['take_local_us_per_sample']:.1f} "
              f"us/sample local vs {transport['take_rpc_us_per_sample']:.1f} us/sample rpc "
              f"({transport['take_local_ms_per_step']:.2f} vs {transport['take_rpc_ms_per_step']:.2f} ms per step; "
              f"{transport['kib_per_sample']:.1f} KiB of tensors per sample, "
              f"{transport['rpc_take_mib_per_s']:.0f} MiB/s over RPC); 1/samples/s difference rpc - local: "
              f"{transport['throughput_delta_us_per_sample']:.1f} us/sample (every RPC hop and the different "
              f"transform parallelism, not transport alone)")
    if "dataloader" in runs:
        for k in ("local", "rpc"):
            if k in runs:
                each = [x / d for x, d in zip(rounds[k], rounds["dataloader"]) if x and d]
                verdict[f"ratio_{k}_over_dataloader"] = float(np.median(each))
                verdict[f"ratio_{k}_over_dataloader_each_round"] = each
                print(f"  samples/s {k} / dataloader: {verdict[f'ratio_{k}_over_dataloader']:.3f} (median of {len(each)} "
                      f"interleaved rounds: {', '.join(f'{x:.3f}' for x in each)})")

    if len(steprate) == 2:
        rate = {k: float(np.median([r["steps_per_s"] for r in v])) for k, v in steprate.items()}
        verdict["steprate_steps_per_s"] = rate
        verdict["steprate_rpc_over_local"] = rate["rpc"] / rate["local"]
        verdict["steprate_meets_target"] = verdict["steprate_rpc_over_local"] >= STEPRATE["target_rpc_over_local"]
        verdict["steprate_rpc_processes"] = steprate["rpc"][0]["processes"]
        verdict["steprate_rpc_over_local_each_round"] = [r["steps_per_s"] / l["steps_per_s"]
                                                         for l, r in zip(steprate["local"], steprate["rpc"])]
        print(f"\nstep rate at global batch {STEPRATE['global_batch']}, mesh {STEPRATE['mesh']}, default settings "
              f"(rpc: {verdict['steprate_rpc_processes']} processes), medians of {len(steprate['rpc'])} interleaved "
              f"runs: local {rate['local']:.1f} steps/s, rpc {rate['rpc']:.1f} steps/s: rpc/local "
              f"{verdict['steprate_rpc_over_local']:.2f} ({'MEETS' if verdict['steprate_meets_target'] else 'MISSES'} "
              f"the >= {STEPRATE['target_rpc_over_local']} target)")
    out = {"benchmark": "runtimes", "quick": args.quick, "scale": scale, "target": TARGET,
           "config": {**{k: v for k, v in a.items() if k != "root"}, "corpus_root": a["root"], "weights": WEIGHTS,
                      "mesh": MESH, "rank": None, "microbatches": MICROBATCHES, "max_tokens": MAX_TOKENS,
                      "method": METHOD, "workers": WORKERS,
                      "strategy": f"mix(constant) -> distribute(DP) -> cost(attention_flops) -> "
                                  f"balance({METHOD}, oversize=split)"},
           "labels": RUNS,
           "processes_note": ("DataLoader and rpc use 3 processes each: DataLoader = main + 2 worker processes (each opens every source, "
                              "files sharded); rpc = main + 2 RPC workers (Planner, 4 Source Loaders, 2 Data Constructors "
                              "as actors, round robin, transform threads measured); local = 1 process with a "
                              "2-thread transform pool per source (fewer processes, GIL-bound transforms)."),
           "transport_note": ("hand-over = wall time per step of moving the planned samples from the Source Loaders "
                              "to the Data Constructors (rpc: each loader's put RPCs until every constructor answered, "
                              "while the loader refills its buffer for the next step, so including waits for the GIL "
                              "the refill holds; "
                              "serialisation + TensorPipe + deserialisation, averaged over the loaders, which send in "
                              "parallel; local: in-process calls), over the throughput window; the throughput "
                              "delta includes every RPC hop."),
           "runs": runs, "throughput_rounds": rounds, "steprate": {"config": STEPRATE, "runs": steprate},
           "transport": transport,
           "verdict": verdict, "errors": errors}
    write_results(args.out, out, started=t_all, load_start=load_start)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
