"""Mixing accuracy: how closely each step's realised source mixture follows a curriculum.

The schedule is one curriculum, ``ol.Linear({"a": .8, "b": .2}, {"a": .5, "b": .5}, steps=1000)``
(the fraction of source ``a`` falls linearly from 0.8 at step 0 to 0.5 at step 1000), run for
1,000 steps at a global batch of 64 and of 256 samples, through two mixers:

* **this library**: the Planner's ``mix`` primitive, in the strategy
  ``g.mix(schedule).distribute("DP").cost(ol.token_count).balance("greedy", microbatches=1).plan()``
  of an ``ol.Planner(strategy, ol.ClientPlaceTree(dp=1), global_batch, seed)`` fed the buffer
  metadata of two synthetic "web" sources (``torchdata_overlord.sim``: ``SimulatedLoaders``, FIFO
  buffers refilled after each plan). Only metadata is planned, no file is read: the comparison is
  of the mixers, not of I/O. The step's realised counts are counted from ``plan.records`` (and
  checked against ``plan.stats["mixture"]["counts"]``).
* **torchdata 0.11's** ``torchdata.nodes.MultiNodeWeightedSampler`` over two real
  ``torchdata.nodes.IterableWrapper`` nodes, each wrapping an infinite, stateful (``state_dict`` /
  ``load_state_dict``) stream of ``(source, index)`` labels, batched by ``torchdata.nodes.Batcher``
  to the same global batch; ``rank=0, world_size=1`` (one sampler draws the whole global batch).
  Its weights are static, so a user who follows a curriculum must re-weight it every step. Three
  ways a torchdata user can do that, each measured:

  - ``rebuild_from_state`` (the baseline of the headline ratios): every step, build a new
    ``MultiNodeWeightedSampler(nodes, step_weights, seed=seed)`` and ``Batcher`` over the same
    source nodes and ``reset()`` it from the previous step's ``Batcher.state_dict()``. The random
    stream and the sources' positions carry over; only the weights change (the sampler regenerates
    its pending draws from the saved generator state with the new weights).
  - ``reweight_new_epoch``: one sampler; every step set ``sampler.weights = step_weights`` and
    ``reset()`` the Batcher, which starts a new sampler epoch (a fresh random stream derived from
    (seed, epoch)) with the new weights; the sources continue where they were (their iterables
    resume from their position).
  - ``recreate_same_seed``: every step, a new ``MultiNodeWeightedSampler(nodes, step_weights,
    seed=seed)`` and ``Batcher``, ``reset()`` without a state (the naive "recreate it with the
    step's weights" that keeps the source nodes): every step replays the same random draws.

Measured for each (source ``a``; source ``b`` is its complement, with the same deviations): the
realised fraction ``n_a(s) / B`` of every step ``s`` against the target fraction ``w_a(s)``; for
windows of W = 1, 10, 100 steps, the largest over all W-step sliding windows of
``|mean realised - mean target|`` over the window; and the cumulative count error
``sum n_a - B * sum w_a`` in samples (largest magnitude over the run, and at the end). Every run
also checks that each step has exactly ``B`` samples and that no sample is lost or repeated (the
sample indices taken from each source are 0, 1, 2, ... in order). The library's counts do not
depend on its seed (the seed only orders the batch); the baseline's do, so the baseline runs
several seeds. Ratios are baseline / library (how many times larger the baseline's deviation is).

For two sources the library's counts round the carried target to the nearest integer, so its
W-step window deviation is at most 1 / (W * B) (its cumulative error at most half a sample); the
design's general guarantee (cumulative error under one sample, any number of sources) gives
2 / (W * B). An i.i.d. sampler deviates by about sqrt(w (1 - w) / (W * B)) per window.

    python benchmarks/mixing_accuracy.py            # full: 1,000 steps, batch 64 and 256, 5 seeds (~1 min)
    python benchmarks/mixing_accuracy.py --quick    # CI smoke: 200 steps (curriculum over 200), batch 64, 2 seeds

Prints a table, writes ``benchmarks/results/mixing_accuracy.json`` (``--out`` to change) and a
plot next to it (same name, ``.png``) of realised against target fraction and of the cumulative
count error, per step. Exits non-zero only if a run failed (raised, gave a step a batch of the
wrong size, or lost or repeated a sample), never for the figures themselves.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from common import write_results  # noqa: E402
import torchdata_overlord as ol  # noqa: E402
from torchdata_overlord.sim import SimulatedLoaders, SyntheticSource  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
START, END = {"a": 0.8, "b": 0.2}, {"a": 0.5, "b": 0.5}
NAMES = ("a", "b")
WINDOWS = (1, 10, 100)
BASELINES = ("rebuild_from_state", "reweight_new_epoch", "recreate_same_seed")
PRIMARY = "rebuild_from_state"
STRATEGY = 'g.mix(schedule).distribute("DP").cost(ol.token_count).balance("greedy", microbatches=1).plan()'


def curriculum(steps: int) -> ol.Linear:
    return ol.Linear(START, END, steps=steps)


def target_fraction(schedule, steps: int) -> np.ndarray:
    """The schedule's normalised weight of source ``a`` at each step."""
    out = np.empty(steps)
    for s in range(steps):
        w = schedule.weights(s)
        out[s] = w["a"] / sum(w.values())
    return out


