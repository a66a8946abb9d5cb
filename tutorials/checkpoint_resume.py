"""Tutorial: checkpoint and resume an OverlordLoader inside a training loop, bit for bit.

``OverlordLoader.state_dict()`` describes what the trainer has *consumed*, not what the prefetch
thread has already built; it holds only plain Python types (source positions, the Planner's step,
mixing carry and schedule state: no sample bytes), so it goes into an ordinary checkpoint and
``torch.load`` reads it back with its default ``weights_only=True``. ``load_state_dict()`` checks it
as a whole (a state of another configuration, or truncated or edited, is refused; one saved under
another mixture needs ``strict=False``), copies it and applies it at the next ``iter()`` or ``next()``, which
continues with exactly the steps an uninterrupted run would have produced.

This walk-through trains (pretends to) for ``--save-at`` steps on the demo corpus's four real
sources, saves the loader's state as a trainer would at a checkpoint, builds a *fresh* loader as a
restarted job would, loads the state and continues; then it checks every tensor of the resumed
steps against an uninterrupted run with ``torch.equal``.

    python tutorials/checkpoint_resume.py
    python tutorials/checkpoint_resume.py --scale test --root /tmp/overlord-corpus --steps 4 --save-at 2
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus, default_corpus_root

WEIGHTS_START = {"web": 0.5, "code": 0.2, "long": 0.1, "caps": 0.2}
WEIGHTS_END = {"web": 0.3, "code": 0.3, "long": 0.2, "caps": 0.2}


def make_loader(corpus, rank: int, steps: int) -> ol.OverlordLoader:
    """Everything a training script sets up once; a resumed job builds the same configuration (the
    loader refuses a state of other sources, seed, strategy or transforms; another mesh or global batch
    resumes elastically, see tutorials/elastic_resume.py)."""
    sources = [corpus.source("web"), corpus.source("code"), corpus.source("long"),
               corpus.source("caps", transform=corpus.transform("caps", max_side=224))]
    mesh = ol.ClientPlaceTree(pp=2, dp=2, cp=2, tp=2)
    schedule = ol.Cosine(WEIGHTS_START, WEIGHTS_END, steps=steps)   # stateful carry: checkpointed too

    def strategy(g: ol.DGraph) -> ol.Plan:
        return (g.mix(schedule).distribute("DP").cost(ol.attention_flops)
                 .balance("karmarkar_karp", microbatches=2, max_tokens=8192, oversize="split")
                 .broadcast_at("TP").plan())

    return ol.OverlordLoader(sources, strategy, mesh, rank=rank, global_batch=32, seq_len=None, seed=0,
                             prefetch=2, workers={"caps": 2}, image_token_id=corpus.image_token_id)


def flatten(x, path=()):
    """(path, leaf) for every tensor / value of a step, in a fixed order, for an exact comparison."""
    if isinstance(x, dict):
        return [leaf for k in sorted(x, key=str) for leaf in flatten(x[k], path + (str(k),))]
    if isinstance(x, (list, tuple)):
        return [leaf for i, v in enumerate(x) for leaf in flatten(v, path + (i,))]
    return [(path, x)]


def identical(a, b) -> tuple[bool, int]:
    """Whether two steps are the same bit for bit, and how many tensors were compared."""
    fa, fb = flatten(a), flatten(b)
    if [p for p, _ in fa] != [p for p, _ in fb]:
        return False, 0
    n = 0
    for (_, x), (_, y) in zip(fa, fb):
        if isinstance(x, torch.Tensor):
            n += 1
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False, n
        elif x != y:
            return False, n
    return True, n


def train_step(batch: dict) -> int:
    """Stands in for forward/backward: count the tokens this rank received."""
    return sum(int(mb["input_ids"].numel()) for mb in batch["microbatches"] or [] if "input_ids" in mb)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(default_corpus_root()), help="where the demo corpus is built / cached")
    ap.add_argument("--scale", default="demo", choices=["demo", "test"])
    ap.add_argument("--steps", type=int, default=8, help="steps in all")
    ap.add_argument("--save-at", type=int, default=5, help="checkpoint after this many steps")
    ap.add_argument("--rank", type=int, default=0, help="this trainer's rank in the 16-rank mesh")
    ap.add_argument("--ckpt-dir", default=None, help="default: a temporary directory")
    args = ap.parse_args(argv)
    if not 0 < args.save_at < args.steps:
        raise SystemExit(f"--save-at must be between 1 and --steps - 1, got {args.save_at}")
    corpus = build_demo_corpus(args.root, scale=args.scale)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(args.ckpt_dir or tmp, "loader.pt")

        # 1. the job runs, and checkpoints after --save-at steps
        with make_loader(corpus, args.rank, args.steps) as loader:
            for step, batch in enumerate(loader):
                tokens = train_step(batch)
                print(f"step {batch['step']}: rank {args.rank} trained on {tokens} tokens ({batch['delivery']})")
                if step + 1 == args.save_at:
                    # the prefetch thread has built steps ahead by now; the state is still "after this step"
                    torch.save({"loader": loader.state_dict(), "step": step + 1}, path)
                    print(f"  checkpoint after step {step}: {os.path.getsize(path)} bytes -> {path}")
                    break                                  # ... and the job dies here

        # 2. a restarted job: a fresh loader, the same configuration, the saved state
        ckpt = torch.load(path)                            # weights_only=True: plain types only
        resumed = []
        with make_loader(corpus, args.rank, args.steps) as loader:
            loader.load_state_dict(ckpt["loader"])
            for batch in loader:                           # continues at step ckpt["step"]
                print(f"step {batch['step']} (resumed): rank {args.rank} trained on {train_step(batch)} tokens")
                resumed.append(batch)
                if len(resumed) == args.steps - ckpt["step"]:
                    break

    # 3. the check: the same steps from one uninterrupted run
    with make_loader(corpus, args.rank, args.steps) as loader:
        reference = [batch for _, batch in zip(range(args.steps), loader)][args.save_at:]
    results = [identical(a, b) for a, b in zip(resumed, reference)]
    same = len(resumed) == len(reference) and all(ok for ok, _ in results)
    tensors = sum(n for _, n in results)
    print(f"\nresumed steps {[b['step'] for b in resumed]} vs uninterrupted steps {[b['step'] for b in reference]}: "
          f"{'identical' if same else 'DIFFERENT'} ({tensors} tensors compared with torch.equal)")
    return {"identical": same, "resumed_steps": [b["step"] for b in resumed], "tensors_compared": tensors,
            "checkpoint_step": ckpt["step"]}


if __name__ == "__main__":
    main()
