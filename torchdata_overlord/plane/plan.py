"""Plan: what every trainer client receives at one step (the Planner's output, paper section 3).

For each bucket (the ranks that consume the same samples) a plan lists its microbatches as
ordered sample references, and it says how each client is served: ``"data"``, ``"metadata"``
(pipeline stages > 0) or ``"none"`` (ranks > 0 along a ``broadcast_at`` dimension). All arrays
stay columnar; per-rank lists are only built when asked for.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..errors import ConfigError
from .balancing.bound import lockstep_lower_bound
from .place_tree import ClientPlaceTree
from .records import Records, SampleKey

__all__ = ["Plan", "PlanItem", "ENTRY_COLUMNS", "row_cp"]

# one entry per (sample, piece, CP shard) placed in a (bucket, microbatch)
ENTRY_COLUMNS = ("row", "bucket", "mb", "tokens", "cost", "piece", "npieces", "shard", "nshards")


def row_cp(mesh: ClientPlaceTree, axis: str) -> int:
    """The CP size a bucket's packed rows are split over, per sequence, by the Data Constructor:
    the mesh's cp along ``distribute("DP")`` (each sequence then takes a multiple of 2*cp tokens), else 1."""
    return mesh.sizes.get("cp", 1) if axis == "dp" else 1


class PlanItem(NamedTuple):
    """One planned sample (or piece / CP shard of one) in a microbatch."""

    source: str
    index: int
    tokens: int          # tokens of this piece after truncation/splitting (whole piece, before CP sharding)
    piece: int = 0       # oversize="split": piece i of npieces, each an independent segment
    npieces: int = 1
    shard: int = 0       # distribute("CP"): this rank's shard of a sequence spanning nshards CP ranks
    nshards: int = 1

    @property
    def key(self) -> SampleKey:
        return SampleKey(self.source, self.index)