def contiguous(indices: list[int]) -> bool:
    """The indices a source gave, in order: exactly 0, 1, 2, ... (nothing lost, nothing repeated)."""
    return np.array_equal(np.asarray(indices, dtype=np.int64), np.arange(len(indices)))


# --- this library: the Planner's mix on metadata -------------------------------------------------

def run_library(steps: int, batch: int, seed: int, schedule_steps: int) -> dict:
    schedule = curriculum(schedule_steps)

    def strategy(g):
        return g.mix(schedule).distribute("DP").cost(ol.token_count).balance("greedy", microbatches=1).plan()

    planner = ol.Planner(strategy, ol.ClientPlaceTree(dp=1), global_batch=batch, seed=seed)
    loaders = SimulatedLoaders([SyntheticSource(n, "web") for n in NAMES], buffer_size=batch)
    counts = np.zeros(steps, dtype=np.int64)
    sizes = np.zeros(steps, dtype=np.int64)
    taken = {n: [] for n in NAMES}
    stats_agree = True
    t0 = time.perf_counter()
    for s in range(steps):
        plan = planner.plan(loaders.buffers())
        recs = plan.records
        c = recs.source_counts()
        counts[s], sizes[s] = c.get("a", 0), len(recs)
        stats_agree &= {k: int(v) for k, v in plan.stats["mixture"]["counts"].items()} == {n: c.get(n, 0) for n in NAMES}
        for sid, name in enumerate(recs.sources):
            taken[name].extend(np.sort(recs.index[recs.source_id == sid]).tolist())
        loaders.consume(plan)
    seconds = time.perf_counter() - t0
    return {"counts_a": counts, "sizes": sizes, "seconds": seconds, "stats_agree": bool(stats_agree),
            "no_sample_lost_or_repeated": all(contiguous(v) for v in taken.values()),
            "final_max_abs_error_reported": float(plan.stats["mixture"]["max_abs_error"])}


# --- torchdata's MultiNodeWeightedSampler ----------------------------------------------------------

class LabelStream:
    """An infinite stream of ``(source, index)`` labels; Stateful, so ``IterableWrapper`` saves
    and restores its position instead of fast-forwarding, and a new ``iter()`` resumes where the
    last one stopped (as iterating a generator object would)."""

    def __init__(self, name: str):
        self.name, self.pos = name, 0

    def __iter__(self):
        while True:
            i = self.pos
            self.pos += 1
            yield (self.name, i)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = int(state["pos"])


