"""From item costs to (bucket, microbatch) places: the levels at which balancing applies.

``level="both"`` (default, the paper's interleaving of the two levels) balances buckets first,
so every rank gets the same total cost, then the microbatches inside each bucket, refits them
towards the heaviest microbatch profile of any bucket (a row one heavy item forces is filled on
every rank rather than left short while the other rows rise), and finally renumbers every
bucket's microbatches heaviest first so that heavy lines up with heavy across ranks.
``level="lockstep"`` pools all (bucket, microbatch) bins and balances them as one, then cuts bins
of similar load into microbatch rows and polishes them (items moved out of a row's heaviest bin
into slack elsewhere while that lowers the sum of row maxima): the best choice when every
microbatch index ends in a synchronisation (FSDP/ZeRO-3); where ``"both"``'s layout has the lower
lockstep cost (ranks balanced first can line rows up better), that layout is kept. Samples
spanning several CP ranks are placed this way, heavy ones sharing rows. Refits and polishing
apply to the built-in methods (``REFINED``); a registered method's bins are kept as it gave them.
``level="bucket"`` balances buckets only and fills
microbatches in arrival order; ``level="microbatch"`` keeps the arrival-order split into buckets
(each rank's minibatch unchanged) and balances microbatches inside each. ``equal_counts`` gives
every bucket the same number of items (+-1). Method ``"arrival"`` is the unbalanced baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError
from .bound import lockstep_lower_bound
from .problem import BinProblem, run_balancer

__all__ = ["Placement", "place", "LEVELS"]

LEVELS = ("both", "bucket", "microbatch", "lockstep")
ARRIVAL = "arrival"
# methods whose layout place() compares with another method's on the whole step's lockstep cost
FALLBACK = {"karmarkar_karp": "greedy"}
FALLBACK_SLACK = 1e-3    # no fallback run when the method's lockstep is within this of the lower bound
REFINED = {"greedy", "karmarkar_karp"}   # built-in methods whose layouts are refit/polished for the lockstep cost;
                                        # a registered method's bins are kept as it gave them
SKIP_SLACK = 1e-3        # no refit when the lockstep cost is within this of the heaviest bucket's total
POLISH_CANDIDATES = 4    # bins of each row a polishing move may go to: its lightest
POLISH_PASSES = 4        # passes over the rows, heaviest first, while a pass moves something


@dataclass
class Placement:
    """One entry per (item, shard): items spanning k ranks have k entries, shards 0..k-1."""

    item: np.ndarray
    bucket: np.ndarray
    mb: np.ndarray
    shard: np.ndarray
    nshards: np.ndarray
    n_microbatches: int


def _arrival_buckets(n: int, n_buckets: int) -> np.ndarray:
    return (np.arange(n) * n_buckets) // max(n, 1)


def _fill_microbatches(bucket: np.ndarray, tokens: np.ndarray, n_buckets: int, m: int, cap) -> np.ndarray:
    """Microbatch of each item when each bucket's items are cut in arrival order."""
    mb = np.zeros(len(bucket), np.int64)
    for b in range(n_buckets):
        idx = np.flatnonzero(bucket == b)
        if not len(idx):
            continue
        if cap is None:
            mb[idx] = (np.arange(len(idx)) * m) // len(idx)
            continue
        # arrival order, at most ceil(len/m) items per microbatch, a new one opened when full
        per = math.ceil(len(idx) / m)
        cur, used, cnt = 0, 0, 0
        for i, t in zip(idx.tolist(), tokens[idx].tolist()):
            if used + t > cap or cnt >= per:
                cur, used, cnt = cur + 1, 0, 0
            mb[i], used, cnt = cur, used + t, cnt + 1
    return mb


def _per_bucket(method, costs, tokens, bucket, n_buckets, m, cap, used: set) -> np.ndarray:
    """Balance microbatches inside each bucket separately (may open microbatches per bucket)."""
    mb = np.zeros(len(costs), np.int64)
    by_bucket = np.argsort(bucket, kind="stable")       # each bucket's items, in arrival order
    counts = np.bincount(bucket, minlength=n_buckets)
    for b, idx in enumerate(np.split(by_bucket, np.cumsum(counts)[:-1])):
        if len(idx):
            res = run_balancer(method, BinProblem(costs[idx], tokens[idx], m, cap=cap, grow=1))
            used.add(res.by or method)
            mb[idx] = res.bins
    return mb


