"""Mixture-driven scaling (paper 5.2): the Planner sees every step's mixture, so it can move loader
actors to the sources the mixture is moving to.

After each planned step the Planner tells the :class:`AutoScaler` how many samples the step took from
each source. Every ``interval`` steps the scaler re-runs the offline partition
(:func:`~.partition.auto_partition`, same profiles and budget as the job's placement) with each source's
moving-average share over the last ``window`` steps as its weight. A source whose actor count there
differs from its current one for ``patience`` consecutive intervals is resized: the Planner starts
the new data-parallel actors, moves the source's state into them and retires the old ones once they
caught up, while the old ones serve (see :mod:`~torchdata_overlord.runtime.reshard`; ``current`` counts a
source being resharded at its new size). The stream does not change:
merged parts are exactly one loader (:mod:`~torchdata_overlord.roles.loader_parts`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Mapping

from ..errors import ConfigError
from .partition import auto_partition
from .placement import Placement
from .profile import SourceProfile

__all__ = ["AutoScaler"]


@dataclass
class AutoScaler:
    """``AutoScaler(interval=10, window=20, patience=2, max_actors=None)``; :meth:`bind` gives it the
    job's placement (its profiles and budget). ``max_actors``: per source, on top of the partition's
    own limits (row groups, global batch, ``w_src``/``w_actor``)."""

    interval: int = 10
    window: int = 20
    patience: int = 2
    max_actors: int | None = None
    placement: Placement | None = None
    history: collections.deque = field(default_factory=collections.deque, repr=False)
    pending: dict = field(default_factory=dict, repr=False)        # source -> (wanted actors, intervals seen)
    decisions: list = field(default_factory=list, repr=False)      # (step, source, from, to, share)
    latest: Placement | None = field(default=None, repr=False)     # the last partition run

    def __post_init__(self) -> None:
        for name in ("interval", "window", "patience"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"AutoScaler {name} must be an integer >= 1, got {v!r}")
        if self.max_actors is not None and (isinstance(self.max_actors, bool) or not isinstance(self.max_actors, int)
                                            or self.max_actors < 1):
            raise ConfigError(f"AutoScaler max_actors must be None or an integer >= 1, got {self.max_actors!r}")
        self.history = collections.deque(maxlen=self.window)

    def bind(self, placement: Placement | None) -> "AutoScaler":
        """A scaler for this job: ``placement`` must carry its profiles (``placement="auto"``'s do)."""
        return AutoScaler(self.interval, self.window, self.patience, self.max_actors,
                          placement if placement is not None and placement.profiles else None)

    @property
    def active(self) -> bool:
        return self.placement is not None

    def observe(self, step: int, counts: Mapping[str, int], current: Mapping[str, int]) -> dict[str, tuple[int, int]]:
        """Step ``step`` took ``counts`` samples per source; ``current``: each source's actors now.
        Returns the sources to resize now -> (actors, workers per actor) (mostly empty)."""
        if not self.active:
            return {}
        self.history.append(dict(counts))
        if (step + 1) % self.interval or len(self.history) < min(self.window, self.interval):
            return {}
        total = {s: sum(h.get(s, 0) for h in self.history) for s in current}
        n = sum(total.values())
        if n == 0:
            return {}
        wanted = self._partition({s: total[s] / n for s in current})
        out = {}
        for s, k in current.items():
            want, workers = wanted.get(s, (k, 0))
            want = min(want, self.max_actors or want)
            if want == k:
                self.pending.pop(s, None)
                continue
            seen = self.pending.get(s, (want, 0))
            seen = (want, seen[1] + 1 if seen[0] == want else 1)
            self.pending[s] = seen
            if seen[1] >= self.patience:
                out[s] = (want, workers)
                self.pending.pop(s)
                self.decisions.append({"step": int(step), "source": s, "from": int(k), "to": int(want),
                                       "share": round(total[s] / n, 4)})
        return out

    def _partition(self, weights: Mapping[str, float]) -> dict[str, tuple[int, int]]:
        p, b = self.placement, self.placement.budget
        profiles = {n: SourceProfile.from_dict(dict(d)) for n, d in p.profiles.items()}
        again = auto_partition(profiles, weights, cores=b["cores"], memory_bytes=b["memory_bytes"],
                               constructors=len(p.constructors), global_batch=b["global_batch"],
                               buffer_size=b.get("buffer_size"), w_src=b.get("w_src", 8), w_actor=b.get("w_actor", 4),
                               cluster_size=b.get("cluster_size", 4), max_processes=b.get("max_processes"),
                               thread_cores=b.get("thread_cores"))
        self.latest = again
        return {n: (sp.actors, sp.workers) for n, sp in again.sources.items()}

    def cores(self) -> dict:
        """Estimated cores by the last partition (the bound placement's before one ran): the Planner's, one
        constructor's and each source's loaders together; a reshard places new actors by them."""
        p = self.latest or self.placement
        return {"planner": p.budget.get("planner_cores", 0.0), "constructor": p.budget.get("constructor_cores", 0.0),
                "sources": {n: sp.cpu * sp.actors for n, sp in p.sources.items()}}

    def stats(self) -> dict:
        return {"active": self.active, "interval": self.interval, "window": self.window, "patience": self.patience,
                "decisions": list(self.decisions)}