def run_baseline(variant: str, steps: int, batch: int, seed: int, schedule_steps: int) -> dict:
    from torchdata.nodes import Batcher, IterableWrapper, MultiNodeWeightedSampler
    from torchdata.nodes.samplers.stop_criteria import StopCriteria

    schedule = curriculum(schedule_steps)
    nodes = {n: IterableWrapper(LabelStream(n)) for n in NAMES}

    def weights(s):
        w = schedule.weights(s)
        total = sum(w.values())
        return {n: float(w[n] / total) for n in NAMES}

    def sampler(w):
        return MultiNodeWeightedSampler(nodes, w, stop_criteria=StopCriteria.CYCLE_FOREVER,
                                        rank=0, world_size=1, seed=seed)

    counts = np.zeros(steps, dtype=np.int64)
    sizes = np.zeros(steps, dtype=np.int64)
    taken = {n: [] for n in NAMES}
    state, one = None, None
    t0 = time.perf_counter()
    for s in range(steps):
        w = weights(s)
        if variant == "rebuild_from_state":
            batcher = Batcher(sampler(w), batch_size=batch, drop_last=True)
            batcher.reset(state)                  # None at step 0: a fresh start
        elif variant == "reweight_new_epoch":
            if one is None:
                one = Batcher(sampler(w), batch_size=batch, drop_last=True)
            one.source.weights = w                # the sampler reads its weights when it (re)starts
            one.reset()                           # a new epoch: a fresh random stream with these weights
            batcher = one
        elif variant == "recreate_same_seed":
            batcher = Batcher(sampler(w), batch_size=batch, drop_last=True)
            batcher.reset()
        else:
            raise ValueError(f"unknown baseline variant {variant!r}")
        items = next(batcher)
        if variant == "rebuild_from_state":
            state = batcher.state_dict()
        sizes[s] = len(items)
        counts[s] = sum(1 for name, _ in items if name == "a")
        for name, i in items:
            taken[name].append(i)
    seconds = time.perf_counter() - t0
    return {"counts_a": counts, "sizes": sizes, "seconds": seconds,
            "no_sample_lost_or_repeated": all(contiguous(v) for v in taken.values())}


# --- the figures ---------------------------------------------------------------------------------

def window_deviation(counts: np.ndarray, target: np.ndarray, batch: int, w: int) -> float:
    """Largest |mean realised fraction - mean target fraction| over every ``w``-step sliding window."""
    diff = counts / batch - target
    c = np.concatenate([[0.0], np.cumsum(diff)])
    if len(diff) < w:
        return float("nan")
    return float(np.max(np.abs(c[w:] - c[:-w])) / w)


def figures(run: dict, target: np.ndarray, batch: int) -> dict:
    counts = run["counts_a"]
    cum = np.cumsum(counts) - batch * np.cumsum(target)
    out = {f"window_{w}": window_deviation(counts, target, batch, w) for w in WINDOWS}
    out.update({"cum_error_max_abs_samples": float(np.max(np.abs(cum))), "cum_error_final_samples": float(cum[-1]),
                "batch_size_min": int(run["sizes"].min()), "batch_size_max": int(run["sizes"].max()),
                "every_step_full_batch": bool((run["sizes"] == batch).all()),
                "no_sample_lost_or_repeated": run["no_sample_lost_or_repeated"], "seconds": round(run["seconds"], 3)})
    if "stats_agree" in run:
        out["plan_stats_mixture_agrees"] = run["stats_agree"]
        out["final_max_abs_error_reported"] = run["final_max_abs_error_reported"]
    return out


KEYS = [f"window_{w}" for w in WINDOWS] + ["cum_error_max_abs_samples"]


def spread(per_seed: dict) -> dict:
    """Mean, min and max of each headline figure over seeds."""
    out = {}
    for k in KEYS:
        v = [r[k] for r in per_seed.values()]
        out[k] = {"mean": float(np.mean(v)), "min": float(np.min(v)), "max": float(np.max(v))}
    return out