def _rounds(costs, bucket, n_buckets: int) -> list[np.ndarray]:
    """Round r: the r-th costliest item of every bucket that has one (each bucket once per round)."""
    n = len(costs)
    order = np.lexsort((-costs, bucket))                       # by bucket, costliest first
    counts = np.bincount(bucket, minlength=n_buckets)
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n) - (np.cumsum(counts) - counts)[bucket[order]]
    by_rank = order[np.argsort(rank[order], kind="stable")]
    return [sel for sel in np.split(by_rank, np.searchsorted(rank[by_rank], np.arange(1, counts.max(initial=0))))
            if len(sel)]


def _lpt_rounds(costs, tokens, bucket, n_buckets: int, m: int, cap) -> np.ndarray:
    """Greedy (LPT) inside every bucket at once: round r places each bucket's r-th largest item
    in that bucket's least-loaded microbatch that fits, opening a microbatch when none does."""
    loads = np.zeros((n_buckets, m))
    tl = np.zeros((n_buckets, m), np.int64)
    limit = np.inf if cap is None else cap
    mb = np.empty(len(costs), np.int64)
    for sel in _rounds(costs, bucket, n_buckets):
        b, t = bucket[sel], tokens[sel]
        while True:
            cand = np.where(tl[b] + t[:, None] <= limit, loads[b], np.inf)
            j = np.argmin(cand, 1)
            if np.isfinite(cand[np.arange(len(sel)), j]).all():
                break
            loads = np.hstack([loads, np.zeros((n_buckets, 1))])    # some item fits nowhere: open one
            tl = np.hstack([tl, np.zeros((n_buckets, 1), np.int64)])
        loads[b, j] += costs[sel]
        tl[b, j] += t
        mb[sel] = j
    return mb


def _few_full_buckets(n: int, n_buckets: int) -> bool:
    """Whether a bucket holds more items than there are buckets: then work goes bucket by bucket (or
    item by item), else vectorised over the buckets (one call per bucket would cost more than the work)."""
    return n / max(n_buckets, 1) > n_buckets


def _within_buckets(method, costs, tokens, bucket, n_buckets: int, m: int, cap, used: set) -> np.ndarray:
    """Balance microbatches inside each bucket: with the method, bucket by bucket, when buckets are
    few and full; with vectorised LPT across all buckets when they are many and small (where one
    method call per bucket would cost more than the balancing itself)."""
    if _few_full_buckets(len(costs), n_buckets):
        return _per_bucket(method, costs, tokens, bucket, n_buckets, m, cap, used)
    return _lpt_rounds(costs, tokens, bucket, n_buckets, m, cap)


def _profile(costs, bucket, mb, n_buckets: int, n_mb: int) -> tuple[np.ndarray, np.ndarray]:
    """(bucket x microbatch loads, the largest j-th heaviest microbatch load of any bucket, for every j):
    the profile's sum is the lockstep cost once microbatches are numbered heaviest first."""
    loads = np.bincount(bucket * n_mb + mb, weights=costs, minlength=n_buckets * n_mb).reshape(n_buckets, n_mb)
    return loads, np.sort(loads, 1)[:, ::-1].max(0)


def _aligned_lockstep(costs, bucket, mb, n_buckets: int, n_mb: int) -> float:
    """Lockstep cost once every bucket's microbatches are numbered heaviest first (``_align_microbatches``)."""
    return float(_profile(costs, bucket, mb, n_buckets, n_mb)[1].sum())


