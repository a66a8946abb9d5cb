"""Tutorial: long-short text mixing on a 4D mesh (paper Fig. 9, left: LLMBalance).

A pretraining step mixes short web pages with heavy-tailed long-context documents. Attention
costs grow with the square of a sequence's length, so cutting the step's samples into equal
counts per rank (what one DataLoader per rank does) leaves some ranks with several long
documents and the rest of the job waiting for them. LLMBalance is five primitives:

    g.mix(...).distribute("DP").cost(ol.attention_flops)
     .balance("greedy", microbatches=4, max_tokens=M).broadcast_at("TP").plan()

This walk-through plans the *same sampled steps* of the demo corpus's real ``web`` and ``long``
Parquet sources three ways and prints what each did:

1. ``arrival``: ``distribute("DP")``, samples cut in arrival order (the unbalanced baseline);
2. ``greedy``: LLMBalance, cost-balanced over DP ranks and their microbatches;
3. ``cp``: ``distribute("CP")``, every (dp, cp) rank a consumer of its own; a sequence longer
   than one rank's budget spans consecutive CP ranks (a zig-zag shard on each), the rest stay whole.

It drives the roles by hand (Source Loaders report metadata, Planners plan, the planned samples
are handed over, a Data Constructor builds what one rank receives): that is what ``OverlordLoader``
does inside, and doing it here lets three Planners plan from one set of buffers.

    python tutorials/long_short_mixing.py                    # demo scale (built once, cached)
    python tutorials/long_short_mixing.py --scale test --root /tmp/overlord-corpus --max-tokens 4096
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

import torchdata_overlord as ol
from torchdata_overlord.roles import DataConstructor, SourceLoader
from torchdata_overlord.sim.corpus import build_demo_corpus, default_corpus_root

MIXTURE = {"web": 0.75, "long": 0.25}
MICROBATCHES = 4


def llm_balance(method: str, max_tokens: int):
    """Paper Fig. 9 (left): the backbone's data plane. ``max_tokens`` caps one DP group's packed
    microbatch (its CP ranks split every row, so each holds max_tokens / cp tokens)."""
    def strategy(g: ol.DGraph) -> ol.Plan:
        return (g.mix(MIXTURE)
                 .distribute("DP")                      # one bucket per DP group
                 .cost(ol.attention_flops)              # quadratic per sequence + linear
                 .balance(method, microbatches=MICROBATCHES, max_tokens=max_tokens,
                          oversize="split")             # longer than any bin: independent pieces (counted)
                 .broadcast_at("TP")                    # TP ranks > 0 get their data by broadcast
                 .plan())
    return strategy


def hybrid_cp(max_tokens_per_rank: int):
    """``distribute("CP")``: DP x CP ranks as uniform consumers; ``max_tokens`` is per rank, and a
    sequence over it spans up to ``cp`` consecutive CP ranks (``balance`` then pools every
    (rank, microbatch) bin: level "lockstep", recorded in ``plan.stats["level"]``)."""
    def strategy(g: ol.DGraph) -> ol.Plan:
        return (g.mix(MIXTURE).distribute("CP").cost(ol.attention_flops)
                 .balance("greedy", microbatches=MICROBATCHES, max_tokens=max_tokens_per_rank, oversize="split")
                 .broadcast_at("TP").plan())
    return strategy


def hand_over(loaders: dict, plan: ol.Plan) -> dict:
    """Take the step's sampled records out of their Source Loaders (what the runtime stages)."""
    wanted = defaultdict(list)
    for key in plan.sampled_keys():
        wanted[key.source].append(key.index)
    return {ol.SampleKey(name, i): rec for name, idx in wanted.items() for i, rec in loaders[name].take(idx).items()}


