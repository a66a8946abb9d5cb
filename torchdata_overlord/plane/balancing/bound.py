"""A lower bound on the lockstep cost (sum over microbatch index of the max over buckets) of any plan.

``max(largest item, total / buckets)`` ignores that items are whole and bins hold ``max_tokens``:
items of more than ``cap / (j + 1)`` tokens fit at most ``j`` to a bin, ``j * buckets`` to a
microbatch row, which forces rows of high maximum that the total alone does not see; and a row
whose maximum is forced high can only be filled up to it with the costliest material per token
that fits its ``buckets * cap`` tokens, so heavy-tailed costs leave every other bin of that row short.
"""

from __future__ import annotations

import numpy as np

__all__ = ["lockstep_lower_bound", "simple_bound"]

MAX_SHARE = 4   # token classes tried: items over cap/2, cap/3, ..., cap/(MAX_SHARE + 1) tokens


def simple_bound(costs: np.ndarray, n_buckets: int) -> float:
    """``max(largest item, total / buckets)``: every row costs at least its mean, one row holds the largest."""
    costs = np.asarray(costs, np.float64)
    if not len(costs) or n_buckets < 1:
        return 0.0
    return max(float(costs.max()), float(costs.sum()) / n_buckets)


def lockstep_lower_bound(costs, n_buckets: int, tokens=None, cap: int | None = None) -> float:
    """A lower bound on ``sum_m max_b cost[m, b]`` over every assignment of the items to bins of at most
    ``cap`` tokens, whatever the number of microbatch rows: the largest of three.

    1. :func:`simple_bound`.
    2. Forced rows: lockstep = integral over x > 0 of the number of rows whose maximum exceeds x. Every item
       costing more than x sits in such a row, and a row holds at most ``B * cap`` tokens and at most ``j * B``
       items of more than ``cap / (j + 1)`` tokens (j per bin); so at least ``q(x) = max(ceil(T(x) / (B cap)),
       ceil(N_j(x) / (j B)))`` rows exceed x, T and N_j counting the items costing more than x. Hence the
       j-th costliest row's maximum ``M_j`` is at least ``h_j``, the largest x with ``q(x) >= j``.
    3. Dense fill: a row of maximum ``M`` holding cost ``C`` has ``B * M >= C``, and ``C <= D(B cap)``, where
       ``D(T)`` is the cost of the T costliest-per-token tokens, items cut freely (no set of whole items
       within T tokens costs more). For the top k rows: lockstep >= sum_{j<=k} max(h_j, C_j / B) + (total -
       sum_{j<=k} C_j) / B = total / B + sum_{j<=k} (h_j - min(h_j, C_j / B)), and sum_{j<=k} min(h_j, C_j / B)
       is at most both ``sum_j min(h_j, D(B cap) / B)`` and ``D(k B cap) / B``. Every k is tried.
    """
    costs = np.asarray(costs, np.float64)
    if n_buckets < 1:
        raise ValueError(f"lockstep_lower_bound: n_buckets must be >= 1, got {n_buckets}")
    bound = simple_bound(costs, n_buckets)
    if cap is None or tokens is None or not len(costs):
        return bound
    tokens = np.asarray(tokens, np.int64)
    if tokens.shape != costs.shape:
        raise ValueError(f"lockstep_lower_bound: {tokens.shape} token counts for {costs.shape} costs")
    if cap < 1:
        raise ValueError(f"lockstep_lower_bound: cap must be >= 1, got {cap}")
    B = n_buckets
    order = np.argsort(-costs, kind="stable")
    c, t = costs[order], tokens[order]
    width = np.append(c[:-1] - c[1:], c[-1])            # for x in [c[i+1], c[i]) the items over x are 0..i
    rows = -(-np.cumsum(t) // (B * cap))                # rows needed for their tokens
    for j in range(1, MAX_SHARE + 1):
        rows = np.maximum(rows, -(-np.cumsum(t * (j + 1) > cap) // (j * B)))
    bound = max(bound, float((rows * np.maximum(width, 0)).sum()))
    h = c[np.searchsorted(rows, np.arange(1, int(rows[-1]) + 1))]      # h_j: M_j >= h_j (rows never falls)
    if not len(h):
        return bound
    dense = _densest(c, t)
    absorbed = np.minimum(np.cumsum(np.minimum(h, dense(B * cap) / B)),
                          dense(B * cap * np.arange(1, len(h) + 1)) / B)
    return max(bound, float((np.cumsum(h) - absorbed).max() + c.sum() / B))


def _densest(c: np.ndarray, t: np.ndarray):
    """``D(T)``: the most cost any T tokens of these items can carry, items cut freely (densest first)."""
    free = float(c[t <= 0].sum())                       # items of no tokens fit anywhere
    pos = t > 0
    c, t = c[pos], t[pos].astype(np.float64)
    order = np.argsort(-(c / t), kind="stable")
    xs = np.concatenate([[0.0], np.cumsum(t[order])])
    ys = np.concatenate([[0.0], np.cumsum(c[order])])
    return lambda T: free + np.interp(T, xs, ys)
