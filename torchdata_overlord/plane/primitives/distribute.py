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
        buckets = tree.buckets(axis)
        batch = g.ctx.global_batch
        if axis == "dp" and self.module is None and batch is not None and batch < len(buckets):
            # each sample goes to one data-parallel bucket: the rest would get padding only, at every step
            raise ConfigError(f"distribute('DP'): global_batch {batch} is smaller than the {len(buckets)} data-parallel "
                              f"ranks, so {len(buckets) - batch} of them would get no sample at any step (padding "
                              f"only, a loss over no token); give global_batch >= {len(buckets)}")
        groups = None
        if self.group_size is not None:
            if not isinstance(self.group_size, int) or self.group_size < 1:
                raise ConfigError(f"group_size must be an integer >= 1, got {self.group_size!r}")
            groups = [list(range(i, min(i + self.group_size, len(buckets))))
                      for i in range(0, len(buckets), self.group_size)]
        note = f"distribute({self.axis!r}): {len(buckets)} buckets of {len(buckets[0])} ranks" + (
            f" in {len(groups)} groups" if groups else "")
        return g.evolve(note, layout=Layout(axis, tree, buckets, groups), placement=None)
