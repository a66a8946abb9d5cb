"""Multiway Karmarkar-Karp (largest differencing), vectorised as a tournament of merges.

Items sorted by cost are cut into rows of ``k`` (one item per bin): each row is a partial
partition. Partitions are merged two at a time, the largest subset of one with the smallest of
the other, so differences cancel. Classic KK merges the two partitions with the largest spread
one pair at a time; here every round pairs all partitions by spread at once, which keeps the
differencing idea but costs ``log2(n / k)`` numpy rounds instead of ``n / k`` Python steps.
Each bin ends with one item per row, so item counts per bin differ by at most one.

A token cap is honoured inside each merge: a pairing that would overflow a bin is repaired by
swapping partners; when no swap fits, ``grow`` empty bins are opened.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import ConfigError
from .problem import BinAssignment, BinProblem, register_balancer

__all__ = ["karmarkar_karp"]


def _repair(ca, ta, cb, tb, pi, cap) -> bool:
    """Fix pairing ``pi`` (A slot j <-> B slot pi[j]) in place so that ``ta + tb[pi] <= cap``.

    Swaps each violating partner with the partner of the A slot of nearest cost that makes both
    pairs fit. Returns False if some violation has no such swap.
    """
    bad = np.flatnonzero(ta + tb[pi] > cap)
    for j in bad[np.argsort(-ta[bad], kind="stable")]:
        if ta[j] + tb[pi[j]] <= cap:
            continue
        ok = (ta[j] + tb[pi] <= cap) & (ta + tb[pi[j]] <= cap)
        cand = np.flatnonzero(ok)
        if not len(cand):
            return False
        jj = cand[np.argmin(np.abs(ca[cand] - ca[j]))]
        pi[j], pi[jj] = pi[jj], pi[j]
    return True


@register_balancer("karmarkar_karp")
def karmarkar_karp(p: BinProblem) -> BinAssignment:
    n, k = len(p.costs), p.n_bins
    if p.count_cap is not None and p.count_cap < math.ceil(n / k):
        raise ConfigError(f"count cap {p.count_cap} cannot hold {n} items in {k} bins")
    cap = p.cap
    order = np.argsort(-p.costs, kind="stable")
    rows = max(math.ceil(n / k), 1)
    pad = rows * k - n
    loads, tload = p.initial()
    # Row 0 is the anchor: the bins themselves with their initial loads, tagged by pseudo-items
    # -1-b, so that the final slot of each original bin is known after the merges.
    sums = np.vstack([loads[None, :], np.concatenate([p.costs[order], np.zeros(pad)]).reshape(rows, k)])
    toks = np.vstack([tload[None, :], np.concatenate([p.tokens[order], np.zeros(pad, np.int64)]).reshape(rows, k)])
    ids = np.concatenate([-1 - np.arange(k), order, np.full(pad, n)])   # n marks padding
    part = np.repeat(np.arange(rows + 1), k)
    slot = np.tile(np.arange(k), rows + 1)
    n_bins = k

    while len(sums) > 1:
        P = len(sums)
        spread = sums.max(1) - sums.min(1)
        rank = np.argsort(-spread, kind="stable")
        m = P // 2
        a, b, rest = rank[0:2 * m:2], rank[1:2 * m:2], rank[2 * m:]
        ord_a = np.argsort(-sums[a], axis=1, kind="stable")
        ord_b = np.argsort(sums[b], axis=1, kind="stable")
        if cap is not None:
            ta = np.take_along_axis(toks[a], ord_a, 1)
            tb = np.take_along_axis(toks[b], ord_b, 1)
            grown = False
            for r in np.flatnonzero((ta + tb > cap).any(1)):
                ca = np.take_along_axis(sums[a[r]], ord_a[r], 0)
                pi = np.arange(n_bins)
                if not _repair(ca, ta[r], np.take_along_axis(sums[b[r]], ord_b[r], 0), tb[r], pi, cap):
                    grown = True
                    break
                ord_b[r] = ord_b[r][pi]
            if grown:
                if p.grow <= 0:
                    raise ConfigError(f"karmarkar_karp cannot fit the items under max_tokens={cap} in {n_bins} bins")
                g = p.grow
                sums = np.hstack([sums, np.zeros((P, g))])
                toks = np.hstack([toks, np.zeros((P, g), np.int64)])
                anchor = part[0]                        # the anchor's pseudo-items come first in ids
                ids = np.concatenate([ids, -1 - np.arange(n_bins, n_bins + g)])
                part = np.concatenate([part, np.full(g, anchor)])
                slot = np.concatenate([slot, np.arange(n_bins, n_bins + g)])
                n_bins += g
                continue
        new_sums = np.take_along_axis(sums[a], ord_a, 1) + np.take_along_axis(sums[b], ord_b, 1)
        new_toks = np.take_along_axis(toks[a], ord_a, 1) + np.take_along_axis(toks[b], ord_b, 1)
        inv_a = np.empty_like(ord_a)
        inv_b = np.empty_like(ord_b)
        cols = np.broadcast_to(np.arange(n_bins), ord_a.shape)
        np.put_along_axis(inv_a, ord_a, cols, 1)
        np.put_along_axis(inv_b, ord_b, cols, 1)
        new_part = np.empty(P, np.int64)
        side = np.full(P, 2, np.int8)
        new_part[a], side[a] = np.arange(m), 0
        new_part[b], side[b] = np.arange(m), 1
        new_part[rest] = m
        s, np_ = side[part], new_part[part]
        in_a, in_b = s == 0, s == 1
        slot = slot.copy()
        slot[in_a] = inv_a[np_[in_a], slot[in_a]]
        slot[in_b] = inv_b[np_[in_b], slot[in_b]]
        part = np_
        sums = np.vstack([new_sums, sums[rest]])
        toks = np.vstack([new_toks, toks[rest]])

    # final slot -> bin: original bins via their anchor pseudo-items, opened bins likewise
    bin_of_slot = np.empty(n_bins, np.int64)
    pseudo = ids < 0
    bin_of_slot[slot[pseudo]] = -1 - ids[pseudo]
    real = (ids >= 0) & (ids < n)
    bins = np.empty(n, np.int64)
    bins[ids[real]] = bin_of_slot[slot[real]]
    return BinAssignment(bins, n_bins)