@dataclass
class Plan:
    step: int
    mesh: ClientPlaceTree
    axis: str
    buckets: list[tuple[int, ...]]
    n_microbatches: int
    records: Records
    entries: dict[str, np.ndarray]
    broadcast: tuple[str, ...] = ()
    stats: dict = field(default_factory=dict)
    modules: dict[str, "Plan"] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        e = self.entries
        order = np.lexsort((e["order"], e["mb"], e["bucket"]))
        self.entries = {k: np.asarray(e[k])[order] for k in ENTRY_COLUMNS}
        self._bucket_of_rank = np.full(self.mesh.world_size, -1, np.int64)
        for b, ranks in enumerate(self.buckets):
            self._bucket_of_rank[list(ranks)] = b
        # where each (bucket, microbatch) starts in the sorted entries
        flat = self.entries["bucket"] * self.n_microbatches + self.entries["mb"]
        self._starts = np.searchsorted(flat, np.arange(len(self.buckets) * self.n_microbatches + 1))
        self._deliveries: dict[int, str] = {}      # rank -> delivery, as asked (a step asks each rank's several times)

    # -- per client ----------------------------------------------------------------------------
    def bucket_of(self, rank: int) -> int:
        return int(self._bucket_of_rank[self.mesh._check_rank(rank)])

    def delivery(self, rank: int) -> str:
        """``"data"``, ``"metadata"`` (pipeline stages > 0) or ``"none"`` (broadcast receivers)."""
        got = self._deliveries.get(rank)
        if got is None:
            got = self._deliveries[rank] = self._delivery(rank)
        return got

    def _delivery(self, rank: int) -> str:
        c = self.mesh.coords(rank)
        if any(c.get(d, 0) > 0 for d in self.broadcast):
            return "none"
        if c.get("pp", 0) > 0:
            return "metadata"
        return "data"

    def clients(self, delivery: str = "data") -> list[int]:
        return [r for r in range(self.mesh.world_size) if self.delivery(r) == delivery]

    def bucket_microbatches(self, bucket: int) -> list[list[PlanItem]]:
        bounds, cols = self.bucket_columns(bucket)
        items = [PlanItem(*c) for c in zip(*cols)]
        return [items[lo:hi] for lo, hi in zip(bounds, bounds[1:])]

    def bucket_columns(self, bucket: int) -> tuple[list[int], list[list]]:
        """``bucket``'s entries as Python lists, one per :class:`PlanItem` field (source names, indices,
        tokens, piece, npieces, shard, nshards), and where each microbatch starts in them (``n_microbatches
        + 1`` bounds, from 0): what :meth:`bucket_microbatches` gives, without an object per entry."""
        n = self.n_microbatches
        starts = self._starts[bucket * n:(bucket + 1) * n + 1]
        lo, hi = int(starts[0]), int(starts[-1])
        e, recs = self.entries, self.records
        rows, names = e["row"][lo:hi], recs.sources
        cols = [[names[s] for s in recs.source_id[rows].tolist()], recs.index[rows].tolist(),
                *(e[k][lo:hi].tolist() for k in ("tokens", "piece", "npieces", "shard", "nshards"))]
        return (starts - lo).tolist(), cols

    def microbatches(self, rank: int) -> list[list[PlanItem]]:
        """The microbatches ``rank`` consumes (``[]`` for a client that receives nothing).

        A pipeline stage > 0 gets the same list as stage 0 of its bucket, to be served as
        metadata only; CP ranks of a ``distribute("DP")`` bucket share their bucket's list (the
        Data Constructor cuts each sequence into their zig-zag shards).
        """
        if self.delivery(rank) == "none":
            return []
        return self.bucket_microbatches(self.bucket_of(rank))

    # -- whole plan ----------------------------------------------------------------------------
    def sampled_keys(self) -> list[SampleKey]:
        """The step's sampled set (after mixing, before dropping oversized samples)."""
        return self.records.keys()

    def planned_keys(self) -> Counter:
        """Each planned sample counted once (first piece, first shard)."""
        e = self.entries
        first = (e["piece"] == 0) & (e["shard"] == 0)
        return Counter(self.records.keys(e["row"][first]))

    def module(self, name: str) -> "Plan":
        if name in (self.mesh.name, None):
            return self
        if name not in self.modules:
            raise ConfigError(f"plan has no module {name!r}; have {[self.mesh.name, *self.modules]}")
        return self.modules[name]

    def to_dict(self) -> dict:
        """Plain-Python form (lists, ints, strs): equality across runtimes, transport, logs."""
        e = self.entries
        return {
            "step": self.step, "module": self.mesh.name, "axis": self.axis,
            "buckets": [list(b) for b in self.buckets], "n_microbatches": self.n_microbatches,
            "broadcast": list(self.broadcast),
            "entries": [[str(k) for k in self.records.keys(e["row"])]] + [e[c].tolist() for c in ENTRY_COLUMNS[1:]],
            "modules": {k: m.to_dict() for k, m in self.modules.items()},
        }

    def bin_costs(self) -> np.ndarray:
        """Cost per (microbatch, bucket)."""
        e = self.entries
        flat = e["mb"] * len(self.buckets) + e["bucket"]
        return np.bincount(flat, weights=e["cost"], minlength=self.n_microbatches * len(self.buckets)).reshape(
            self.n_microbatches, len(self.buckets))

    def bin_tokens(self) -> np.ndarray:
        """Tokens per (microbatch, bucket): those of the bin's packed row (what ``max_tokens`` caps), each
        sequence padded to a multiple of 2*cp where the row is split over CP ranks; a CP shard as placed."""
        e = self.entries
        flat = e["mb"] * len(self.buckets) + e["bucket"]
        return np.bincount(flat, weights=self.entry_tokens(), minlength=self.n_microbatches * len(self.buckets)).reshape(
            self.n_microbatches, len(self.buckets)).astype(np.int64)

    def entry_tokens(self) -> np.ndarray:
        """Tokens each entry takes in its bin, as ``bin_tokens`` counts them."""
        e = self.entries
        cp = row_cp(self.mesh, self.axis)
        mult = 2 * cp if cp > 1 else 1
        # a sequence spanning k CP ranks gives each a zig-zag shard of 2 chunks of ceil(n / 2k) tokens
        return np.where(e["nshards"] > 1, 2 * -(-e["tokens"] // (2 * e["nshards"])), -(-e["tokens"] // mult) * mult)

    def render(self, fmt: str = "text", max_buckets: int = 8) -> str:
        """A readable drawing of this step: sources -> buckets -> microbatches -> clients (text or DOT)."""
        from .render import render_plan
        return render_plan(self, fmt=fmt, max_buckets=max_buckets)

    def __repr__(self) -> str:
        s = self.stats
        return (f"Plan(step={self.step}, samples={len(self.records)}, buckets={len(self.buckets)} along {self.axis}, "
                f"microbatches={self.n_microbatches}, max/mean={s.get('max_over_mean', float('nan')):.3f})")


def compute_stats(plan: Plan, requested_microbatches: int, oversize: dict, mix: dict | None,
                  max_tokens: int | None = None) -> dict:
    """Balance figures for one plan: per-rank cost spread, lockstep step cost and its lower bound
    (``balancing.bound.lockstep_lower_bound``, which uses the bins' token cap ``max_tokens``)."""
    bins = plan.bin_costs()
    per_bucket = bins.sum(0)
    B = len(plan.buckets)
    total = float(per_bucket.sum())
    mean = total / B if B else 0.0
    largest = float(plan.entries["cost"].max()) if len(plan.entries["cost"]) else 0.0
    lockstep = float(bins.max(1).sum()) if bins.size else 0.0
    simple = max(largest, mean)
    bound = max(simple, lockstep_lower_bound(plan.entries["cost"], B, plan.entry_tokens(), max_tokens)) if B else simple
    stats = {
        "samples": len(plan.records),
        "entries": len(plan.entries["row"]),
        "buckets": B,
        "microbatches": plan.n_microbatches,
        "microbatches_opened": plan.n_microbatches - requested_microbatches,
        "total_cost": total,
        "max_bucket_cost": float(per_bucket.max()) if B else 0.0,
        "max_over_mean": float(per_bucket.max() / mean) if mean > 0 else 1.0,
        "lockstep_cost": lockstep,
        "lower_bound": bound,
        "lower_bound_simple": simple,
        "lockstep_over_bound": lockstep / bound if bound > 0 else 1.0,
        "largest_over_fair_share": largest / mean if mean > 0 else 0.0,
        "max_bin_tokens": int(plan.bin_tokens().max()) if bins.size else 0,
        "oversize": oversize,
        "hint": None,
    }
    if mean > 0 and largest > mean:
        stats["hint"] = (f"one sample costs {largest / mean:.2f}x a rank's fair share of this step: no assignment "
                         f"can balance it; spread long sequences over CP ranks with distribute('CP') and max_tokens")
    if mix is not None:
        stats["mixture"] = mix
    return stats
