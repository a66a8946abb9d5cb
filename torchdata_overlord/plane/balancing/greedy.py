"""Greedy balancing (LPT): largest cost first, into the least-loaded bin that still fits it.

With an item-count cap ``c``, at most ``n - (c - 1) * n_bins`` bins may reach ``c`` items and the
others stop at ``c - 1``, so that the tight cap ``ceil(n / n_bins)`` of ``equal_counts`` gives
every bin ``floor`` or ``ceil`` of ``n / n_bins`` items (LPT alone can leave a bin short).
"""

from __future__ import annotations

import heapq

import numpy as np

from ...errors import ConfigError
from .problem import BinAssignment, BinProblem, register_balancer

__all__ = ["greedy"]


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
    if p.cap is None and p.count_cap is None:
        for i, c in enumerate(costs):              # the hot path: one heap operation per item
            load, b = heap[0]
            heapq.heapreplace(heap, (load + c, b))
            out[i] = b
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
