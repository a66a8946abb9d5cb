"""Tutorial: curriculum mixing schedules, and a dynamic mixture driven by per-source loss.

``mix(schedule)`` draws each step's global batch from the sources by a schedule of weights:
``ol.Linear`` / ``ol.Cosine`` interpolate between two mixtures (a curriculum, a warm-up),
``ol.Piecewise`` switches stages at given steps, and ``ol.Dynamic`` moves its weights from trainer
feedback between steps (here: a simulated per-source loss; sources with higher loss get more
weight). Per-step counts come from largest remainder with carried error, not i.i.d. draws, so
every source's *cumulative* count stays within one sample of the schedule's cumulative target at
every step; this walk-through prints the realised counts against the targets and checks that.

It runs on the demo corpus's real ``web``, ``code`` and ``long`` Parquet sources, stepping the
embedded runtime (``LocalJob``) by hand: a dynamic schedule must see step s's feedback before
step s+1 is planned, and ``OverlordLoader`` plans ahead on its prefetch thread.

    python tutorials/curriculum_mixing.py
    python tutorials/curriculum_mixing.py --scale test --root /tmp/overlord-corpus --steps 6
"""

from __future__ import annotations

import argparse
import math

import torchdata_overlord as ol
from torchdata_overlord.runtime import LocalJob
from torchdata_overlord.sim.corpus import build_demo_corpus, default_corpus_root

SOURCES = ("web", "code", "long")
START = {"web": 0.8, "code": 0.2, "long": 0.0}        # warm up on short web text ...
END = {"web": 0.5, "code": 0.3, "long": 0.2}          # ... then bring in code and long documents


def schedules(steps: int) -> dict[str, ol.Schedule]:
    half = max(steps // 2, 1)
    return {
        "linear": ol.Linear(START, END, steps=steps),
        "cosine": ol.Cosine(START, END, steps=steps),
        "piecewise": ol.Piecewise({0: START, half: END}),
        "dynamic": ol.Dynamic({"web": 1, "code": 1, "long": 1}, lr=1.0, floor=0.05),
    }


class SimulatedLoss:
    """Per-source training loss that falls with the samples of that source seen so far:
    ``floor + scale / sqrt(1 + seen / 100)``. Code starts high and is learnt fast, long documents
    stay hard. A real trainer reports the mean loss of each source's tokens in the step."""

    FLOOR = {"web": 2.0, "code": 1.0, "long": 2.2}
    SCALE = {"web": 1.5, "code": 3.0, "long": 1.0}

    def __init__(self):
        self.seen = {s: 0 for s in SOURCES}

    def step(self, counts: dict[str, int]) -> dict[str, float]:
        for s, n in counts.items():
            self.seen[s] += n
        return {s: self.FLOOR[s] + self.SCALE[s] / math.sqrt(1 + self.seen[s] / 100) for s in SOURCES}


def run(corpus, schedule: ol.Schedule, steps: int, global_batch: int, name: str) -> dict:
    def strategy(g: ol.DGraph) -> ol.Plan:
        return (g.mix(schedule).distribute("DP").cost(ol.attention_flops)
                 .balance("greedy", microbatches=2, max_tokens=8192, oversize="split").plan())

    mesh = ol.ClientPlaceTree(dp=4)
    job = LocalJob([corpus.source(s) for s in SOURCES], strategy, mesh, global_batch, seq_len=None)
    loss = SimulatedLoss() if isinstance(schedule, ol.Dynamic) else None
    cum_target = {s: 0.0 for s in SOURCES}
    cum_real = {s: 0 for s in SOURCES}
    worst = 0.0
    print(f"\n{name}: {type(schedule).__name__}" + ("" if loss is None else " (updated from the simulated loss)"))
    print(f"{'step':>4} | " + " | ".join(f"{s + ' real/target':>16}" for s in SOURCES)
          + " | max |cum. real - cum. target|")
    try:
        for step in range(steps):
            w = schedule.weights(step)                 # what the Planner will use for this step
            total = sum(w.values())
            target = {s: global_batch * w.get(s, 0.0) / total for s in SOURCES}
            res = job.step(ranks=[0])                  # plan, stage and build the step (rank 0 only)
            # the realised mixture: the step's sampled set as planned (sources of the plan's records)
            real = {s: res.plan.records.source_counts().get(s, 0) for s in SOURCES}
            for s in SOURCES:
                cum_target[s] += target[s]
                cum_real[s] += real[s]
            dev = max(abs(cum_real[s] - cum_target[s]) for s in SOURCES)
            worst = max(worst, dev)
            print(f"{step:>4} | " + " | ".join(f"{real[s]:>7} / {target[s]:6.2f}" for s in SOURCES) + f" | {dev:.3f}")
            if loss is not None:
                feedback = loss.step(real)             # the trainer's per-source loss for this step ...
                schedule.update(feedback)              # ... moves the weights for the next one
                print("       loss " + "  ".join(f"{s} {v:.2f}" for s, v in feedback.items()) + "  -> weights "
                      + "  ".join(f"{s} {schedule.weights(step + 1)[s]:.3f}" for s in SOURCES))
            # the library's own account agrees: plan.stats["mixture"] carries counts and the carried error
            assert res.plan.stats["mixture"]["counts"] == {s: c for s, c in real.items() if s in w}
    finally:
        job.close()
    print(f"max cumulative deviation over {steps} steps: {worst:.3f} samples (< 1 by construction)")
    return {"max_cumulative_deviation": worst, "cumulative": cum_real,
            "cumulative_target": {s: round(v, 6) for s, v in cum_target.items()},
            "final_weights": schedule.weights(steps)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(default_corpus_root()), help="where the demo corpus is built / cached")
    ap.add_argument("--scale", default="demo", choices=["demo", "test"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=30, help="not a multiple of most targets, on purpose")
    args = ap.parse_args(argv)

    corpus = build_demo_corpus(args.root, scale=args.scale)
    print(f"global batch {args.global_batch}; curriculum {START} -> {END} over {args.steps} steps")
    figures = {name: run(corpus, sched, args.steps, args.global_batch, name)
               for name, sched in schedules(args.steps).items()}
    figures["max_cumulative_deviation"] = max(f["max_cumulative_deviation"] for f in figures.values())
    print(f"\nworst cumulative deviation over every schedule and step: "
          f"{figures['max_cumulative_deviation']:.3f} samples")
    return figures


if __name__ == "__main__":
    main()
