"""Karmarkar-Karp gives exactly the partitions of a straightforward largest differencing (ties included).

The reference below keeps every partition as a list of slots ``[cost, tokens, items, bin]`` and merges
them directly (no merge tree, no slot maps): ``karmarkar_karp`` with its own ``_differencing`` must
place every item in the same bin as with this one, over random instances full of equal costs.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest

import torchdata_overlord.plane.balancing.karmarkar_karp as kk
from torchdata_overlord.errors import ConfigError
from torchdata_overlord.plane.balancing.problem import BinAssignment, BinProblem


def _spread(part) -> float:
    return max(s[0] for s in part) - min(s[0] for s in part)


def reference_differencing(p: BinProblem, order: np.ndarray, per_row: int) -> BinAssignment:
    """Largest differencing of ``order`` (rows of ``per_row`` items), slots carrying their items."""
    k, n, cap = p.n_bins, len(order), p.cap
    loads, tl = p.initial()
    costs, toks = p.costs[order].tolist(), p.tokens[order].tolist()
    rows = max(math.ceil(n / per_row), 1)
    empty = lambda: [0.0, 0, [], None]  # noqa: E731
    parts = [[[float(loads[j]), int(tl[j]), [], j] for j in range(k)]]       # the anchor: the bins themselves
    for r in range(rows):
        items = range(r * per_row, min(n, (r + 1) * per_row))
        parts.append([[costs[i], toks[i], [i], None] for i in items] + [empty() for _ in range(k - len(items))])
    heap = [(-_spread(part), i) for i, part in enumerate(parts)]
    heapq.heapify(heap)
    n_bins = k
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[1], heapq.heappop(heap)[1]
        A, B = parts[a], parts[b]
        for part in (A, B):
            part.extend(empty() for _ in range(n_bins - len(part)))
        sa = sorted(range(n_bins), key=lambda j: A[j][0], reverse=True)
        sb = sorted(range(n_bins), key=lambda j: B[j][0])
        if cap is not None and any(A[x][1] + B[y][1] > cap for x, y in zip(sa, sb)):
            pi = np.arange(n_bins)
            if not kk._repair(np.array([A[x][0] for x in sa]), np.array([A[x][1] for x in sa]),
                              np.array([B[y][1] for y in sb]), pi, cap):
                if p.grow <= 0:
                    raise ConfigError("no room under the cap")
                n_bins += p.grow
                heapq.heappush(heap, (-_spread(A), a))
                heapq.heappush(heap, (-_spread(B), b))
                continue
            sb = [sb[i] for i in pi]
        parts.append([[A[x][0] + B[y][0], A[x][1] + B[y][1], A[x][2] + B[y][2], A[x][3] if B[y][3] is None else B[y][3]]
                      for x, y in zip(sa, sb)])
        heapq.heappush(heap, (-_spread(parts[-1]), len(parts) - 1))
    root = parts[heap[0][1]]
    bins = np.empty(n, np.int64)
    opened = k
    for slot in root:
        if slot[3] is None:
            slot[3], opened = opened, opened + 1
        bins[slot[2]] = slot[3]
    return BinAssignment(bins, n_bins)


def _instance(rng):
    """A random problem: costs often equal (few distinct values, zeros), caps, loads, count caps, growth."""
    k = int(rng.choice([1, 2, 3, 4, 4, 5, 8, 9, 12]))
    n = int(rng.choice([0, 1, k, int(rng.integers(1, 40)), int(rng.integers(1, 200))]))
    kind = rng.integers(4)
    costs = (rng.integers(0, 4, n).astype(np.float64) if kind == 0 else rng.pareto(1.1, n) + rng.random(n)
             if kind == 1 else np.round(rng.random(n), 1) if kind == 2 else np.full(n, 2.5))
    tokens = rng.integers(1, 6, n)
    cap = None if rng.random() < 0.4 else int(rng.integers(5, 20))
    loads = token_loads = None
    if rng.random() < 0.3:
        loads = rng.integers(0, 3, k).astype(np.float64)
        token_loads = np.zeros(k, np.int64) if cap is None else rng.integers(0, 3, k)
    count_cap = math.ceil(n / k) + int(rng.integers(0, 2)) if rng.random() < 0.2 and cap is None else None
    grow = 0 if rng.random() < 0.2 else k
    return BinProblem(costs, tokens, k, cap=cap, count_cap=count_cap, loads=loads, token_loads=token_loads, grow=grow)


def _answer(p: BinProblem):
    try:
        out = kk.karmarkar_karp(p)
    except ConfigError as e:
        return type(e)
    return out.n_bins, out.bins.tolist(), out.by


@pytest.mark.parametrize("seed", range(8))
def test_karmarkar_karp_matches_the_reference_differencing(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    problems = [_instance(rng) for _ in range(150)]
    ours = [_answer(p) for p in problems]
    monkeypatch.setattr(kk, "_differencing", reference_differencing)
    assert [_answer(p) for p in problems] == ours