def _fit_profile(costs, tokens, bucket, n_buckets: int, profile: np.ndarray, cap):
    """First fit decreasing inside every bucket, microbatch j of a bucket aiming at ``profile[j]``
    (non-increasing): each bucket's items, costliest first, go to the first microbatch they fit in
    without passing its aim, else (none has room) to the one they pass by the least. ``None`` when an
    item fits no microbatch's tokens. Vectorised over buckets when they are many and small, as in
    ``_within_buckets``."""
    n, m = len(costs), len(profile)
    limit = np.inf if cap is None else cap
    mb = np.empty(n, np.int64)
    if _few_full_buckets(n, n_buckets):                        # one pass over the items
        order = np.lexsort((-costs, bucket))                   # by bucket, costliest first
        aim = profile.tolist()
        loads = [[0.0] * m for _ in range(n_buckets)]
        tl = [[0] * m for _ in range(n_buckets)]
        for i, b, c, t in zip(order.tolist(), bucket[order].tolist(), costs[order].tolist(), tokens[order].tolist()):
            ld, tk = loads[b], tl[b]
            j, least = -1, np.inf
            for k in range(m):
                if tk[k] + t <= limit:
                    if ld[k] + c <= aim[k]:
                        j = k
                        break
                    if ld[k] + c - aim[k] < least:
                        j, least = k, ld[k] + c - aim[k]
            if j < 0:
                return None
            ld[j] += c
            tk[j] += t
            mb[i] = j
        return mb
    loads = np.zeros((n_buckets, m))
    tl = np.zeros((n_buckets, m), np.int64)
    for sel in _rounds(costs, bucket, n_buckets):
        b, c, t = bucket[sel], costs[sel], tokens[sel]
        fits = tl[b] + t[:, None] <= limit
        if not fits.any(1).all():
            return None
        room = profile - loads[b] - c[:, None]
        ok = fits & (room >= 0)
        j = np.where(ok.any(1), ok.argmax(1), np.where(fits, -room, np.inf).argmin(1))
        loads[b, j] += c
        tl[b, j] += t
        mb[sel] = j
    return mb


def _refit_rows(costs, tokens, bucket, mb, n_buckets: int, cap) -> np.ndarray:
    """Lower the lockstep cost of fixed buckets: refit every bucket's microbatches to the heaviest
    profile across buckets (its j-th heaviest microbatch aiming at the largest j-th heaviest load
    of any bucket), so that buckets fill the rows a heavy item already forces instead of spreading
    evenly; kept only where it lowers the aligned lockstep cost. Bucket contents do not change.
    (A second refit from the result gained < 0.1% on ``benchmarks/balance.py``'s workloads.)"""
    if not len(mb):
        return mb
    n_mb = int(mb.max()) + 1
    loads, profile = _profile(costs, bucket, mb, n_buckets, n_mb)
    if profile.sum() <= (1 + SKIP_SLACK) * loads.sum(1).max():     # the lockstep cost is never below a total
        return mb
    new = _fit_profile(costs, tokens, bucket, n_buckets, profile, cap)
    if new is None or not _aligned_lockstep(costs, bucket, new, n_buckets, n_mb) < profile.sum():
        return mb
    return new


