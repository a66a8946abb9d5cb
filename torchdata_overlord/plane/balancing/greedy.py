"""Greedy balancing (LPT): largest cost first, into the least-loaded bin that still fits it.

With an item-count cap ``c``, at most ``n - (c - 1) * n_bins`` bins may reach ``c`` items and the
others stop at ``c - 1``, so that the tight cap ``ceil(n / n_bins)`` of ``equal_counts`` gives
every bin ``floor`` or ``ceil`` of ``n / n_bins`` items (LPT alone can leave a bin short).

Without caps and with at least ``BATCH_BINS`` bins, whole rounds of items are placed at once with
numpy (:func:`_rounds`), to the same bins as the one-item-at-a-time heap.
"""

from __future__ import annotations

import heapq

import numpy as np

from ...errors import ConfigError
from .problem import BinAssignment, BinProblem, register_balancer

__all__ = ["greedy"]


BATCH_BINS = 32      # from this many bins, uncapped LPT places whole rounds with numpy (see _rounds)
FEW = 8              # a round placing fewer items than this hands the next n_bins items to the heap


def _heap_lpt(costs: list, heap: list) -> list:
    """Each item in turn to the least-loaded ``(load, bin)`` of ``heap`` (updated in place): its bins."""
    out = []
    put, replace = out.append, heapq.heapreplace
    for c in costs:
        load, b = heap[0]
        replace(heap, (load + c, b))
        put(b)
    return out


def _rounds(costs: np.ndarray, loads: np.ndarray, k: int) -> np.ndarray:
    """Uncapped LPT of ``costs`` (largest first) onto bins of initial ``loads``: the bin of every item,
    exactly as the heap of (load, bin) pairs gives it, ties included.

    A round takes the next ``k`` items and the bins in (load, bin) order: item j goes to the j-th
    bin while that bin still precedes every bin the round has already raised (item j's heap minimum
    is then the j-th untouched bin), i.e. while ``min_{t<j} (load_t + cost_t) > load_j``; an equality
    stops the round too, the bin numbers then deciding. The first item always goes to the first bin,
    so every round places at least one item; a round that places fewer than ``FEW`` gives the next
    ``k`` items to the heap instead (heavy items climbing past several bins at once).
    """
    n = len(costs)
    out = np.empty(n, np.int64)
    loads = np.asarray(loads, np.float64).copy()
    ids = np.arange(k)
    i = 0
    while i < n:
        perm = np.lexsort((ids, loads))
        r = min(k, n - i)
        first = perm[:r]
        old = loads[first]
        new = old + costs[i:i + r]
        stop = np.flatnonzero(np.minimum.accumulate(new)[:-1] <= old[1:])
        j = r if not len(stop) else int(stop[0]) + 1
        if j < FEW and n - i > FEW:
            heap = list(zip(loads.tolist(), range(k)))
            heapq.heapify(heap)
            end = min(n, i + k)
            out[i:end] = _heap_lpt(costs[i:end].tolist(), heap)
            for load, b in heap:
                loads[b] = load
            i = end
            continue
        out[i:i + j] = first[:j]
        loads[first[:j]] = new[:j]
        i += j
    return out


@register_balancer("greedy")
def greedy(p: BinProblem) -> BinAssignment:
    n = len(p.costs)
    order = np.argsort(-p.costs, kind="stable")
    costs = p.costs[order].tolist()
    out = [0] * n
    loads, tload = p.initial()
    heap = list(zip(loads.tolist(), range(p.n_bins)))
    heapq.heapify(heap)
    n_bins = p.n_bins
    if p.cap is None and p.count_cap is None and n_bins >= BATCH_BINS:
        out = _rounds(p.costs[order], loads, n_bins)
    elif p.cap is None and p.count_cap is None:
        out = _heap_lpt(costs, heap)               # the hot path: one heap operation per item
    else:
        cap = float("inf") if p.cap is None else p.cap
        count_cap = n + 1 if p.count_cap is None else p.count_cap
        full, full_max = 0, n - (count_cap - 1) * n_bins     # bins that may still reach count_cap
        toks = p.tokens[order]
        # smallest token count still to come: a bin that cannot take even that one is retired
        rest_min = np.append(np.minimum.accumulate(toks[::-1])[::-1], 0).tolist()
        toks = toks.tolist()
        tl = tload.tolist()
        counts = [0] * n_bins
        for i, (c, t) in enumerate(zip(costs, toks)):
            aside = []
            while True:
                if not heap:
                    if p.grow <= 0:
                        raise ConfigError(f"an item of {t} tokens fits no bin and no bin may be opened")
                    heap = [(0.0, b) for b in range(n_bins, n_bins + p.grow)]
                    tl += [0] * p.grow
                    counts += [0] * p.grow
                    n_bins += p.grow
                load, b = heapq.heappop(heap)
                if counts[b] >= (count_cap if full < full_max else count_cap - 1):
                    continue                          # closed: the other bins need the remaining items
                if tl[b] + t <= cap:
                    break
                if tl[b] + rest_min[i] <= cap:
                    aside.append((load, b))           # may still take a smaller item later
            tl[b] += t
            counts[b] += 1
            full += counts[b] == count_cap
            out[i] = b
            if counts[b] < (count_cap if full < full_max else count_cap - 1) and tl[b] + rest_min[i + 1] <= cap:
                heapq.heappush(heap, (load + c, b))
            for entry in aside:
                heapq.heappush(heap, entry)
    bins = np.empty(n, dtype=np.int64)
    bins[order] = out
    return BinAssignment(bins, n_bins)
