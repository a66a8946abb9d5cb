"""``distribute(axis, group_size)``: the buckets of ranks that samples are split across."""

from __future__ import annotations

from ...errors import ConfigError
from ..dgraph import Layout


class Distribute:
    """``"DP"``: one bucket per data-parallel index; ``"CP"``: one per (dp, cp) pair, DP x CP ranks
    as uniform consumers (hybrid data parallelism); ``"WORLD"``: one per rank (e.g. a VLM encoder
    in world-wide DP). With ``group_size``, buckets are balanced in groups of that many: samples
    go to groups first, then are balanced inside each group."""

    def __init__(self, axis: str, group_size: int | None = None, module: str | None = None):
        self.axis, self.group_size, self.module = axis, group_size, module

    def apply(self, g):
        tree = g.mesh.module(self.module) if self.module else g.mesh
        axis = str(self.axis).lower()
        if axis in ("tp", "pp"):
            raise ConfigError(f"distribute({self.axis!r}): the {'tensor' if axis == 'tp' else 'pipeline'}-parallel "
                              f"ranks of a data-parallel group take the same samples, so they cannot be buckets; "
                              f"distribute along 'DP', 'CP' (DP x CP ranks as uniform consumers) or 'WORLD'")
        buckets = tree.buckets(axis)
        groups = None
        if self.group_size is not None:
            if not isinstance(self.group_size, int) or self.group_size < 1:
                raise ConfigError(f"group_size must be an integer >= 1, got {self.group_size!r}")
            groups = [list(range(i, min(i + self.group_size, len(buckets))))
                      for i in range(0, len(buckets), self.group_size)]
        note = f"distribute({self.axis!r}): {len(buckets)} buckets of {len(buckets[0])} ranks" + (
            f" in {len(groups)} groups" if groups else "")
        return g.evolve(note, layout=Layout(axis, tree, buckets, groups), placement=None)