def ratio(a: float, b: float):
    return None if b <= 0 else a / b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 steps, batch 64, 2 seeds (CI smoke test)")
    ap.add_argument("--out", type=Path, default=RESULTS / "mixing_accuracy.json")
    args = ap.parse_args(argv)
    t_all = time.perf_counter()
    steps = 200 if args.quick else 1000
    batches = [64] if args.quick else [64, 256]
    seeds = [0, 1] if args.quick else [0, 1, 2, 3, 4]
    target = target_fraction(curriculum(steps), steps)
    floor = {b: float(np.max(np.abs(np.round(b * target) - b * target)) / b) for b in batches}
    print(f"curriculum a:b 80/20 -> 50/50 over {steps} steps; global batch {batches}; seeds {seeds}; "
          f"windows {list(WINDOWS)} steps", flush=True)

    runs, series, errors, lib_counts = {}, {}, {}, {}
    for b in batches:
        runs[str(b)] = {"library": {}, **{v: {} for v in BASELINES}}
        for method in ("library",) + BASELINES:
            t0 = time.perf_counter()
            for seed in seeds:
                try:
                    r = (run_library(steps, b, seed, steps) if method == "library"
                         else run_baseline(method, steps, b, seed, steps))
                except Exception as e:   # noqa: BLE001 (recorded; the exit status says a run failed)
                    errors[f"{method}/batch{b}/seed{seed}"] = f"{type(e).__name__}: {e}"
                    continue
                runs[str(b)][method][str(seed)] = figures(r, target, b)
                if method == "library":
                    lib_counts.setdefault(b, []).append(r["counts_a"])
                if seed == seeds[0]:
                    series.setdefault(str(b), {})[method] = r["counts_a"].tolist()
            print(f"  batch {b:>4} {method:>19}: {len(runs[str(b)][method])}/{len(seeds)} seeds in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)

    summary, ratios = {}, {}
    for b in batches:
        sb = {m: spread(v) for m, v in runs[str(b)].items() if v}
        summary[str(b)] = sb
        lib = runs[str(b)]["library"].get(str(seeds[0]))
        if lib is None:
            continue
        bound = {f"window_{w}": 1.0 / (w * b) for w in WINDOWS}
        summary[str(b)]["library_bound_two_sources"] = bound
        summary[str(b)]["integer_floor_window_1"] = floor[b]
        summary[str(b)]["library_counts_independent_of_seed"] = all(
            np.array_equal(c, lib_counts[b][0]) for c in lib_counts[b])
        ratios[str(b)] = {}
        for v in BASELINES:
            if v not in sb:
                continue
            ratios[str(b)][v] = {k: {"mean": ratio(sb[v][k]["mean"], lib[k]), "min": ratio(sb[v][k]["min"], lib[k]),
                                     "max": ratio(sb[v][k]["max"], lib[k])} for k in KEYS}

    def fmt(x):
        return "n/a" if x is None else (f"{x:,.0f}" if x >= 1000 else f"{x:.3g}")

    print("\nmax |realised - target| fraction of source a over sliding windows (mean over seeds [min-max]); "
          "cumulative count error in samples")
    head = f"{'batch':>5} {'mixer':>19} " + " ".join(f"{'W=' + str(w):>22}" for w in WINDOWS) + f" {'max |cum err|':>22}"
    print(head)
    for b in batches:
        for m, s in summary[str(b)].items():
            if m not in ("library",) + BASELINES:
                continue
            cells = []
            for k in KEYS:
                c = s[k]
                cells.append(f"{c['mean']:.5f}" if c["min"] == c["max"] else
                             f"{c['mean']:.5f} [{c['min']:.4f}-{c['max']:.4f}]")
            cells[-1] = (f"{s[KEYS[-1]]['mean']:.2f}" if s[KEYS[-1]]['min'] == s[KEYS[-1]]['max'] else
                         f"{s[KEYS[-1]]['mean']:.1f} [{s[KEYS[-1]]['min']:.0f}-{s[KEYS[-1]]['max']:.0f}]")
            print(f"{b:>5} {m:>19} " + " ".join(f"{c:>22}" for c in cells))
        if str(b) in ratios:
            bd = summary[str(b)]["library_bound_two_sources"]
            print(f"{b:>5} {'(library bound)':>19} " + " ".join(f"{bd[f'window_{w}']:>22.5f}" for w in WINDOWS)
                  + f" {0.5:>22.2f}")
            print(f"{b:>5} {'(integer floor)':>19} {floor[b]:>22.5f}   (no integer count per step can do better at W=1)")
    print("\nratio baseline / library (mean over seeds [min-max]; larger = the library follows the schedule closer)")
    print(f"{'batch':>5} {'baseline':>19} " + " ".join(f"{'W=' + str(w):>22}" for w in WINDOWS) + f" {'max |cum err|':>22}")
    for b, rb in ratios.items():
        for v, r in rb.items():
            print(f"{b:>5} {v:>19} " + " ".join(f"{fmt(r[k]['mean']) + ' [' + fmt(r[k]['min']) + '-' + fmt(r[k]['max']) + ']':>22}"
                                                for k in KEYS))
    checks = {f"{b}/{m}/{s}": {k: r[k] for k in ("every_step_full_batch", "no_sample_lost_or_repeated")}
              for b in runs for m in runs[b] for s, r in runs[b][m].items()}
    bad = [k for k, v in checks.items() if not all(v.values())]
    print(f"\nevery step a full batch, no sample lost or repeated: {'yes, in every run' if not bad else 'NO in ' + ', '.join(bad)}")
    if errors:
        print("errors:\n  " + "\n  ".join(f"{k}: {v}" for k, v in errors.items()))

    plot_path = args.out.with_suffix(".png")
    if series:
        plot(plot_path, series, target, steps)
        print(f"plot: {plot_path}")
    out = {"benchmark": "mixing_accuracy", "quick": args.quick,
           "config": {"steps": steps, "schedule": {"kind": "ol.Linear", "start": START, "end": END, "steps": steps},
                      "global_batches": batches, "windows": list(WINDOWS), "seeds": seeds, "sources": list(NAMES),
                      "measured_source": "a",
                      "library": {"strategy": STRATEGY, "mesh": {"dp": 1},
                                  "metadata": "two SyntheticSource(name, 'web'), SimulatedLoaders(buffer_size=global batch)"},
                      "baseline": {"node": "torchdata.nodes.MultiNodeWeightedSampler (torchdata 0.11)",
                                   "sources": "IterableWrapper over an infinite Stateful (source, index) stream each",
                                   "batching": "torchdata.nodes.Batcher(batch_size=global batch, drop_last=True)",
                                   "stop_criteria": "CYCLE_FOREVER", "rank": 0, "world_size": 1,
                                   "primary_variant": PRIMARY,
                                   "variants": {
                                       "rebuild_from_state": "each step: new sampler with the step's weights + "
                                       "Batcher, reset() from the previous step's Batcher.state_dict()",
                                       "reweight_new_epoch": "one sampler: each step set sampler.weights and "
                                       "reset() the Batcher (new epoch, fresh random stream from (seed, epoch))",
                                       "recreate_same_seed": "each step: new sampler with the step's weights and "
                                       "the same seed + Batcher, reset() without state (same random draws every step)"}},
                      "figure_definitions": {
                          "window_W": "max over W-step sliding windows of |mean realised fraction of a - mean target|",
                          "cum_error_max_abs_samples": "max over steps of |cumulative realised count of a - "
                                                       "global batch x cumulative target fraction|",
                          "ratios": "baseline figure / library figure (seed 0 for the library: its counts do not "
                                    "depend on the seed)"}},
           "runs": runs, "summary": summary, "ratios": ratios,
           "series": {"target_fraction_a": target.tolist(), "counts_a_seed0": series},
           "checks_failed": bad, "errors": errors, "plot": str(plot_path)}
    write_results(args.out, out, started=t_all)
    return 1 if errors or bad else 0       # a run that raised or gave a short batch or lost a sample failed


def plot(path: Path, series: dict, target: np.ndarray, steps: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(steps)
    cols = len(series)
    fig, axes = plt.subplots(2, cols, figsize=(6.5 * cols, 7), squeeze=False)
    style = {"library": dict(color="C0", lw=1.4, zorder=3), "rebuild_from_state": dict(color="C1", lw=0.7, alpha=0.8),
             "reweight_new_epoch": dict(color="C2", lw=0.7, alpha=0.6), "recreate_same_seed": dict(color="C3", lw=0.7, alpha=0.6)}
    for j, (b, per) in enumerate(series.items()):
        b_int = int(b)
        top, bot = axes[0][j], axes[1][j]
        for m in (PRIMARY, "library"):
            if m in per:
                top.plot(x, np.asarray(per[m]) / b_int, label=m if m == "library" else f"MultiNodeWeightedSampler ({m})",
                         **style[m])
        top.plot(x, target, "k--", lw=1.0, label="target", zorder=4)
        top.set(title=f"global batch {b}: realised fraction of source a per step", xlabel="step", ylabel="fraction of a")
        top.legend(fontsize=8)
        for m, counts in per.items():
            cum = np.cumsum(counts) - b_int * np.cumsum(target)
            bot.plot(x, cum, label=m if m == "library" else f"MNWS {m}", **style[m])
        bot.axhline(0, color="k", lw=0.5)
        bot.set_yscale("symlog", linthresh=1.0)      # the library's +-0.5 and the baselines' thousands on one axis
        bot.set(title="cumulative realised - target count of a (samples, symlog), seed 0", xlabel="step",
                ylabel="samples")
        bot.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
