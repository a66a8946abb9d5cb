"""Main demo: plan a realistic multi-source VLM job on the embedded runtime.

Four sources (web text, code, heavy-tailed long-context documents, captioned images) feed a
4D mesh. Each step the Planner mixes them on a curriculum, balances the backbone by attention
FLOPs across DP ranks and microbatches, balances images across all ranks for a world-wide-DP
encoder, and the demo prints the per-rank cost spread before (arrival order) and after
balancing, and the realised mixture against its target.

    python -m torchdata_overlord.demo --steps 8 --mesh pp=2,dp=4,cp=2,tp=2
"""

from __future__ import annotations

import argparse
import sys

import torchdata_overlord as ol
from torchdata_overlord.sim import SimulatedLoaders, SyntheticSource

SOURCES = [SyntheticSource("web", "web"), SyntheticSource("code", "code"),
           SyntheticSource("long", "long"), SyntheticSource("caps", "image_text")]
START = {"web": 0.55, "code": 0.15, "long": 0.05, "caps": 0.25}
END = {"web": 0.35, "code": 0.25, "long": 0.15, "caps": 0.25}


def make_strategy(method: str, microbatches: int, max_tokens: int, steps: int):
    """The job's data plane, as a user writes it (paper Fig. 9, right: VLM hybrid balance)."""
    schedule = ol.Linear(START, END, steps=steps)

    def strategy(g: ol.DGraph) -> ol.Plan:
        g = g.mix(schedule)
        images = (g.view("image").distribute("DP", module="encoder")
                  .cost(ol.encoder_cost).balance(method, microbatches=1))
        text = (g.view("text").distribute("DP").cost(ol.attention_flops)
                .balance(method, microbatches=microbatches, max_tokens=max_tokens, oversize="split")
                .broadcast_at("TP"))
        return text.plan(encoder=images)

    return strategy


def parse_mesh(text: str) -> ol.ClientPlaceTree:
    try:
        sizes = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise SystemExit(f"--mesh must look like pp=2,dp=4,cp=2,tp=2, got {text!r}") from None
    return ol.ClientPlaceTree(**sizes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--mesh", default="pp=2,dp=4,cp=2,tp=2")
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32768, help="tokens per packed microbatch of a DP rank")
    ap.add_argument("--method", default="karmarkar_karp", choices=["greedy", "karmarkar_karp"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show-plan", action="store_true", help="draw the last step's plan")
    args = ap.parse_args(argv)

    mesh = parse_mesh(args.mesh)
    mesh.attach("encoder", dp=mesh.world_size)
    loaders = SimulatedLoaders(SOURCES, buffer_size=4 * args.global_batch)
    balanced = ol.Planner(make_strategy(args.method, args.microbatches, args.max_tokens, args.steps),
                          mesh, args.global_batch, seed=args.seed)
    arrival = ol.Planner(make_strategy("arrival", args.microbatches, args.max_tokens, args.steps),
                         mesh, args.global_batch, seed=args.seed)
    print(f"mesh {mesh.describe()} ({mesh.world_size} ranks), global batch {args.global_batch}, "
          f"{args.microbatches} microbatches of <= {args.max_tokens} tokens, method {args.method}")
    print(mesh.render(max_children=2))
    print(f"sources: {', '.join(f'{s.name} ({s.kind})' for s in SOURCES)}; curriculum {START} -> {END}")
    print()
    head = (f"{'step':>4} | {'backbone max/mean':>17} | {'lockstep/bound':>14} | {'encoder max/mean':>16} | "
            f"{'mb':>2} | realised mixture (target)")
    print(head)
    print("-" * len(head))
    plan = None
    for step in range(args.steps):
        bufs = loaders.buffers()
        plan, base = balanced.plan(bufs), arrival.plan(bufs)
        if base.sampled_keys() != plan.sampled_keys():
            raise RuntimeError("both planners must sample the same batch (same seed and schedule)")
        s, b = plan.stats, base.stats
        enc, enc0 = plan.module("encoder").stats, base.module("encoder").stats
        mix = s["mixture"]
        realised = "  ".join(f"{k} {mix['counts'][k] / args.global_batch:.3f} ({mix['weights'][k]:.3f})"
                             for k in sorted(mix["weights"]))
        realised += f"  | cum. error {mix['max_abs_error']:.2f} samples"
        print(f"{step:>4} | {b['max_over_mean']:6.3f} -> {s['max_over_mean']:6.3f} | "
              f"{b['lockstep_over_bound']:5.2f} -> {s['lockstep_over_bound']:4.2f} | "
              f"{enc0['max_over_mean']:6.3f} -> {enc['max_over_mean']:5.3f} | {s['microbatches']:>2} | {realised}")
        if s["hint"]:
            print(f"     note: {s['hint']}")
        loaders.consume(plan)
    print()
    print("before -> after: arrival-order split vs balanced plan of the same sampled batch (cost: attention FLOPs;")
    print("  encoder: image-patch FLOPs over all ranks). lockstep = sum over microbatch index of the slowest rank's")
    print("  cost, bound = max(largest sample, total / ranks). mixture: this step's share (schedule target);")
    print("  cum. error = largest |realised - target| of any source's cumulative count, always < 1 sample.")
    if args.show_plan and plan is not None:
        print()
        print(plan.render(max_buckets=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
