"""Orchestration transparency: a step's plan drawn as text or Graphviz DOT.

sources -> buckets -> microbatches -> clients, with sample counts, tokens and costs on the way.
"""

from __future__ import annotations

import numpy as np

__all__ = ["render_plan"]


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def render_plan(plan, fmt: str = "text", max_buckets: int = 8) -> str:
    if fmt not in ("text", "dot"):
        raise ValueError(f"render format must be 'text' or 'dot', got {fmt!r}")
    e, recs = plan.entries, plan.records
    B, M = len(plan.buckets), plan.n_microbatches
    src_of_entry = recs.source_id[e["row"]]
    bins = plan.bin_costs()
    shown = list(range(min(B, max_buckets)))
    if fmt == "dot":
        return _dot(plan, src_of_entry, bins, shown)
    s = plan.stats
    lines = [f"step {plan.step}: {len(recs)} samples from {len(recs.sources)} sources -> {B} buckets along "
             f"{plan.axis.upper()} x {M} microbatches -> {plan.mesh.world_size} clients"]
    counts = recs.source_counts()
    tok = np.bincount(recs.source_id, weights=recs.tokens, minlength=len(recs.sources))
    lines.append("  sources: " + " | ".join(f"{n} {counts[n]} ({int(t)} tok)" for n, t in zip(recs.sources, tok)))
    if s:
        lines.append(f"  balance: max/mean {s['max_over_mean']:.3f}, lockstep/bound {s['lockstep_over_bound']:.3f}, "
                     f"{s['microbatches']} microbatches ({s['microbatches_opened']} opened)")
    for b in shown:
        ranks = plan.buckets[b]
        kinds = {}
        for r in ranks:
            kinds.setdefault(plan.delivery(r), []).append(r)
        who = ", ".join(f"{k}: {_ranks(v)}" for k, v in kinds.items())
        lines.append(f"  bucket {b} [{who}] cost {_fmt(bins[:, b].sum())}")
        for m in range(M):
            sel = (e["bucket"] == b) & (e["mb"] == m)
            n_src = np.bincount(src_of_entry[sel], minlength=len(recs.sources))
            mix = " ".join(f"{recs.sources[i]}x{c}" for i, c in enumerate(n_src) if c)
            lines.append(f"    mb{m}: {int(sel.sum())} items, {int(e['tokens'][sel].sum())} tok, cost {_fmt(bins[m, b])}"
                         + (f"  [{mix}]" if mix else ""))
    if B > len(shown):
        lines.append(f"  ... {B - len(shown)} more buckets")
    for name, sub in plan.modules.items():
        lines.append(f"module {name}:")
        lines.extend("  " + ln for ln in render_plan(sub, "text", max_buckets).splitlines())
    return "\n".join(lines)


def _ranks(rs) -> str:
    rs = list(rs)
    if len(rs) > 4:
        return f"{rs[0]},{rs[1]},...,{rs[-1]} ({len(rs)})"
    return ",".join(map(str, rs))


def _dot(plan, src_of_entry, bins, shown) -> str:
    e, recs = plan.entries, plan.records
    out = ["digraph plan {", "  rankdir=LR;", f'  label="step {plan.step}";', "  node [shape=box];"]
    for i, name in enumerate(recs.sources):
        out.append(f'  src{i} [label="{name}", shape=cylinder];')
    for b in shown:
        out.append(f'  b{b} [label="bucket {b}\\ncost {_fmt(bins[:, b].sum())}"];')
        for i in range(len(recs.sources)):
            n = int(((e["bucket"] == b) & (src_of_entry == i)).sum())
            if n:
                out.append(f'  src{i} -> b{b} [label="{n}"];')
        for m in range(plan.n_microbatches):
            n = int(((e["bucket"] == b) & (e["mb"] == m)).sum())
            out.append(f'  b{b}m{m} [label="mb{m}\\n{n} items\\ncost {_fmt(bins[m, b])}", shape=ellipse];')
            out.append(f"  b{b} -> b{b}m{m};")
        for r in plan.buckets[b]:
            d = plan.delivery(r)
            style = {"data": "solid", "metadata": "dashed", "none": "dotted"}[d]
            out.append(f'  r{r} [label="rank {r}\\n{d}", shape=oval, style={style}];')
            for m in range(plan.n_microbatches):
                out.append(f"  b{b}m{m} -> r{r} [style={style}];")
    out.append("}")
    return "\n".join(out)
