"""ClientPlaceTree: the trainer's device mesh as a tree (paper section 4.1).

The outermost axis is the root; each level splits its parent into ``size`` children, and the
leaves are trainer ranks numbered in row-major order. The tree answers the questions the Planner
and the Data Constructors ask: where a rank sits, which ranks share a group along an axis, and
which ranks form one *bucket* (ranks that consume the same samples) for a distribution axis.
"""

from __future__ import annotations

import functools
import math
from typing import Iterator

import numpy as np

from ..errors import ConfigError

__all__ = ["ClientPlaceTree"]

# Axes along which ranks receive *different* samples, outermost first; every other axis
# (pipeline stages, tensor-parallel ranks, ...) replicates the data of its bucket.
_DATA_AXES = ("dp", "cp")
WORLD = "world"


def _axis_name(axis: str) -> str:
    if not isinstance(axis, str):
        raise ConfigError(f"axis must be a string such as 'DP', 'CP' or 'WORLD', got {axis!r}")
    return axis.lower()


@functools.lru_cache(maxsize=1 << 16)
def _coords(shape: tuple[int, ...], order: tuple[str, ...], rank: int) -> tuple[tuple[str, int], ...]:
    """``(axis, coordinate)`` pairs of ``rank`` in a mesh of ``shape``, row-major as np.unravel_index; kept, since
    a plan asks for every rank's several times a step (about 3 us each to compute)."""
    idx = []
    for size in reversed(shape):
        rank, i = divmod(rank, size)
        idx.append(i)
    return tuple(zip(order, reversed(idx)))


