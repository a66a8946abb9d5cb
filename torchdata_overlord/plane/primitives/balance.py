"""``balance(method, microbatches, max_tokens, ...)``: samples to (bucket, microbatch) bins by cost."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError, OversizeSampleError
from ..balancing import LEVELS, get_balancer, place
from ..costs import token_count
from ..plan import row_cp
from .cost import evaluate_cost

OVERSIZE_POLICIES = ("error", "truncate", "split", "drop")


@dataclass
class Assignment:
    """The placed entries (columns of ``plan.ENTRY_COLUMNS`` plus ``order``) and what it took."""

    entries: dict
    n_microbatches: int
    requested_microbatches: int
    oversize: dict
    method: str
    level: str = "both"
    max_tokens: int | None = None     # the per-bin token cap the entries were placed under
    op: "Balance | None" = None       # the balance() that placed them (plan() re-places a module with it)


class Balance:
    """Cost-balances the graph's samples over its buckets' microbatches.

    ``max_tokens`` caps the tokens of each (bucket, microbatch) bin (per rank with
    ``distribute("CP")``, where a longer sequence spans several CP ranks); it is enforced while
    placing: a sample goes only where it fits, and another microbatch is opened only when it fits
    nowhere. A sample longer than any bin can hold meets ``oversize``: ``"error"`` (default),
    ``"truncate"``, ``"split"`` into independent pieces, or ``"drop"``; all but the first are
    counted in the plan's stats. ``intra=True`` orders each microbatch by cost, largest first;
    otherwise samples keep their order in the mixed batch. ``level`` chooses where balancing
    applies (see ``plane/balancing/layout.py``): ``"both"`` (ranks, then microbatches),
    ``"lockstep"``, ``"bucket"`` or ``"microbatch"``; with sequences spanning CP ranks,
    ``"both"`` becomes ``"lockstep"`` (recorded in the plan's stats). Under ``distribute("DP")``
    on a mesh with cp > 1 the Data Constructor pads every sequence to a multiple of 2*cp before
    the per-sequence CP split, so ``max_tokens`` and the costs count each sequence at that padded
    length (and ``max_tokens`` must be at least 2*cp).
    """

    def __init__(self, method="karmarkar_karp", microbatches=1, max_tokens=None, intra=False,
                 oversize="error", level="both", equal_counts=False):
        if method != "arrival":
            get_balancer(method)  # raises for an unknown name
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ConfigError(f"balance(): microbatches must be an integer >= 1, got {microbatches!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ConfigError(f"balance(): max_tokens must be None or an integer >= 1, got {max_tokens!r}")
        if oversize not in OVERSIZE_POLICIES:
            raise ConfigError(f"balance(): oversize must be one of {OVERSIZE_POLICIES}, got {oversize!r}")
        if level not in LEVELS:
            raise ConfigError(f"balance(): level must be one of {LEVELS}, got {level!r}")
        if equal_counts and level == "lockstep":
            raise ConfigError("balance(): equal_counts=True cannot hold with level='lockstep', which pools every "
                              "bucket's microbatches; use level='both' or 'bucket'")
        self.method, self.microbatches, self.max_tokens = method, microbatches, max_tokens
        self.intra, self.oversize, self.level, self.equal_counts = intra, oversize, level, equal_counts

    def _oversize(self, g, limit, cp):
        """Apply the oversize policy; returns per-item row, tokens, piece, npieces and the counts."""
        recs = g.records
        tokens = recs.tokens
        rows = np.arange(len(recs))
        stats = {"policy": self.oversize, "limit": limit, "truncated": 0, "split": 0, "dropped": 0, "dropped_keys": []}
        ones = np.ones(len(rows), np.int64)
        if limit is None or not (tokens > limit).any():
            return rows, tokens, 0 * ones, ones, stats
        over = np.flatnonzero(tokens > limit)
        if self.oversize == "error":
            i = int(over[0])
            where = f"max_tokens={self.max_tokens}" + (f" x cp={cp}" if cp > 1 else "")
            if limit < self.max_tokens:
                where += f" (rounded down to {limit}, a multiple of 2*cp: rows are split per sequence over CP ranks)"
            raise OversizeSampleError(
                f"step {g.step}: sample {recs.key(i)} has {int(tokens[i])} tokens, over {where} "
                f"({len(over)} such samples this step); spread long sequences over CP ranks with distribute('CP'), "
                f"raise max_tokens, or choose balance(oversize='truncate'|'split'|'drop')")
        if self.oversize == "drop":
            stats["dropped"] = len(over)
            stats["dropped_keys"] = [str(k) for k in recs.keys(over)]
            keep = np.flatnonzero(tokens <= limit)
            return keep, tokens[keep], 0 * keep, np.ones(len(keep), np.int64), stats
        if self.oversize == "truncate":
            stats["truncated"] = len(over)
            return rows, np.minimum(tokens, limit), 0 * ones, ones, stats
        stats["split"] = len(over)
        npieces = np.maximum(-(-tokens // limit), 1)
        row = np.repeat(rows, npieces)
        start = np.cumsum(npieces) - npieces
        piece = np.arange(len(row)) - np.repeat(start, npieces)
        tok = np.minimum(tokens[row] - piece * limit, limit)
        return row, tok, piece, np.repeat(npieces, npieces), stats

    def _row_multiple(self, g) -> int:
        """2*cp when the constructor splits each bucket's rows over CP ranks per sequence, else 1."""
        cp = row_cp(g.layout.tree, g.layout.axis)
        if cp == 1:
            return 1
        if self.max_tokens is not None and self.max_tokens < 2 * cp:
            raise ConfigError(f"balance(): max_tokens={self.max_tokens} cannot hold a sequence split over cp={cp} "
                              f"ranks, which takes a multiple of 2*cp={2 * cp} tokens; raise max_tokens")
        return 2 * cp

    def apply(self, g):
        if g.layout is None:
            raise ConfigError("balance() needs buckets: call distribute('DP'|'CP'|'WORLD') before balance()")
        lay = g.layout
        cp = lay.tree.sizes.get("cp", 1) if lay.axis == "cp" else 1
        mult = self._row_multiple(g)
        # a sequence spanning k CP ranks gives each a zig-zag shard of 2 * ceil(n / 2k) tokens, so
        # one rank holds at most `even` tokens of it and a sequence may span at most cp ranks
        even = None if self.max_tokens is None else 2 * (self.max_tokens // 2)
        limit = None if self.max_tokens is None else (self.max_tokens if cp == 1 else max(self.max_tokens, even * cp))
        if limit is not None:
            limit -= limit % mult               # a CP-split row's pieces stay whole multiples of 2*cp
        cost_fn = g.cost_fn or token_count
        costs = g.costs if g.costs is not None else evaluate_cost(cost_fn, g.records)
        row, tok, piece, npieces, ostats = self._oversize(g, limit, cp)
        laid = -(-tok // mult) * mult           # the tokens each piece takes in its packed row
        item_cost = costs[row]
        changed = laid != g.records.tokens[row]
        if changed.any():  # re-cost truncated, split and CP-padded pieces with the same model
            sub = dataclasses.replace(g.records.take(row[changed]), tokens=laid[changed])
            item_cost = item_cost.copy()
            item_cost[changed] = evaluate_cost(cost_fn, sub)
        span, level = None, self.level
        if cp > 1 and self.max_tokens is not None:
            span = np.where(tok > self.max_tokens, -(-tok // max(even, 1)), 1)
            if level == "both" and (span > 1).any():
                level = "lockstep"   # sequences spanning CP ranks need the pooled (bucket, microbatch) bins
        pl = place(item_cost, laid, n_buckets=len(lay.buckets), microbatches=self.microbatches, method=self.method,
                   cap=self.max_tokens, level=level, equal_counts=self.equal_counts, groups=lay.groups,
                   span=span, cp=cp)
        it = pl.item
        order = -item_cost[it] / pl.nshards if self.intra else it.astype(np.float64)
        entries = {"row": row[it], "bucket": pl.bucket, "mb": pl.mb, "tokens": tok[it],
                   "cost": item_cost[it] / pl.nshards, "piece": piece[it], "npieces": npieces[it],
                   "shard": pl.shard, "nshards": pl.nshards, "order": order}
        asg = Assignment(entries, pl.n_microbatches, self.microbatches, ostats, self.method, level, self.max_tokens,
                         self)
        bins = np.bincount(pl.mb * len(lay.buckets) + pl.bucket, weights=entries["cost"],
                           minlength=pl.n_microbatches * len(lay.buckets))
        note = (f"balance({self.method!r}, microbatches={self.microbatches}"
                + (f", max_tokens={self.max_tokens}" if self.max_tokens else "") + "): "
                + f"{len(it)} entries in {pl.n_microbatches} microbatches, max bin cost {bins.max() if len(bins) else 0:.3g}")
        return g.evolve(note, placement=asg)
