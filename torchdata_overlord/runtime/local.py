"""The embedded runtime: the same role actors as the rpc runtime, run in this process.

``LocalJob`` starts the Planner, a Source Loader per source and one Data Constructor on an
:class:`~.transport.InProcessTransport` (each actor a thread) and is their only client, so every step
takes the same hops, by the same code, as with worker processes: local and rpc streams are equal by
construction. Plans are a pure function of the state, so every trainer rank running its own
LocalJob plans the same step without talking to the others; a constructor builds only the buckets
its client asks for, so each rank builds only its own.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from ..plane.place_tree import ClientPlaceTree
from .client import Job, StepResult
from .job_config import RoleConfig, start_roles
from .step import SourceExhausted
from .inprocess import InProcessTransport

__all__ = ["LocalJob", "SourceExhausted", "StepResult"]


class LocalJob(Job):
    """All roles of one job in this process (see the module docstring).

    ``buffer_size`` (default: the global batch, enough for any mixture) and ``workers`` may be an
    int for every source or a ``{source: int}`` dict, so a slow image source gets more workers.
    ``timeout`` bounds each call between roles (a first buffer fill included). ``actors``: data-parallel
    Source Loaders per source (see :mod:`~torchdata_overlord.roles.loader_parts`; the stream is the same);
    ``placement``: a :class:`~torchdata_overlord.scaling.Placement` whose actors and workers to use;
    ``autoscale``: resize sources' loader actors as the mixture moves (only with a profiled placement).
    """

    def __init__(self, sources: Iterable, strategy: Callable, mesh: ClientPlaceTree, global_batch: int,
                 seq_len: int | None, seed: int = 0, buffer_size: int | Mapping[str, int] | None = None,
                 workers: int | Mapping[str, int] | None = None, image_token_id: int | None = None, pad_id: int = 0,
                 ignore_index: int = -100, *, constructors: int | None = None, timeout: float = 300.0,
                 actors: int | Mapping[str, int] = 1, placement=None, autoscale=True):
        if constructors is None:            # one, or as many as a given placement places
            constructors = len(getattr(placement, "constructors", ())) or 1
        cfg = RoleConfig(list(sources), strategy, mesh, global_batch, seq_len, seed, buffer_size, workers,
                         image_token_id, pad_id, ignore_index, constructors, 1, timeout, in_process=True, actors=actors,
                         plan=placement, autoscale=autoscale)
        self.placement = placement
        super().__init__(cfg, timeout=timeout, recovery_timeout=timeout, n_workers=1, spares=0)
        self.transport = InProcessTransport()
        try:
            start_roles(self.transport, cfg)
            self._connected()
        except BaseException:
            self.close()
            raise

    def actor(self, name: str):
        """The object behind actor ``name`` (``"planner"``, ``"loader:<source>"``, ``"constructor:0"``):
        for instrumenting and debugging in this process only."""
        return self.transport.actor(name)