class ClientPlaceTree:
    """The trainer mesh as a tree, e.g. ``ClientPlaceTree(pp=2, dp=4, cp=2, tp=2)``.

    ``order`` lists the axes from outermost (root) to innermost (leaves are ranks); extra axes can
    be given as keyword sizes and named in ``order``. ``world_size`` is checked when given.
    A second module with its own parallelism over the same ranks (a VLM encoder in world-wide
    data parallel beside a 4D backbone) is attached with :meth:`attach`.
    """

    def __init__(self, pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1,
                 order: tuple[str, ...] = ("pp", "dp", "cp", "tp"), world_size: int | None = None,
                 name: str = "backbone", **more_axes: int):
        sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp, **more_axes}
        order = tuple(_axis_name(a) for a in order)
        if len(set(order)) != len(order):
            raise ConfigError(f"order {order} names an axis twice")
        unknown = [a for a in order if a not in sizes]
        if unknown:
            raise ConfigError(f"order names axes {unknown} that have no size; pass them as keywords, e.g. ep=2")
        if WORLD in order:
            raise ConfigError("'world' is reserved for distribute('WORLD'); choose another axis name")
        for a in order:
            s = sizes[a]
            if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 1:
                raise ConfigError(f"axis {a!r} has size {s!r}; every axis size must be an integer >= 1")
        left_out = [a for a, s in sizes.items() if a not in order and s != 1]
        if left_out:
            raise ConfigError(f"axes {left_out} have sizes > 1 but are missing from order={order}")
        self.name = name
        self.order = order
        self.sizes = {a: int(sizes[a]) for a in order}
        self._shape = tuple(self.sizes[a] for a in order)
        self.world_size = math.prod(self._shape)
        if world_size is not None and world_size != self.world_size:
            detail = " x ".join(f"{a}={self.sizes[a]}" for a in order)
            raise ConfigError(f"mesh {detail} has {self.world_size} ranks but world_size={world_size}; "
                              f"fix the axis sizes so their product is {world_size}")
        self._modules: dict[str, ClientPlaceTree] = {}

    # -- coordinates ---------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside this mesh of {self.world_size} ranks")
        return int(rank)

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank`` along every axis, e.g. ``{'pp': 0, 'dp': 3, 'cp': 1, 'tp': 0}``."""
        return dict(_coords(self._shape, self.order, self._check_rank(rank)))

    def rank(self, **coords: int) -> int:
        """The rank at ``coords``; omitted axes are 0."""
        coords = {_axis_name(k): v for k, v in coords.items()}
        bad = [a for a in coords if a not in self.sizes]
        if bad:
            raise ConfigError(f"unknown axes {bad}; this mesh has {list(self.order)}")
        for a, v in coords.items():
            if not 0 <= v < self.sizes[a]:
                raise ConfigError(f"coordinate {a}={v} is outside 0..{self.sizes[a] - 1}")
        return int(np.ravel_multi_index(tuple(coords.get(a, 0) for a in self.order), self._shape))

    def axis_size(self, axis: str) -> int:
        axis = _axis_name(axis)
        if axis == WORLD:
            return self.world_size
        return self.sizes[self._known(axis)]

    def _known(self, axis: str) -> str:
        if axis not in self.sizes:
            raise ConfigError(f"unknown axis {axis!r}; this mesh has {list(self.order)} (and 'WORLD')")
        return axis

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks that differ from ``rank`` only along ``axis`` (its communication group), in order."""
        axis = _axis_name(axis)
        if axis == WORLD:
            return list(range(self.world_size))
        self._known(axis)
        c = self.coords(rank)
        return [self.rank(**{**c, axis: i}) for i in range(self.sizes[axis])]

    # -- buckets -------------------------------------------------------------------------------
    def bucket_axes(self, axis: str) -> tuple[str, ...]:
        """Axes whose coordinates tell buckets apart when distributing along ``axis``.

        ``DP``: one bucket per data-parallel index (its pp/cp/tp ranks share the samples);
        ``CP``: one per (dp, cp) pair, so DP x CP ranks are uniform consumers; ``WORLD``: one per
        rank; another axis of the mesh: one per index along it. Data axes are keyed dp before cp
        whatever the mesh order, so bucket ``dp * cp_size + cp`` holds CP rank ``cp`` of DP group
        ``dp`` (a sequence spanning CP ranks sits in consecutive buckets).
        """
        axis = _axis_name(axis)
        if axis == WORLD:
            return self.order
        self._known(axis)
        if axis in _DATA_AXES:
            return tuple(a for a in _DATA_AXES[: _DATA_AXES.index(axis) + 1] if a in self.sizes)
        return (axis,)

    def buckets(self, axis: str, group_size: int | None = None) -> list[tuple[int, ...]]:
        """The ranks of each bucket along ``axis``, buckets ordered by their coordinates.

        With ``group_size`` the ``n`` buckets are merged ``group_size`` at a time into
        ``ceil(n / group_size)`` coarser buckets (the paper's subgroups for very large jobs).
        """
        keys = self.bucket_axes(axis)
        grid = np.indices(self._shape).reshape(len(self._shape), -1)      # coordinates of every rank
        cols = [grid[self.order.index(a)] for a in keys]
        key = np.ravel_multi_index(cols, [self.sizes[a] for a in keys]) if keys else np.zeros(self.world_size, np.int64)
        ranks = np.argsort(key, kind="stable")
        cuts = np.flatnonzero(np.diff(key[ranks])) + 1
        out = [tuple(part.tolist()) for part in np.split(ranks, cuts)]
        if group_size is None:
            return out
        if not isinstance(group_size, int) or group_size < 1:
            raise ConfigError(f"group_size must be an integer >= 1, got {group_size!r}")
        return [tuple(r for b in out[i:i + group_size] for r in b) for i in range(0, len(out), group_size)]

    # -- second module -------------------------------------------------------------------------
    def attach(self, name: str, **sizes) -> "ClientPlaceTree":
        """Attach a module with its own parallelism over the same ranks, e.g. ``attach('encoder', dp=64)``."""
        if name in self._modules or name == self.name:
            raise ConfigError(f"a module named {name!r} is already attached")
        order = sizes.pop("order", None) or tuple(a for a in ("pp", "dp", "cp", "tp") if a in sizes) or ("dp",)
        sub = ClientPlaceTree(order=tuple(order), name=name, **sizes)
        if sub.world_size != self.world_size:
            detail = " x ".join(f"{a}={sub.sizes[a]}" for a in sub.order)
            raise ConfigError(f"module {name!r} has {sub.world_size} ranks ({detail}) but the mesh has "
                              f"{self.world_size}; a second module must cover the same ranks")
        self._modules[name] = sub
        return sub

    def module(self, name: str) -> "ClientPlaceTree":
        if name == self.name:
            return self
        if name not in self._modules:
            raise ConfigError(f"no module {name!r}; attached: {[self.name, *self._modules]}")
        return self._modules[name]

    @property
    def modules(self) -> dict[str, "ClientPlaceTree"]:
        return {self.name: self, **self._modules}

    # -- description ---------------------------------------------------------------------------
    def describe(self) -> str:
        return " x ".join(f"{a}={self.sizes[a]}" for a in self.order)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self.sizes[a]}" for a in self.order)
        return f"ClientPlaceTree({sizes})"

    def __eq__(self, other) -> bool:
        return isinstance(other, ClientPlaceTree) and self.to_dict() == other.to_dict()

    def to_dict(self) -> dict:
        """Plain description (for state dicts and transport)."""
        return {"name": self.name, "order": list(self.order), "sizes": dict(self.sizes),
                "modules": {k: m.to_dict() for k, m in self._modules.items()}}

    def render(self, max_children: int = 4) -> str:
        """A text drawing of the tree, eliding wide levels after ``max_children`` children."""
        lines = [f"{self.name} ({self.describe()}, {self.world_size} ranks)"]

        def walk(depth: int, prefix: tuple[int, ...], indent: str) -> Iterator[str]:
            axis = self.order[depth]
            n = self.sizes[axis]
            shown = list(range(min(n, max_children)))
            for j, i in enumerate(shown):
                last = j == len(shown) - 1 and n <= max_children
                branch = "└─ " if last else "├─ "
                coords = prefix + (i,)
                if depth == len(self.order) - 1:
                    r = int(np.ravel_multi_index(coords, self._shape))
                    yield f"{indent}{branch}{axis}{i} -> rank {r}"
                else:
                    yield f"{indent}{branch}{axis}{i}"
                    yield from walk(depth + 1, coords, indent + ("   " if last else "│  "))
            if n > max_children:
                yield f"{indent}└─ ... {n - max_children} more {axis}"

        lines.extend(walk(0, (), ""))
        return "\n".join(lines)