def _polish(costs, tokens, row, col, loads, token_loads, cap) -> tuple[np.ndarray, np.ndarray]:
    """Local search on the lockstep cost of (row, bucket) bins: while some row's heaviest bin stands
    alone, move the item out of it that lowers the sum of row maxima the most, into one of the
    ``POLISH_CANDIDATES`` lightest bins of any row where its tokens fit. ``loads``/``token_loads``:
    what is already fixed in the bins (sequences spanning CP ranks). Returns the items' (row, bucket)."""
    row, col = row.copy(), col.copy()
    n_rows, B = loads.shape
    L = loads.copy()
    T = token_loads.copy()
    np.add.at(L, (row, col), costs)
    np.add.at(T, (row, col), tokens)
    limit = np.inf if cap is None else cap
    eps = 1e-12 * max(float(L.max(1).sum()), 1.0)
    K = min(POLISH_CANDIDATES, B)
    budget = len(costs)                                     # moves in all: as many as there are items
    members: dict[int, list[int]] = {}
    for i, b in enumerate((row * B + col).tolist()):
        members.setdefault(b, []).append(i)
    for _ in range(POLISH_PASSES):
        moved = False
        for m in np.argsort(-L.max(1), kind="stable").tolist():
            while budget > 0:
                order = np.argsort(-L[m], kind="stable")
                b1, top = int(order[0]), L[m, order[0]]
                second = L[m, order[1]] if B > 1 else 0.0
                idx = np.array(members.get(m * B + b1, ()) if top - second > eps else (), np.int64)
                if not len(idx):
                    break
                c, t = costs[idx], tokens[idx]
                after = np.maximum(second, top - c)                 # row m's maximum once an item leaves
                rmax = L.max(1)
                light = np.argpartition(L, K - 1, axis=1)[:, :K] if K < B else np.broadcast_to(np.arange(B), L.shape)
                cl, ct = np.take_along_axis(L, light, 1), np.take_along_axis(T, light, 1)
                rise = np.maximum(cl[None] + c[:, None, None] - rmax[None, :, None], 0.0)
                rise[:, m] = np.maximum(cl[m][None] + c[:, None], after[:, None]) - after[:, None]
                rise[:, m][:, light[m] == b1] = np.inf
                net = np.where(ct[None] + t[:, None, None] <= limit, rise, np.inf) - (top - after)[:, None, None]
                k, m2, j = np.unravel_index(np.argmin(net), net.shape)
                if not net[k, m2, j] < -eps:
                    break
                e, b2 = idx[k], int(light[m2, j])
                L[m, b1] -= costs[e]
                T[m, b1] -= tokens[e]
                L[m2, b2] += costs[e]
                T[m2, b2] += tokens[e]
                row[e], col[e] = m2, b2
                members[m * B + b1].remove(e)
                members.setdefault(m2 * B + b2, []).append(e)
                budget -= 1
                moved = True
        if not moved:
            break
    return row, col


def _place_spans(costs, tokens, span, n_buckets, cp, m, cap):
    """Place items spanning several CP ranks, costliest first, each where it raises its row's maximum the
    least (then where its bins are lightest): heavy sequences share rows instead of each setting the
    maximum of a row of its own. Returns entries and the (m, B) cost/token loads.

    Every window of k consecutive CP ranks of a DP group keeps its largest cost and token load per row
    (``window``), updated where a sequence lands: choosing a place reads those, not the bins."""
    dp = n_buckets // cp
    loads = np.zeros((m, dp, cp))
    tl = np.zeros((m, dp, cp), np.int64)
    row_max = np.zeros(m)
    spans = np.flatnonzero(span > 1)
    windows = [(k, s) for k in sorted(set(span[spans].tolist())) if k <= cp for s in range(cp - k + 1)]
    window = {w: (np.zeros((m, dp)), np.zeros((m, dp), np.int64)) for w in windows}
    entries = []
    for i in spans[np.argsort(-costs[spans], kind="stable")]:
        k = int(span[i])
        c, t = costs[i] / k, 2 * math.ceil(tokens[i] / (2 * k))   # a zig-zag shard: 2 chunks of ceil(n / 2k)
        if k > cp or t > cap:
            raise ConfigError(f"a sequence of {int(tokens[i])} tokens cannot span {k} of {cp} CP ranks with at most "
                              f"{cap} tokens per rank")
        while True:
            best = None
            for start in range(cp - k + 1):
                top, top_tokens = window[k, start]
                peak = top + c
                rise = np.where(top_tokens + t <= cap, np.maximum(peak - row_max[:, None], 0.0), np.inf)
                low = rise <= rise.min() * (1 + 1e-12)
                j = np.unravel_index(np.argmin(np.where(low, peak, np.inf)), peak.shape)
                if np.isfinite(rise[j]) and (best is None or (rise[j], peak[j]) < best[:2]):
                    best = (rise[j], peak[j], int(j[0]), int(j[1]), start)
            if best is not None:
                break
            loads = np.concatenate([loads, np.zeros((1, dp, cp))])     # open another microbatch
            tl = np.concatenate([tl, np.zeros((1, dp, cp), np.int64)])
            row_max = np.append(row_max, 0.0)
            window = {w: (np.vstack([a, np.zeros((1, dp))]), np.vstack([b, np.zeros((1, dp), np.int64)]))
                      for w, (a, b) in window.items()}
        _, _, mm, g, start = best
        loads[mm, g, start:start + k] += c
        tl[mm, g, start:start + k] += t
        row_max[mm] = max(row_max[mm], loads[mm, g].max())
        for (kw, sw), (top, top_tokens) in window.items():
            top[mm, g] = loads[mm, g, sw:sw + kw].max()
            top_tokens[mm, g] = tl[mm, g, sw:sw + kw].max()
        entries.extend((i, g * cp + start + s, mm, s, k) for s in range(k))
    return entries, loads.reshape(-1, n_buckets), tl.reshape(-1, n_buckets)


