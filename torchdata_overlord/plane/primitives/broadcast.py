"""``broadcast_at(dim)``: the trainer broadcasts along ``dim``, so its ranks > 0 fetch nothing."""

from __future__ import annotations

from ...errors import ConfigError
from ..plan import row_cp


def check_broadcast(tree, axis: str, dims: tuple[str, ...]) -> None:
    """Refuse a broadcast along an axis whose ranks receive different data under ``distribute(axis)``: one
    that tells buckets apart, or CP under ``distribute("DP")`` (each CP rank gets its own shard of every row,
    which a broadcast from CP rank 0 cannot give the others)."""
    for dim in dims:
        if dim in tree.bucket_axes(axis):
            raise ConfigError(f"broadcast_at({dim!r}) would starve buckets: {dim!r} splits the data "
                              f"when distributing along {axis!r}")
        if dim == "cp" and row_cp(tree, axis) > 1:
            raise ConfigError(f"broadcast_at('cp') with distribute({axis!r}) on a mesh with cp={row_cp(tree, axis)}: "
                              f"each CP rank receives its own zig-zag shard of every packed row, so a broadcast "
                              f"from CP rank 0 would give the others rank 0's shard and half of every sequence "
                              f"would never be trained on; drop broadcast_at('cp') (every CP rank fetches its shard)")


class BroadcastAt:
    def __init__(self, dim: str):
        self.dim = str(dim).lower()

    def apply(self, g):
        tree = g.layout.tree if g.layout else g.mesh
        if self.dim not in tree.sizes:
            raise ConfigError(f"broadcast_at({self.dim!r}): unknown axis; this mesh has {list(tree.order)}")
        if g.layout:
            check_broadcast(tree, g.layout.axis, (self.dim,))
        return g.evolve(f"broadcast_at({self.dim!r}): {self.dim} > 0 fetch nothing",
                        broadcast=tuple(dict.fromkeys(g.broadcast + (self.dim,))))
