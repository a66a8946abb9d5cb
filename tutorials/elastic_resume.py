"""Tutorial: checkpoint a job at dp=4 and resume it at dp=3 cp=2, the same mixture, nothing lost or repeated.

A job restarted on another mesh (nodes lost or added, parallelism retuned) loads the state its loader
saved: ``load_state_dict`` keeps what is placement-free (each source's consumed position, the step, the
mixer's carried counts, the feedback not yet planned, the seed) and re-derives the rest (buckets, Data
Constructors, routes) for the new ``ClientPlaceTree``; the global batch may change too. It returns the
changes in words. What "consumed" means when ranks disagree is in :mod:`torchdata_overlord.elastic`.

This walk-through runs ``--save-at`` steps at dp=4 (global batch 32), saves the state as a trainer
would, resumes at dp=3 cp=2 (global batch 24) for the remaining steps, and prints per source how many
samples each part delivered, against the schedule's cumulative target; then it checks that no sample
was delivered twice and that each source delivered exactly its first samples in read order (what an
uninterrupted run of that many samples delivers).

    python tutorials/elastic_resume.py
    python tutorials/elastic_resume.py --scale test --root /tmp/overlord-corpus --steps 5 --save-at 2
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile

import torch

import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus, default_corpus_root

WEIGHTS = {"web": 0.5, "code": 0.25, "long": 0.1, "caps": 0.15}
NAMES = tuple(WEIGHTS)


def strategy(g: ol.DGraph) -> ol.Plan:
    return (g.mix(WEIGHTS).distribute("DP").cost(ol.attention_flops)
            .balance("karmarkar_karp", microbatches=2, max_tokens=8192, oversize="split").plan())


def make_loader(corpus, mesh: ol.ClientPlaceTree, global_batch: int) -> ol.OverlordLoader:
    """The same sources, seed and strategy on any mesh; ``rank=None`` simulates every rank here."""
    sources = [corpus.source(n) for n in NAMES]
    return ol.OverlordLoader(sources, strategy, mesh, rank=None, global_batch=global_batch, seq_len=None, seed=0,
                             image_token_id=corpus.image_token_id)


def delivered(item) -> dict[str, set]:
    """Per source, the samples one step delivered (a key once, whatever CP/TP replicas received it)."""
    out = collections.defaultdict(set)
    for per_rank in item.values():
        for mb in per_rank["microbatches"] or []:
            for key in mb["sample_keys"]:
                source, index = key.rsplit(":", 1)
                out[source].add(int(index))
    return out


def run(loader, steps: int, seen: dict[str, list]) -> None:
    for _, item in zip(range(steps), loader):
        for s, idx in delivered(item).items():
            seen[s] += sorted(idx)
        mix = loader.last_plan.stats["mixture"]
        print(f"  step {next(iter(item.values()))['step']}: counts {mix['counts']}, cumulative {mix['cumulative']}, "
              f"largest gap to the schedule {mix['max_abs_error']:.2f} samples")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(default_corpus_root()), help="where the demo corpus is built / cached")
    ap.add_argument("--scale", default="demo", choices=["demo", "test"])
    ap.add_argument("--steps", type=int, default=8, help="steps in all")
    ap.add_argument("--save-at", type=int, default=4, help="checkpoint after this many steps at dp=4")
    args = ap.parse_args(argv)
    if not 0 < args.save_at < args.steps:
        raise SystemExit(f"--save-at must be between 1 and --steps - 1, got {args.save_at}")
    corpus = build_demo_corpus(args.root, scale=args.scale)
    before, after = collections.defaultdict(list), collections.defaultdict(list)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "loader.pt")
        print("dp=4, global batch 32:")
        with make_loader(corpus, ol.ClientPlaceTree(dp=4), 32) as loader:
            run(loader, args.save_at, before)
            torch.save({"loader": loader.state_dict()}, path)        # the job stops here

        print("resumed at dp=3 cp=2, global batch 24:")
        with make_loader(corpus, ol.ClientPlaceTree(dp=3, cp=2), 24) as loader:
            changes = loader.load_state_dict(torch.load(path)["loader"])
            for c in changes:
                print(f"  {c}")
            run(loader, args.steps - args.save_at, after)

    print(f"\n{'source':>6} {'before':>7} {'after':>6} {'total':>6} {'repeated':>9} {'first in read order':>20}")
    ok = True
    for s in NAMES:
        got = before[s] + after[s]
        src = corpus.source(s)                       # read afresh: the order every run reads it in
        first = sorted(next(src)[0] for _ in range(len(got)))
        repeated = len(got) - len(set(got))
        prefix = sorted(got) == first
        ok &= repeated == 0 and prefix
        print(f"{s:>6} {len(before[s]):>7} {len(after[s]):>6} {len(got):>6} {repeated:>9} {str(prefix):>20}")
    print(f"\n{'nothing lost or repeated' if ok else 'MISMATCH'}: each source delivered exactly its first samples")
    return {"ok": ok, "changes": changes, "before": {s: len(v) for s, v in before.items()},
            "after": {s: len(v) for s, v in after.items()}}


if __name__ == "__main__":
    main()