def spans_of(plan: ol.Plan) -> list[dict]:
    """Every sequence (or oversize piece) that spans several CP ranks, with the ranks it spans."""
    e, out = plan.entries, []
    first = np.flatnonzero((e["nshards"] > 1) & (e["shard"] == 0))
    for i in first:
        same = (e["row"] == e["row"][i]) & (e["piece"] == e["piece"][i])
        cps = [plan.mesh.coords(plan.buckets[b][0])["cp"] for b in sorted(set(e["bucket"][same].tolist()))]
        dp = plan.mesh.coords(plan.buckets[e["bucket"][i]][0])["dp"]
        out.append({"key": str(plan.records.key(e["row"][i])), "tokens": int(e["tokens"][i]),
                    "piece": f"{int(e['piece'][i]) + 1}/{int(e['npieces'][i])}", "dp": dp, "cp_ranks": cps,
                    "microbatch": int(e["mb"][i])})
    return out


def runs(index) -> str:
    """Positions as half-open runs, e.g. ``[0:512) + [1536:2048)`` (a zig-zag shard: chunk i and 2k-1-i)."""
    idx = index.tolist()
    cuts = [0] + [i for i in range(1, len(idx)) if idx[i] != idx[i - 1] + 1] + [len(idx)]
    return " + ".join(f"[{idx[a]}:{idx[b - 1] + 1})" for a, b in zip(cuts, cuts[1:]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(default_corpus_root()), help="where the demo corpus is built / cached")
    ap.add_argument("--scale", default="demo", choices=["demo", "test"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16384, help="tokens per packed microbatch of a DP group")
    args = ap.parse_args(argv)

    corpus = build_demo_corpus(args.root, scale=args.scale)
    mesh = ol.ClientPlaceTree(pp=2, dp=4, cp=2, tp=2)            # 32 ranks
    cp = mesh.sizes["cp"]
    # Same per-GPU token budget in both layouts: a DP group's row of max_tokens is split over its
    # cp ranks, so a rank of the "CP" layout gets max_tokens // cp.
    planners = {"arrival": ol.Planner(llm_balance("arrival", args.max_tokens), mesh, args.global_batch, seed=0),
                "greedy": ol.Planner(llm_balance("greedy", args.max_tokens), mesh, args.global_batch, seed=0),
                "cp": ol.Planner(hybrid_cp(args.max_tokens // cp), mesh, args.global_batch, seed=0)}
    # One Source Loader per source: reads Parquet row groups, tokenizes, reports only metadata.
    loaders = {name: SourceLoader(corpus.source(name), buffer_size=args.global_batch) for name in MIXTURE}
    print(f"mesh {mesh.describe()} ({mesh.world_size} ranks), global batch {args.global_batch} "
          f"({', '.join(f'{k} {v:.0%}' for k, v in MIXTURE.items())}), {MICROBATCHES} microbatches, "
          f"max_tokens {args.max_tokens} per DP group = {args.max_tokens // cp} per GPU")
    head = (f"{'step':>4} | max/mean arrival -> greedy (cp) | lockstep/bound arrival -> greedy (cp) | "
            f"per-GPU TFLOP greedy (cp) | cp: spans, level")
    print(head)
    print("-" * len(head))

    rows, plans, samples = [], {}, {}
    try:
        for step in range(args.steps):
            metas = [loader.metadata() for loader in loaders.values()]   # buffers: keys + token counts
            plans = {name: p.plan(metas) for name, p in planners.items()}
            # same seed, same schedule, same buffers: every planner sampled the same batch
            assert plans["arrival"].sampled_keys() == plans["greedy"].sampled_keys() == plans["cp"].sampled_keys()
            samples = hand_over(loaders, plans["greedy"])               # consumed: loaders refill next step
            s = {name: p.stats for name, p in plans.items()}
            # lockstep cost = sum over microbatch index of the slowest bin; under distribute("DP") each
            # of a group's cp ranks computes 1/cp of every sequence (zig-zag), hence / cp per GPU. An
            # estimate of compute only: the DP layout also pays CP communication on every sequence.
            per_gpu = {"greedy": s["greedy"]["lockstep_cost"] / cp, "cp": s["cp"]["lockstep_cost"]}
            rows.append({"step": step, **{f"{k}_max_over_mean": v["max_over_mean"] for k, v in s.items()},
                         **{f"{k}_lockstep_over_bound": v["lockstep_over_bound"] for k, v in s.items()},
                         "greedy_per_gpu": per_gpu["greedy"], "cp_per_gpu": per_gpu["cp"],
                         "cp_level": s["cp"]["level"], "spans": len(spans_of(plans["cp"])),
                         "split": s["greedy"]["oversize"]["split"]})
            print(f"{step:>4} | {s['arrival']['max_over_mean']:16.3f} -> {s['greedy']['max_over_mean']:5.3f} "
                  f"({s['cp']['max_over_mean']:5.3f}) | {s['arrival']['lockstep_over_bound']:22.2f} -> "
                  f"{s['greedy']['lockstep_over_bound']:4.2f} ({s['cp']['lockstep_over_bound']:4.2f}) | "
                  f"{per_gpu['greedy'] / 1e12:17.2f} ({per_gpu['cp'] / 1e12:5.2f}) | {rows[-1]['spans']:>3}, "
                  f"{s['cp']['level']}")
    finally:
        for loader in loaders.values():
            loader.close()

    # What distribute("CP") did in the last step: which sequences span which CP ranks.
    last = plans["cp"]
    spans = spans_of(last)
    n = len(last.records)
    print(f"\nlast step under distribute('CP'): {len(spans)} of {n} sequences (or oversize pieces) span CP ranks; "
          f"under distribute('DP') all {n} are zig-zag split over cp={cp} ranks.")
    for sp in spans:
        print(f"  {sp['key']:>9} piece {sp['piece']}: {sp['tokens']:>6} tokens over CP ranks {sp['cp_ranks']} "
              f"of DP group {sp['dp']} (microbatch {sp['microbatch']})")
    why = " (requested 'both': sequences spanning CP ranks need the pooled (rank, microbatch) bins)"
    print(f"  balance level: {last.stats['level']}{why if last.stats['level'] == 'lockstep' else ''}; "
          f"most tokens on one GPU in one microbatch: {last.stats['max_bin_tokens']}")
    # And what a rank holding a shard receives: the Data Constructor packs its microbatches.
    shown = None
    if spans:
        bucket = last.bucket_of(mesh.rank(pp=0, dp=spans[0]["dp"], cp=spans[0]["cp_ranks"][0], tp=0))
        rank = last.buckets[bucket][0]
        built = DataConstructor(seq_len=None).build(last, bucket, samples)[rank]["microbatches"]
        for m, mb in enumerate(built):
            for sh in mb["spans"]:
                shown = sh
                print(f"  rank {rank} {mesh.coords(rank)} microbatch {m}: segment {sh['segment']} is shard "
                      f"{sh['shard']} of {sh['nshards']} of {sh['key']} ({sh['tokens']} tokens): {sh['length']} "
                      f"tokens at row offset {sh['offset']}, sequence positions {runs(sh['token_index'])}")
    mean = lambda k: float(np.mean([r[k] for r in rows]))  # noqa: E731
    figures = {name: {"max_over_mean": mean(f"{name}_max_over_mean"),
                      "lockstep_over_bound": mean(f"{name}_lockstep_over_bound")} for name in planners}
    figures.update(per_gpu_lockstep={"greedy": mean("greedy_per_gpu"), "cp": mean("cp_per_gpu")},
                   cp_level=rows[-1]["cp_level"], cp_spans=sum(r["spans"] for r in rows), last_spans=spans,
                   shard_shown=None if shown is None else {k: shown[k] for k in ("key", "shard", "nshards", "length")},
                   steps=rows)
    a, g, per = figures["arrival"], figures["greedy"], figures["per_gpu_lockstep"]
    print(f"\nover {len(rows)} steps, per-rank max/mean: arrival {a['max_over_mean']:.3f} -> greedy "
          f"{g['max_over_mean']:.3f}; lockstep/bound {a['lockstep_over_bound']:.2f} -> {g['lockstep_over_bound']:.2f}; "
          f"per-GPU step cost greedy (DP layout) {per['greedy'] / 1e12:.2f} vs CP layout {per['cp'] / 1e12:.2f} "
          f"TFLOP per layer.")
    print("max/mean: the costliest rank over the mean rank; lockstep/bound: sum over microbatch index of the slowest "
          "rank's cost,\nover max(largest sample, total / ranks). Cost: attention FLOPs of one layer.")
    return figures


if __name__ == "__main__":
    main()
