"""Main demo: a 4-source VLM pretraining job on real files, every rank simulated in this process.

It builds (once, cached) a local corpus of Parquet files: web text, code, heavy-tailed
long-context documents and captioned JPEG images, with a sentencepiece model trained on it. Then
it runs an ``OverlordLoader`` for a ``pp=2, dp=4, cp=2, tp=2`` mesh on the embedded runtime (or,
with ``--runtime rpc``, in worker processes): Source
Loaders read and transform, the Planner mixes the sources on a curriculum and balances the
backbone by attention FLOPs across DP ranks and microbatches and the images across all ranks for
a world-wide-DP encoder, and Data Constructors pack, pad and zig-zag split for context
parallelism. It prints throughput, per-step imbalance before (arrival order) and after balancing,
the realised mixture and each role's process and memory, and writes a PNG of per-rank cost with and
without balancing.

    bash scripts/demo.sh --steps 200
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

import torchdata_overlord as ol
from torchdata_overlord.sim.corpus import build_demo_corpus, default_corpus_root

START = {"web": 0.50, "code": 0.15, "long": 0.10, "caps": 0.25}
END = {"web": 0.30, "code": 0.25, "long": 0.20, "caps": 0.25}


class DemoStrategy:
    """The job's data plane, as a user writes it (paper Fig. 9, right: VLM hybrid balance). A
    module-level class, so it pickles to the Planner's process under ``--runtime rpc``."""

    def __init__(self, method: str, microbatches: int, max_tokens: int, steps: int):
        self.method, self.microbatches, self.max_tokens = method, microbatches, max_tokens
        self.schedule = ol.Linear(START, END, steps=steps)

    def __call__(self, g: ol.DGraph) -> ol.Plan:
        g = g.mix(self.schedule)
        images = (g.view("image").distribute("DP", module="encoder")
                  .cost(ol.encoder_cost).balance(self.method, microbatches=1))
        text = (g.view("text").distribute("DP").cost(ol.attention_flops)
                .balance(self.method, microbatches=self.microbatches, max_tokens=self.max_tokens, oversize="split")
                .broadcast_at("TP"))
        return text.plan(encoder=images)


def arrival_plan(plan: ol.Plan, microbatches: int, max_tokens: int) -> ol.Plan:
    """The same sampled batch split in arrival order (what per-rank DataLoaders would do)."""
    return (ol.DGraph.from_plan(plan).distribute(plan.axis).cost(ol.attention_flops)
            .balance("arrival", microbatches=microbatches, max_tokens=max_tokens, oversize="split").plan())


def print_roles(stats: dict) -> None:
    """Each role's process and memory, and the queue depths of the Planner and the constructors."""
    procs = stats["processes"]
    me = os.getpid()
    print(f"  {'trainer (this)':>16}: pid {me}, RSS {procs.get(me, {}).get('rss_mib')} MiB, "
          f"PSS {procs.get(me, {}).get('pss_mib')} MiB")
    if set(stats["roles"].values()) == {me}:
        print(f"  every role ({', '.join(stats['roles'])}) runs in this process")
    else:
        for role, pid in stats["roles"].items():
            m = procs.get(pid) or procs.get(str(pid)) or {}
            print(f"  {role:>16}: pid {pid}, RSS {m.get('rss_mib')} MiB, PSS {m.get('pss_mib')} MiB")
    for role, err in stats.get("unanswered", {}).items():
        print(f"  {role:>16}: no answer ({err})")
    if "planner" in stats and "error" not in stats["planner"]:
        p = stats["planner"]
        print(f"  planner: next step {p['next_step']}, steps planned {p['steps_planned']}")
        for name, c in stats["constructors"].items():
            if "error" in c:
                continue
            print(f"  {name}: steps held {c['steps_held']}, built {c['steps_built']}, waiting fetches "
                  f"{c['waiting_fetches']}")