def place(costs: np.ndarray, tokens: np.ndarray, *, n_buckets: int, microbatches: int, method: str,
          cap: int | None, level: str = "both", equal_counts: bool = False,
          groups: list[list[int]] | None = None, span: np.ndarray | None = None, cp: int = 1) -> Placement:
    """Assign every item to a bucket and a microbatch (see the module docstring).

    A method with a ``FALLBACK`` (``karmarkar_karp``: ``greedy``) is judged on the figure the plan
    reports, the lockstep cost of the whole step (sum over microbatch index of the max over buckets):
    unless its layout is within ``1 + FALLBACK_SLACK`` of the lower bound (which no layout beats), the
    fallback lays the step out too and the cheaper of the two is kept, the method's on a tie. So its
    lockstep cost is at most ``1 + FALLBACK_SLACK`` times the fallback's. With bucket ``groups`` this
    holds inside every group (each is placed by a call of its own).
    """
    kw = dict(n_buckets=n_buckets, microbatches=microbatches, cap=cap, level=level, equal_counts=equal_counts,
              groups=groups, span=span, cp=cp)
    used: set[str] = set()
    spans: dict = {}
    pl = _place(costs, tokens, method=method, used=used, used_spans=spans, **kw)
    fallback = FALLBACK.get(method)
    if fallback is None or (groups is not None and len(groups) > 1) or not len(pl.item) or used <= {fallback}:
        return pl                 # (every answer the method gave was the fallback's: the same layout)
    costs = np.asarray(costs, np.float64)
    tokens = np.asarray(tokens, np.int64)
    (cost, tok), lock = _lockstep(pl, costs, tokens, n_buckets)
    if lock <= (1 + FALLBACK_SLACK) * lockstep_lower_bound(cost, n_buckets, tok, cap):
        return pl
    try:
        other = _place(costs, tokens, method=fallback, used=set(), used_spans=spans, **kw)
    except ConfigError:           # the fallback found no layout: the method's stands
        return pl
    return other if _lockstep(other, costs, tokens, n_buckets)[1] < lock else pl


