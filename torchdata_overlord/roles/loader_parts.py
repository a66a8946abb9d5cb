"""Data-parallel Source Loaders (paper 5.1, "data parallel"): one source read by ``k`` loaders (parts).

Part ``j`` of ``k`` reads the units (row groups) at positions ``j, j+k, ...`` of each epoch's order
(:meth:`~torchdata_overlord.ParquetSource.shard`) into a buffer of its own. The Planner merges the
parts' buffers by read order and keeps the first ``buffer_size`` (:meth:`~..plane.records.BufferMeta.merge`),
and merges their states with :func:`merge_states`: both are exactly what one loader reading the
whole source would have, so the stream is a function of the seed, the configuration, the feedback
and the consumed position, never of ``k``. A merged state loads into any number of parts (each
keeps the units it reads), which is how a source is resharded live and resumed under another
placement.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..errors import ConfigError
from ..plane.records import BufferMeta
from .source_loader import SourceLoader

__all__ = ["part_key", "part_keys", "merge_states", "Parts"]


def part_key(source: str, j: int, k: int) -> str:
    """The loader key of part ``j`` of ``k`` (the source's own name when it is not split)."""
    return source if k == 1 else f"{source}@{j}of{k}"


def part_keys(source: str, k: int) -> list[str]:
    return [part_key(source, j, k) for j in range(k)]


def merge_states(states: list[dict]) -> dict:
    """The state of one loader over the whole source, from the states of its parts ``0..k-1`` (in
    order): the earliest part's position, every unit a later part passed (whole, or the rows it read
    of the unit it stands in) as ``ahead``, and every part's out-of-order takes."""
    k = len(states)
    if k == 1:
        return states[0]
    S, T, E = SourceLoader.SOURCE_STATE, SourceLoader.TAKEN, SourceLoader.EPOCH_LOG
    srcs = [st[S] for st in states]
    n = int(srcs[0]["units"])
    pos = [(int(s["epoch"]) * n + int(s["unit"]), int(s["row"])) for s in srcs]
    m = min(range(k), key=lambda j: pos[j])
    g0, r0 = pos[m]
    ahead: dict[int, int] = {}

    def passed(g: int, rows: int) -> None:
        cur = ahead.get(g, 0)
        ahead[g] = -1 if rows < 0 or cur < 0 else max(cur, rows)

    for j, (src, (g, r)) in enumerate(zip(srcs, pos)):
        for ga, ra in src.get("ahead") or []:
            if ga >= g0:
                passed(int(ga), int(ra))
        if j == m:
            continue
        for u in range(g0, g):                  # part j's own units before its position: all passed
            if u % n % k == j:
                passed(u, -1)
        if r:
            passed(g, r)
    floor = (g0 << 32) | r0
    taken = sorted({(int(i), int(o)) for st in states for i, o in st[T] if o < 0 or o >= floor})
    return {S: {**srcs[m], "ahead": [[g, r] for g, r in sorted(ahead.items())]},
            T: [list(t) for t in taken], E: sorted({e for st in states for e in st[E]})[-SourceLoader.EPOCHS_KEPT:]}


class Parts:
    """Which loaders serve each source (``counts``: source -> k, default 1) and how the Planner sees
    them as one: merged metadata, each part's share of a step, the sources' merged states."""

    def __init__(self, sources: list[str], counts: Mapping[str, int] | None = None,
                 buffers: Mapping[str, int] | None = None):
        counts = dict(counts or {})
        unknown = set(counts) - set(sources)
        if unknown:
            raise ConfigError(f"loader actors given for unknown sources {sorted(unknown)}; sources are {sources}")
        for s, k in counts.items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ConfigError(f"source {s!r}: its number of loader actors must be an integer >= 1, got {k!r}")
        self.sources, self.buffers = list(sources), dict(buffers or {})
        self.counts = {s: int(counts.get(s, 1)) for s in self.sources}
        self.by_source = {s: part_keys(s, self.counts[s]) for s in self.sources}
        self.keys = [key for s in self.sources for key in self.by_source[s]]
        self._where = {key: (s, j) for s in self.sources for j, key in enumerate(self.by_source[s])}

    def source_of(self, key: str) -> str:
        return self._where[key][0]

    def shard_of(self, key: str) -> tuple[int, int]:
        """``(j, k)``: part ``j`` of its source's ``k``."""
        s, j = self._where[key]
        return j, self.counts[s]

    def resized(self, counts: Mapping[str, int]) -> "Parts":
        """The same layout with the sources in ``counts`` in that many parts."""
        return Parts(self.sources, {**self.counts, **counts}, self.buffers)

    def merge_meta(self, metas: Mapping[str, BufferMeta]) -> tuple[dict[str, BufferMeta], dict[str, dict]]:
        """Each source's metadata as one loader would report it (parts merged by read order, the first
        ``buffer_size`` kept), and which part holds each kept sample (``{source: {index: key}}``)."""
        merged, owners = {}, {}
        for s in self.sources:
            keys = self.by_source[s]
            if len(keys) == 1:
                merged[s], owners[s] = metas[keys[0]], None
                continue
            meta, owner = BufferMeta.merge([metas[key] for key in keys], self.buffers[s])
            merged[s] = meta
            owners[s] = dict(zip(meta.index.tolist(), np.asarray(keys)[owner].tolist()))
        return merged, owners

    def split(self, source: str, indices: list, owners: dict | None) -> dict[str, list]:
        """``indices`` of ``source`` per part that holds them (every part named, possibly empty)."""
        keys = self.by_source[source]
        if owners is None:
            return {keys[0]: list(indices)}
        out: dict[str, list] = {key: [] for key in keys}
        for i in indices:
            out[owners[i]].append(i)
        return out

    def merge_states(self, states: Mapping[str, dict]) -> dict[str, dict]:
        """Each source's state (placement-free: it loads into any number of parts) from its parts' states."""
        return {s: merge_states([states[key] for key in self.by_source[s]]) for s in self.sources}

    def split_states(self, states: Mapping[str, dict]) -> dict[str, dict]:
        """Each part's starting state from its source's (the same for every part: a part keeps its own units)."""
        return {key: states[self.source_of(key)] for key in self.keys}

    def to_dict(self) -> dict:
        return dict(self.counts)
