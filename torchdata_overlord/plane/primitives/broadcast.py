"""``broadcast_at(dim)``: the trainer broadcasts along ``dim``, so its ranks > 0 fetch nothing."""

from __future__ import annotations

from ...errors import ConfigError


class BroadcastAt:
    def __init__(self, dim: str):
        self.dim = str(dim).lower()

    def apply(self, g):
        tree = g.layout.tree if g.layout else g.mesh
        if self.dim not in tree.sizes:
            raise ConfigError(f"broadcast_at({self.dim!r}): unknown axis; this mesh has {list(tree.order)}")
        if g.layout and self.dim in tree.bucket_axes(g.layout.axis):
            raise ConfigError(f"broadcast_at({self.dim!r}) would starve buckets: {self.dim!r} splits the data "
                              f"when distributing along {g.layout.axis!r}")
        return g.evolve(f"broadcast_at({self.dim!r}): {self.dim} > 0 fetch nothing",
                        broadcast=tuple(dict.fromkeys(g.broadcast + (self.dim,))))