def _lockstep(pl: Placement, costs: np.ndarray, tokens: np.ndarray, n_buckets: int):
    """((entry costs, entry tokens), lockstep cost) of a placement: an item spanning k CP ranks puts
    ``cost / k`` and a zig-zag shard of ``2 * ceil(tokens / 2k)`` tokens on each."""
    k = pl.nshards
    cost = costs[pl.item] / k
    tok = np.where(k > 1, 2 * -(-tokens[pl.item] // (2 * k)), tokens[pl.item])
    loads = np.bincount(pl.mb * n_buckets + pl.bucket, weights=cost, minlength=pl.n_microbatches * n_buckets)
    return (cost, tok), float(loads.reshape(-1, n_buckets).max(1).sum())


def _place(costs: np.ndarray, tokens: np.ndarray, *, n_buckets: int, microbatches: int, method: str,
           cap: int | None, level: str = "both", equal_counts: bool = False,
           groups: list[list[int]] | None = None, span: np.ndarray | None = None, cp: int = 1,
           used: set, used_spans: dict | None = None) -> Placement:
    """:func:`place` with ``method`` alone; adds to ``used`` the method behind every balancer answer
    (``BinAssignment.by``, else ``method``). ``used_spans`` keeps the placement of the sequences
    spanning CP ranks (method-independent) for another call on the same items."""
    used_spans = {} if used_spans is None else used_spans
    if level not in LEVELS:
        raise ConfigError(f"unknown balance level {level!r}; choose one of {LEVELS}")
    n = len(costs)
    costs = np.asarray(costs, np.float64)
    tokens = np.asarray(tokens, np.int64)
    if groups is not None and len(groups) > 1:
        return _place_groups(costs, tokens, n_buckets=n_buckets, microbatches=microbatches, method=method,
                             cap=cap, level=level, equal_counts=equal_counts, groups=groups, span=span, cp=cp)
    span = np.ones(n, np.int64) if span is None else span
    spanned = span > 1
    if spanned.any() and (level != "lockstep" or method == ARRIVAL or equal_counts):
        raise ConfigError("samples spanning several CP ranks are placed with balance(level='lockstep', "
                          "equal_counts=False) and a balancing method; raise max_tokens or use distribute('DP') otherwise")
    m = microbatches
    entries = []
    if method == ARRIVAL:
        bucket = _arrival_buckets(n, n_buckets)
        mb = _fill_microbatches(bucket, tokens, n_buckets, m, cap)
    elif level in ("bucket", "both"):
        count_cap = math.ceil(n / n_buckets) if equal_counts else None
        res = run_balancer(method, BinProblem(costs, tokens, n_buckets, count_cap=count_cap))
        used.add(res.by or method)
        bucket = res.bins
        if level == "bucket":
            mb = _fill_microbatches(bucket, tokens, n_buckets, m, cap)
        else:
            mb = _within_buckets(method, costs, tokens, bucket, n_buckets, m, cap, used)
            if method in REFINED:
                mb = _refit_rows(costs, tokens, bucket, mb, n_buckets, cap)
    elif level == "microbatch":
        bucket = _arrival_buckets(n, n_buckets)
        mb = _within_buckets(method, costs, tokens, bucket, n_buckets, m, cap, used)
        if method in REFINED:
            mb = _refit_rows(costs, tokens, bucket, mb, n_buckets, cap)
    else:
        loads = tl = None
        if spanned.any():
            if "spans" not in used_spans:      # the same for every method: placed once per place()
                used_spans["spans"] = _place_spans(costs, tokens, span, n_buckets, cp, m, cap)
            entries, loads, tl = used_spans["spans"]
            m = loads.shape[0]
            loads, tl = loads.ravel(), tl.ravel()
        short = np.flatnonzero(~spanned)
        # the lockstep cost these bins will give: rows fixed by the spans, else cut by _interleave
        score = _row_max_sum(n_buckets) if spanned.any() else _sorted_row_max_sum(n_buckets)
        res = run_balancer(method, BinProblem(costs[short], tokens[short], n_buckets * m, cap=cap,
                                              loads=loads, token_loads=tl, grow=n_buckets, score=score))
        used.add(res.by or method)
        bins = res.bins if spanned.any() else _interleave(costs[short], res.bins, n_buckets, res.n_bins)
        bucket = np.full(n, -1, np.int64)
        mb = np.full(n, -1, np.int64)
        mb[short], bucket[short] = bins // n_buckets, bins % n_buckets
        if method in REFINED:
            rows = max(m, int(bins.max()) // n_buckets + 1 if len(bins) else 0)
            fixed = np.zeros((2, rows, n_buckets))
            if spanned.any():
                fixed[:, :m] = np.stack([loads, tl]).reshape(2, m, n_buckets)
            mb[short], bucket[short] = _polish(costs[short], tokens[short], mb[short], bucket[short], fixed[0],
                                               fixed[1], cap)
    single = np.flatnonzero(span <= 1)
    item = np.concatenate([single, np.array([e[0] for e in entries], np.int64)])
    cols = [np.array([e[j] for e in entries], np.int64) for j in range(1, 5)]
    bucket_all = np.concatenate([bucket[single], cols[0]])
    mb_all = np.concatenate([mb[single], cols[1]])
    shard = np.concatenate([np.zeros(len(single), np.int64), cols[2]])
    nshards = np.concatenate([np.ones(len(single), np.int64), cols[3]])
    n_mb = max(microbatches, int(mb_all.max()) + 1 if len(mb_all) else 0)
    if method != ARRIVAL and not entries:
        mb_all = _align_microbatches(costs[item], bucket_all, mb_all, n_buckets, n_mb)
    pl = Placement(item, bucket_all, mb_all, shard, nshards, n_mb)
    if level == "lockstep" and method in REFINED and not entries and n:
        # pooling is not always the cheaper: ranks balanced first and refit can line rows up better
        other = _place(costs, tokens, n_buckets=n_buckets, microbatches=microbatches, method=method, cap=cap,
                       level="both", equal_counts=equal_counts, used=used)
        if _lockstep(other, costs, tokens, n_buckets)[1] < _lockstep(pl, costs, tokens, n_buckets)[1]:
            return other
    return pl


def _row_max_sum(n_buckets: int):
    """Lockstep cost of pooled bins numbered ``mb * n_buckets + bucket``: sum over rows of the row max."""
    return lambda loads: float(loads.reshape(-1, n_buckets).max(1).sum()) if len(loads) else 0.0


def _sorted_row_max_sum(n_buckets: int):
    """Lockstep cost of pooled bins once ``_interleave`` cuts them, sorted, into rows of ``n_buckets``."""
    return lambda loads: float(np.sort(loads)[::-1][::n_buckets].sum())


def _interleave(cost, bins, n_buckets: int, n_bins: int) -> np.ndarray:
    """Relabel interchangeable bins as (microbatch, bucket) pairs; returns the new bin of every item.

    Bins are sorted by load and cut into microbatch rows of ``n_buckets`` similar loads (which
    minimises the lockstep sum of row maxima for these bins); inside each row, the heaviest bin
    goes to the bucket with the lightest total so far (LPT across rows), balancing the ranks.
    """
    loads = np.bincount(bins, weights=cost, minlength=n_bins)
    by_load = np.argsort(-loads, kind="stable").reshape(-1, n_buckets)
    totals = np.zeros(n_buckets)
    new_of_old = np.empty(n_bins, np.int64)
    for m, row in enumerate(by_load):
        lightest = np.argsort(totals, kind="stable")
        new_of_old[row] = m * n_buckets + lightest
        totals[lightest] += loads[row]
    return new_of_old[bins]


def _align_microbatches(cost, bucket, mb, n_buckets: int, n_mb: int) -> np.ndarray:
    """Renumber each bucket's microbatches heaviest first.

    Lockstep training waits, at each microbatch index, for the slowest rank; sorting every
    bucket's microbatches the same way lines up heavy with heavy and light with light, which
    minimises the sum over indices of the max over buckets for the given bins.
    """
    loads = np.bincount(mb * n_buckets + bucket, weights=cost, minlength=n_mb * n_buckets).reshape(n_mb, n_buckets)
    order = np.argsort(-loads, axis=0, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(n_mb)[:, None].repeat(n_buckets, 1), 0)
    return rank[mb, bucket]


def _place_groups(costs, tokens, *, groups, n_buckets, span, **kw) -> Placement:
    """Two levels for very large jobs: items to bucket groups first, then balanced inside each group.

    The first level has one bin per bucket, read as its group, so that a group's share of the
    items follows its number of buckets (the last group may be smaller).
    """
    if span is not None and (span > 1).any():
        raise ConfigError("group_size cannot be combined with samples spanning CP ranks")
    method = kw["method"]
    group_of_bucket = np.empty(n_buckets, np.int64)
    for g, members in enumerate(groups):
        group_of_bucket[members] = g
    if method == ARRIVAL:
        g_of = group_of_bucket[_arrival_buckets(len(costs), n_buckets)]
    else:
        count_cap = math.ceil(len(costs) / n_buckets) if kw["equal_counts"] else None
        g_of = group_of_bucket[run_balancer(method, BinProblem(costs, tokens, n_buckets, count_cap=count_cap)).bins]
    parts = []
    for g, members in enumerate(groups):
        idx = np.flatnonzero(g_of == g)
        sub = place(costs[idx], tokens[idx], n_buckets=len(members), groups=None, span=None, **kw)
        parts.append((idx[sub.item], np.asarray(members)[sub.bucket], sub))
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    return Placement(cat([p[0] for p in parts]), cat([p[1] for p in parts]), cat([p[2].mb for p in parts]),
                     cat([p[2].shard for p in parts]), cat([p[2].nshards for p in parts]),
                     max(p[2].n_microbatches for p in parts))