def parse_mesh(text: str) -> ol.ClientPlaceTree:
    try:
        sizes = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise SystemExit(f"--mesh must look like pp=2,dp=4,cp=2,tp=2, got {text!r}") from None
    return ol.ClientPlaceTree(**sizes)


def default_data_dir() -> Path:
    root = os.environ.get("OVERLORD_ROOT")
    return Path(root) / "data" if root else default_corpus_root().parent


def plot(path: Path, per_step: list[dict], worst: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = np.arange(len(worst["arrival"]))
    ax1.bar(x - 0.2, worst["arrival"] / 1e12, 0.4, label="arrival order", color="#d62728")
    ax1.bar(x + 0.2, worst["balanced"] / 1e12, 0.4, label="balanced", color="#1f77b4")
    ax1.axhline(worst["balanced"].mean() / 1e12, color="k", lw=0.8, ls="--", label="mean")
    ax1.set(title=f"per-DP-rank cost at step {worst['step']} (attention TFLOPs)", xlabel="DP rank",
            ylabel="TFLOPs per layer", xticks=x)
    ax1.legend()
    steps = [r["step"] for r in per_step]
    ax2.plot(steps, [r["arrival_max_mean"] for r in per_step], label="arrival order", color="#d62728")
    ax2.plot(steps, [r["balanced_max_mean"] for r in per_step], label="balanced", color="#1f77b4")
    ax2.set(title="per-rank max/mean cost per step", xlabel="step", ylabel="max / mean")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--mesh", default="pp=2,dp=4,cp=2,tp=2")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16384, help="tokens per packed microbatch of a DP rank")
    ap.add_argument("--method", default="karmarkar_karp", choices=["greedy", "karmarkar_karp"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="transform threads of the image source")
    ap.add_argument("--data", type=Path, default=None, help="where the corpus is cached and the plot written")
    ap.add_argument("--scale", default="demo", choices=["demo", "test"])
    ap.add_argument("--show-plan", action="store_true", help="draw the last step's plan")
    ap.add_argument("--runtime", default="local", choices=["local", "rpc"],
                    help="local: every role in this process; rpc: the roles in worker processes over "
                         "torch.distributed.rpc")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    mesh = parse_mesh(args.mesh)            # a bad --mesh is refused before the corpus is built
    mesh.attach("encoder", dp=mesh.world_size)

    data = args.data or default_data_dir()
    t0 = time.perf_counter()
    corpus = build_demo_corpus(data / f"demo-corpus-{args.scale}", scale=args.scale, seed=args.seed)
    rows = {k: v["rows"] for k, v in corpus.manifest.get("sources", {}).items()} if isinstance(
        corpus.manifest.get("sources"), dict) else {}
    print(f"corpus: {corpus.root} ({time.perf_counter() - t0:.1f} s; rows {rows or 'see manifest.json'})")
    print(f"mesh {mesh.describe()} ({mesh.world_size} ranks, every rank simulated here, runtime {args.runtime}), global batch "
          f"{args.global_batch}, {args.microbatches} microbatches of <= {args.max_tokens} tokens, {args.method}")
    sources = [corpus.source(name, seed=args.seed) for name in ("web", "code", "long", "caps")]
    loader = ol.OverlordLoader(sources, DemoStrategy(args.method, args.microbatches, args.max_tokens, args.steps),
                               mesh, rank=None, global_batch=args.global_batch, seq_len=None, seed=args.seed,
                               workers={"caps": args.workers}, image_token_id=corpus.image_token_id,
                               runtime=args.runtime)
    if loader.placement is not None:        # runtime="rpc": where every actor runs, and why
        print(loader.placement.render())
    from tqdm import tqdm

    per_step, worst, samples, tokens = [], None, 0, 0
    t0 = time.perf_counter()
    with loader:
        bar = tqdm(total=args.steps, disable=args.no_progress, unit="step", file=sys.stdout)
        for step, _ in zip(range(args.steps), loader):
            plan = loader.last_plan
            base = arrival_plan(plan, args.microbatches, args.max_tokens)
            s, b = plan.stats, base.stats
            samples += s["samples"]
            tokens += int(plan.records.tokens.sum())
            row = {"step": step, "arrival_max_mean": b["max_over_mean"], "balanced_max_mean": s["max_over_mean"],
                   "arrival_lockstep": b["lockstep_over_bound"], "balanced_lockstep": s["lockstep_over_bound"],
                   "encoder_max_mean": plan.module("encoder").stats["max_over_mean"],
                   "images": plan.module("encoder").stats["samples"],
                   "mixture": s["mixture"]}
            per_step.append(row)
            if worst is None or b["max_over_mean"] > worst["ratio"]:
                worst = {"step": step, "ratio": b["max_over_mean"], "arrival": base.bin_costs().sum(0),
                         "balanced": plan.bin_costs().sum(0)}
            bar.update(1)
            bar.set_postfix(maxmean=f"{b['max_over_mean']:.2f}->{s['max_over_mean']:.2f}")
        bar.close()
        elapsed = time.perf_counter() - t0
        stats = loader.stats()
    print()
    print(f"{'step':>5} | {'max/mean arrival -> balanced':>28} | {'lockstep/bound':>14} | realised mixture this step (target)")
    shown = sorted({0, 1, 2, len(per_step) // 2, len(per_step) - 1} & set(range(len(per_step))))
    for i in shown:
        r = per_step[i]
        mix = r["mixture"]
        realised = "  ".join(f"{k} {mix['counts'][k] / args.global_batch:.3f} ({mix['weights'][k]:.3f})"
                             for k in sorted(mix["weights"]))
        print(f"{r['step']:>5} | {r['arrival_max_mean']:12.3f} -> {r['balanced_max_mean']:6.3f}      | "
              f"{r['arrival_lockstep']:5.2f} -> {r['balanced_lockstep']:4.2f} | {realised}")
    mean = lambda k: float(np.mean([r[k] for r in per_step]))  # noqa: E731
    print(f"\nover {len(per_step)} steps: per-rank max/mean {mean('arrival_max_mean'):.3f} (arrival order) -> "
          f"{mean('balanced_max_mean'):.3f} (balanced); lockstep/bound {mean('arrival_lockstep'):.2f} -> "
          f"{mean('balanced_lockstep'):.2f}; encoder max/mean {mean('encoder_max_mean'):.2f} "
          f"({mean('images'):.0f} images a step over {mesh.world_size} encoder ranks)")
    last = per_step[-1]["mixture"] if per_step else None
    if last:
        print(f"mixture: largest |cumulative realised - target| of any source: {last['max_abs_error']:.2f} samples")
    print(f"throughput: {samples / elapsed:,.0f} samples/s, {tokens / elapsed:,.0f} tokens/s "
          f"({len(per_step)} steps in {elapsed:.1f} s, all {mesh.world_size} ranks built in this process)")
    fw = stats["fetch_wait"]
    print(f"trainer waited for data: p50 {fw['p50_ms']} ms, p99 {fw['p99_ms']} ms per step (no model runs here, so "
          f"this is the loader's own pace)")
    for name, st in stats["sources"].items():
        if "error" in st:
            print(f"  {name:>4}: no answer ({st['error']})")
            continue
        print(f"  {name:>4}: served {st['served']:>6}, epochs started {st['epochs_started']}, "
              f"buffer {st['buffered']} samples / {st['buffer_bytes'] / 2**20:.1f} MiB, skipped {st['skipped']}")
    print_roles(stats)
    png = data / "demo_balance.png"
    if worst is not None:
        plot(png, per_step, worst)
        print(f"plot: {png}")
    if args.show_plan and per_step:
        print()
        print(plan.render(max_buckets=2))
    return {"steps": len(per_step), "per_step": per_step, "samples_per_s": samples / max(elapsed, 1e-9),
            "tokens_per_s": tokens / max(elapsed, 1e-9), "plot": str(png), "stats": stats}


if __name__ == "__main__":
    main()
    sys.exit(0)
