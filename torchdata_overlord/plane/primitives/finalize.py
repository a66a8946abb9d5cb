"""``plan()`` and ``plan_raw()``: turn a distributed and balanced graph into a Plan."""

from __future__ import annotations

from collections import Counter

import numpy as np

from ...errors import ConfigError
from ..costs import token_count
from ..plan import Plan, compute_stats
from .balance import Assignment
from .broadcast import check_broadcast
from .cost import evaluate_cost


def _plan_from(g, asg: Assignment) -> Plan:
    lay = g.layout
    check_broadcast(lay.tree, lay.axis, g.broadcast)     # (a broadcast_at declared before distribute)
    plan = Plan(step=g.step, mesh=lay.tree, axis=lay.axis, buckets=lay.buckets, n_microbatches=asg.n_microbatches,
                records=g.records, entries=asg.entries, broadcast=g.broadcast, history=list(g.history))
    plan.stats = compute_stats(plan, asg.requested_microbatches, asg.oversize, g.mix_info, asg.max_tokens)
    plan.stats["method"] = asg.method
    plan.stats["level"] = asg.level
    return plan


def _attach(plan: Plan, modules: dict) -> Plan:
    """Finalise the other modules' graphs into ``plan.modules``. A sample the backbone plan dropped
    (``balance(oversize="drop")``) is gone from the step: it is taken out of every module's graph too,
    which is then balanced again over the samples that remain (e.g. the encoder never embeds the
    images of a sample no backbone row holds)."""
    dropped = _dropped(plan)
    for name, other in modules.items():
        if not hasattr(other, "layout"):
            raise ConfigError(f"plan({name}=...) needs a DGraph, got {type(other).__name__}")
        if dropped:
            other = _without(other, dropped)
        plan.modules[name] = finalize(other, {})
    return plan


def _dropped(plan: Plan) -> dict[str, np.ndarray]:
    """source -> indices of the plan's records that none of its entries places (oversize="drop")."""
    recs = plan.records
    unplaced = np.ones(len(recs), bool)
    unplaced[plan.entries["row"]] = False
    if not unplaced.any():
        return {}
    sid, idx = recs.source_id[unplaced], recs.index[unplaced]
    return {recs.sources[s]: idx[sid == s] for s in np.unique(sid).tolist()}


def _without(g, dropped: dict[str, np.ndarray]):
    """``g`` without the samples in ``dropped`` (source -> indices), placed again by the same
    ``balance()`` when it had been balanced; ``g`` itself when it holds none of them."""
    recs = g.records
    gone = np.zeros(len(recs), bool)
    for s, name in enumerate(recs.sources):
        if name in dropped:
            gone |= (recs.source_id == s) & np.isin(recs.index, dropped[name])
    if not gone.any():
        return g
    keep = ~gone
    asg = g.placement
    out = g.evolve(f"without the {int(gone.sum())} samples the backbone dropped: {int(keep.sum())} of {len(g)}",
                   records=recs.take(keep), costs=None if g.costs is None else g.costs[keep], placement=None)
    if asg is not None and asg.op is not None:
        out = asg.op.apply(out)
    return out


def finalize(g, modules: dict) -> Plan:
    if g.layout is None:
        raise ConfigError("plan() needs buckets: call distribute('DP'|'CP'|'WORLD') first")
    if g.placement is None:
        g = g.balance("arrival", microbatches=1)
    return _attach(_plan_from(g, g.placement), modules)


def finalize_raw(g, fn, modules: dict) -> Plan:
    """Low-level hook: ``fn(graph)`` decides everything; the result is checked, never trusted."""
    if g.layout is None:
        raise ConfigError("plan_raw() needs buckets: call distribute(...) first")
    out = fn(g)
    B = len(g.layout.buckets)
    if not isinstance(out, (list, tuple)) or len(out) != B:
        raise ConfigError(f"plan_raw function must return one list of microbatches per bucket ({B}), got {type(out).__name__}")
    rows, bucket, mb = [], [], []
    for b, mbs in enumerate(out):
        for m, items in enumerate(mbs):
            rows += list(items)
            bucket += [b] * len(items)
            mb += [m] * len(items)
    rows = np.asarray(rows, np.int64)
    counts = Counter(rows.tolist())
    missing = sorted(set(range(len(g))) - set(counts))
    dup = sorted(r for r, c in counts.items() if c > 1)
    bad = sorted(r for r in counts if not 0 <= r < len(g))
    if missing or dup or bad:
        raise ConfigError(f"plan_raw result is not a permutation of the graph's {len(g)} samples: "
                          f"missing rows {missing[:10]}, duplicated {dup[:10]}, out of range {bad[:10]}")
    costs = g.costs if g.costs is not None else evaluate_cost(token_count, g.records)
    n = len(rows)
    one, zero = np.ones(n, np.int64), np.zeros(n, np.int64)
    entries = {"row": rows, "bucket": np.asarray(bucket, np.int64), "mb": np.asarray(mb, np.int64),
               "tokens": g.records.tokens[rows], "cost": costs[rows], "piece": zero, "npieces": one,
               "shard": zero, "nshards": one, "order": np.arange(n, dtype=np.float64)}
    m_count = max((len(x) for x in out), default=1) or 1
    oversize = {"policy": "raw", "limit": None, "truncated": 0, "split": 0, "dropped": 0, "dropped_keys": []}
    return _attach(_plan_from(g, Assignment(entries, m_count, m_count, oversize, "plan_raw")), modules)
