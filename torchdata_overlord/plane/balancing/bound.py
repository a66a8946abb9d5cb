"""A lower bound on the lockstep cost (sum over microbatch index of the max over buckets) of any plan.

``max(largest item, total / buckets)`` ignores that items are whole and bins hold ``max_tokens``:
items of more than ``cap / (j + 1)`` tokens fit at most ``j`` to a bin, ``j * buckets`` to a
microbatch row, which forces rows of high maximum that the total alone does not see.
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
    ``cap`` tokens, whatever the number of microbatch rows.

    Proof: lockstep = integral over x > 0 of the number of rows whose maximum exceeds x. Every item costing
    more than x sits in such a row, and a row holds at most ``B * cap`` tokens and at most ``j * B`` items of
    more than ``cap / (j + 1)`` tokens (j per bin); so at least ``q(x) = max(ceil(T(x) / (B cap)),
    ceil(N_j(x) / (j B)))`` rows exceed x, T and N_j counting the items costing more than x. The result is
    the larger of that integral and :func:`simple_bound`.
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
    order = np.argsort(-costs, kind="stable")
    c, t = costs[order], tokens[order]
    width = np.append(c[:-1] - c[1:], c[-1])            # for x in [c[i+1], c[i]) the items over x are 0..i
    rows = -(-np.cumsum(t) // (n_buckets * cap))        # rows needed for their tokens
    for j in range(1, MAX_SHARE + 1):
        rows = np.maximum(rows, -(-np.cumsum(t * (j + 1) > cap) // (j * n_buckets)))
    return max(bound, float((rows * np.maximum(width, 0)).sum()))
