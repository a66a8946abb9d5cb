"""Sample metadata, kept columnar so that planning 10^5-10^6 samples costs numpy time, not Python time.

A Source Loader reports its read buffer as a :class:`BufferMeta` (one per source); the Planner
concatenates them into :class:`Records`, the table a :class:`~torchdata_overlord.DGraph` works on.
Sample bytes never appear here: only keys, sizes and free-form numeric extras.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from ..errors import ConfigError

__all__ = ["SampleKey", "BufferMeta", "Records"]


class SampleKey(NamedTuple):
    """Identity of one sample: its source and its source-local index (stable across runs)."""

    source: str
    index: int

    def __str__(self) -> str:
        return f"{self.source}:{self.index}"


make_key = partial(tuple.__new__, SampleKey)
"""``make_key((source, index))``: a :class:`SampleKey` without NamedTuple's keyword-handling ``__new__`` (for the
paths that key every sample of a step)."""


def _int_column(name: str, values, n: int | None = None) -> np.ndarray:
    arr = np.asarray(values if values is not None else np.zeros(n or 0), dtype=np.int64)
    if arr.ndim != 1:
        raise ConfigError(f"metadata column {name!r} must be 1-D, got shape {arr.shape}")
    if n is not None and len(arr) != n:
        raise ConfigError(f"metadata column {name!r} has {len(arr)} values, expected {n}")
    if len(arr) and arr.min() < 0:
        raise ConfigError(f"metadata column {name!r} has a negative value at row {int(arr.argmin())}")
    return arr


@dataclass(frozen=True)
class BufferMeta:
    """What one Source Loader reports about its read buffer, oldest sample first.

    ``tokens`` counts text tokens; ``num_images`` and ``patches`` count images and their patches
    (``patches_sq`` is the sum of squared per-image patch counts, which quadratic encoder costs
    need). ``extras`` holds any further numeric per-sample columns. ``order`` (optional) is each
    sample's read-order key in its source: the data-parallel parts of one source report disjoint
    buffers, and :meth:`merge` orders their union as one reader would have read it.
    """

    source: str
    index: np.ndarray
    tokens: np.ndarray
    num_images: np.ndarray | None = None
    patches: np.ndarray | None = None
    patches_sq: np.ndarray | None = None
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)
    order: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(np.asarray(self.index))
        if self.order is not None:
            object.__setattr__(self, "order", _int_column("order", self.order, n))
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("index", _int_column("index", self.index))
        set_("tokens", _int_column("tokens", self.tokens, n))
        set_("num_images", _int_column("num_images", self.num_images, n))
        set_("patches", _int_column("patches", self.patches, n))
        sq = np.zeros(n) if self.patches_sq is None else np.asarray(self.patches_sq, dtype=np.float64)
        if sq.shape != (n,):
            raise ConfigError(f"metadata column 'patches_sq' has shape {sq.shape}, expected ({n},)")
        set_("patches_sq", sq)
        extras = {k: np.asarray(v) for k, v in self.extras.items()}
        for k, v in extras.items():
            if v.shape[:1] != (n,):
                raise ConfigError(f"extra column {k!r} of source {self.source!r} has {len(v)} rows, expected {n}")
        set_("extras", extras)
        ordered = np.sort(self.index)
        if (ordered[1:] == ordered[:-1]).any():     # (np.unique costs several times more, at every step)
            raise ConfigError(f"source {self.source!r} reports duplicate sample indices in its buffer")

    def __len__(self) -> int:
        return len(self.index)

    @classmethod
    def merge(cls, parts: Sequence["BufferMeta"], limit: int) -> tuple["BufferMeta", np.ndarray]:
        """The union of one source's parts in read order, its first ``limit`` samples: what one loader
        reading the whole source would report; and the part each kept sample came from."""
        if any(p.order is None for p in parts):
            raise ConfigError(f"source {parts[0].source!r}: merging data-parallel parts needs every part's read order")
        cat = lambda get: np.concatenate([get(p) for p in parts])  # noqa: E731
        order = cat(lambda p: p.order)
        keep = np.argsort(order, kind="stable")[:limit]
        owner = np.concatenate([np.full(len(p), j, np.int64) for j, p in enumerate(parts)])[keep]
        extras = {k: cat(lambda p, k=k: p.extras[k])[keep] for k in parts[0].extras}
        merged = cls(parts[0].source, cat(lambda p: p.index)[keep], cat(lambda p: p.tokens)[keep],
                     cat(lambda p: p.num_images)[keep], cat(lambda p: p.patches)[keep],
                     cat(lambda p: p.patches_sq)[keep], extras, order[keep])
        return merged, owner

    @classmethod
    def from_samples(cls, source: str, samples: Iterable[Mapping]) -> "BufferMeta":
        """Build from per-sample dicts with ``index``, ``tokens`` and optional ``image_patches`` (a list)."""
        rows = list(samples)
        patches = [list(r.get("image_patches", ())) for r in rows]
        return cls(
            source,
            index=[r["index"] for r in rows],
            tokens=[r["tokens"] for r in rows],
            num_images=[len(p) for p in patches],
            patches=[sum(p) for p in patches],
            patches_sq=[float(sum(x * x for x in p)) for p in patches],
        )


_COLUMNS = ("source_id", "index", "tokens", "num_images", "patches", "patches_sq")


@dataclass(frozen=True)
class Records:
    """A table of sample metadata from several sources; rows keep the order they were given."""

    sources: tuple[str, ...]
    source_id: np.ndarray
    index: np.ndarray
    tokens: np.ndarray
    num_images: np.ndarray
    patches: np.ndarray
    patches_sq: np.ndarray
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def from_buffers(cls, buffers: Sequence[BufferMeta]) -> "Records":
        names = tuple(b.source for b in buffers)
        if len(set(names)) != len(names):
            raise ConfigError(f"two buffers report the same source name: {names}")
        extra_keys = set().union(*(b.extras.keys() for b in buffers)) if buffers else set()
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
        extras = {}
        for k in sorted(extra_keys):
            missing = [b.source for b in buffers if k not in b.extras]
            if missing:
                raise ConfigError(f"extra column {k!r} is missing from sources {missing}; report it everywhere or nowhere")
            extras[k] = np.concatenate([b.extras[k] for b in buffers])
        return cls(
            sources=names,
            source_id=cat([np.full(len(b), i) for i, b in enumerate(buffers)], np.int32),
            index=cat([b.index for b in buffers], np.int64),
            tokens=cat([b.tokens for b in buffers], np.int64),
            num_images=cat([b.num_images for b in buffers], np.int64),
            patches=cat([b.patches for b in buffers], np.int64),
            patches_sq=cat([b.patches_sq for b in buffers], np.float64),
            extras=extras,
        )

    def __len__(self) -> int:
        return len(self.index)

    def take(self, rows) -> "Records":
        """The sub-table of ``rows`` (an index array or boolean mask), in that order."""
        cols = {c: getattr(self, c)[rows] for c in _COLUMNS}
        return Records(self.sources, extras={k: v[rows] for k, v in self.extras.items()}, **cols)

    def key(self, row: int) -> SampleKey:
        return SampleKey(self.sources[self.source_id[row]], int(self.index[row]))

    def keys(self, rows: Iterable[int] | None = None) -> list[SampleKey]:
        rows = range(len(self)) if rows is None else rows
        return [self.key(r) for r in rows]

    def source_counts(self) -> dict[str, int]:
        counts = np.bincount(self.source_id, minlength=len(self.sources))
        return {s: int(c) for s, c in zip(self.sources, counts)}

    def column(self, name: str) -> np.ndarray:
        """A named column: a built-in one or an extra."""
        if name in _COLUMNS:
            return getattr(self, name)
        if name in self.extras:
            return self.extras[name]
        raise ConfigError(f"no metadata column {name!r}; have {list(_COLUMNS) + sorted(self.extras)}")
