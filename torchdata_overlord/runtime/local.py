"""The embedded runtime: the same role actors as the rpc runtime, run in this process.

``LocalJob`` starts the Planner, a Source Loader per source and one Data Constructor on an
:class:`~.transport.InProcessTransport` (each actor a thread) and is their only client, so every step
takes the same hops, by the same code, as with worker processes: local and rpc streams are equal by
construction. Plans are a pure function of the state, so every trainer rank running its own
LocalJob plans the same step without talking to the others; a constructor builds only the buckets
its client asks for, so each rank builds only its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Callable, Iterable, Mapping

from ..errors import OverlordError
from ..plane.place_tree import ClientPlaceTree
from .client import Job, StepResult
from .job_config import RoleConfig, start_roles
from .refs import ActorRef
from .step import SourceExhausted
from .transport import CallTimeout
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
    :meth:`close` is bounded (see there), also when a role is stuck in user code.
    """

    CLOSE_WAIT = 5.0         # seconds close() waits at most for the roles (then the actor threads get 5 s to stop)

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

    def close(self, interrupted: bool = False) -> None:
        """Close every role and stop its thread, within ``min(timeout, 5)`` s (about a second more for the
        stats snapshot) plus 5 s for the threads to stop (after a Ctrl-C, ``interrupted``: the 5 s only,
        nothing graceful). A role still in a call then
        (a transform or read in user code that does not return, which Python cannot stop) is named in a
        warning and left running as a daemon thread: it does not keep the process from exiting, and ends
        (closing its role) once the call returns."""
        if not self._closed:
            self._close_by = time.monotonic() + (0.0 if interrupted else min(self.timeout, self.CLOSE_WAIT))
        super().close(interrupted)

    def _close_roles(self) -> None:
        """Close every actor of the transport (it knows them all: replacements and resharded parts too)
        without asking the Planner which, as a job of several processes does: the Planner may be waiting on
        a stuck role. Each close runs after the call its actor runs; the transport's stop names the actors
        still in one."""
        futs = []
        for name in self.transport.actor_names():
            try:
                futs.append(ActorRef(self.transport, name, self.timeout).close())
            except Exception:        # noqa: BLE001 - best effort: stop() follows
                pass
        cf.wait(futs, timeout=self._close_wait(self.timeout))

    def _planner_lost(self, err: BaseException) -> None:
        """A call to the Planner timed out: in this process it is not frozen, it is waiting for a role stuck in user
        code; say so (the rpc runtime's advice, spare processes, would not help)."""
        if not isinstance(err, CallTimeout):
            super()._planner_lost(err)
            return
        raise OverlordError(f"the Planner did not answer within timeout={self.timeout:g} s ({err}): it is waiting for "
                            f"a role stuck in user code (a source's transform or read that does not return, or takes "
                            f"longer than the timeout: raise OverlordLoader(timeout=...) for very slow sources)"
                            ) from err

    def stuck_loaders(self, longer_than: float) -> dict[str, tuple[str, float]]:
        """The Source Loaders in one call for over ``longer_than`` seconds: loader actor -> (method, seconds); what a
        timed-out ``next()`` names (a loader waits on nothing but its source and transform)."""
        return {a: b for a, b in self.transport.busy().items() if a.startswith("loader:") and b[1] > longer_than}

    def actor(self, name: str):
        """The object behind actor ``name`` (``"planner"``, ``"loader:<source>"``, ``"constructor:0"``):
        for instrumenting and debugging in this process only."""
        return self.transport.actor(name)
