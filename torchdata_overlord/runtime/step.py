"""One step of every runtime: loaders' metadata -> feedback -> plan -> routes (paper Fig. 5).

The Planner actor calls :func:`plan_step` and :func:`route` for each step whatever the transport
(``runtime="local"`` runs the same actors in this process), so both runtimes plan and route by the
same code. The errors here are the step protocol's own: how a stream ends, and how a call of an
older generation (before a reset or a rewind) is refused instead of mixing two streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import BufferShortageError, OverlordError
from ..plane.plan import Plan
from ..roles.constructor import bucket_inputs, receives_nothing
from ..roles.planner import Planner
from .feedback import FeedbackLog

__all__ = ["SourceExhausted", "JobReset", "JobClosed", "JobState", "Routes", "plan_step", "route"]


class SourceExhausted(OverlordError, StopIteration):
    """A source configured with a finite number of epochs ran out: the stream ends here."""


class JobReset(OverlordError, RuntimeError):
    """The job was reset (a client loaded a state, or a role was replaced) after this call's generation began."""


class JobClosed(OverlordError, RuntimeError):
    """The leader closed the job: requests still waiting are answered with this."""


def plan_step(planner: Planner, metas: list, feedback: FeedbackLog, exhausted: Callable[[], list[str]]) -> Plan:
    """Plan the planner's next step from the loaders' metadata and the feedback due for it (then
    dropped from ``feedback``). A buffer shortage with a finished source (``exhausted()`` names the
    sources that ran out of epochs) ends the stream with :class:`SourceExhausted`."""
    step = planner.step
    try:
        plan = planner.plan(metas, feedback=feedback.due(step))
    except BufferShortageError as e:
        done = exhausted()
        if done:
            short = getattr(e, "source", None)
            left = f"; {short!r} has {e.have} samples left, the step needs {e.want}" if short in done else ""
            raise SourceExhausted(f"step {step}: source(s) {done} ran out (finished their configured epochs, or "
                                  f"their node ended); the stream ends here{left}") from e
        raise
    feedback.drop_through(step)
    return plan


@dataclass(frozen=True)
class Routes:
    """Where one step's samples go: bucket ``b`` is built by constructor ``b % n``."""

    buckets: dict[int, list[int]]                  # constructor -> the buckets it builds
    sampled: dict[str, list[int]]                  # source -> every index the step takes (dropped ones too)
    to: dict[str, dict[int, list[int]]]            # source -> constructor -> the indices it sends there
    routing: list[int]                             # rank -> its constructor, -1: it receives nothing
    empty: dict[int, object]                       # rank that receives nothing -> what it gets


def route(plan: Plan, constructors: int, sources: list[str]) -> Routes:
    n = int(constructors)
    buckets = {c: [b for b in range(len(plan.buckets)) if b % n == c] for c in range(n)}
    to: dict[str, dict[int, list[int]]] = {s: {} for s in sources}
    for c, bs in buckets.items():
        need: dict[str, set] = {}
        for b in bs:
            for src, idx in bucket_inputs(plan, b).items():
                need.setdefault(src, set()).update(idx)
        for src, idx in need.items():
            to[src][c] = sorted(idx)
    recs = plan.records
    sampled = {s: [] for s in sources}
    sampled.update({name: np.asarray(recs.index[recs.source_id == sid]).tolist()
                    for sid, name in enumerate(recs.sources)})
    routing, empty = [], {}
    for r in range(plan.mesh.world_size):
        nothing, value = receives_nothing(plan, r)
        routing.append(-1 if nothing else plan.bucket_of(r) % n)
        if nothing:
            empty[r] = value
    return Routes(buckets, sampled, to, routing, empty)


class JobState:
    """The keys of a job's state (what the loader's ``state_dict`` carries as its ``job``): the
    Planner's state, each Source Loader's state, and the trainer feedback not yet planned."""

    PLANNER, LOADERS, FEEDBACK = "planner", "loaders", "feedback"

    @classmethod
    def make(cls, planner: dict, loaders: dict, feedback: FeedbackLog) -> dict:
        return {cls.PLANNER: planner, cls.LOADERS: dict(loaders), cls.FEEDBACK: feedback.state()}

    @classmethod
    def step(cls, state: dict) -> int:
        """The first step not yet planned in ``state``."""
        return int(state[cls.PLANNER][Planner.STEP])
