"""What a strategy mixes, found without data: run it on an empty graph up to its first ``mix()``.

A loader's checkpoint records this mixture (the schedule's :meth:`~.schedules.Schedule.spec`), so a
resume under another mixture, which is another sample stream, is refused unless asked for. The
probe stops the strategy at its first primitive: no balancer, cost model or later step runs.
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

from .dgraph import DGraph, PlanContext
from .place_tree import ClientPlaceTree
from .records import BufferMeta
from .schedules import as_schedule

__all__ = ["mixture_spec", "mixture_schedule"]

UNKNOWN = "null"         # the strategy has no mix(), or needs data before it


class _Reached(Exception):
    """The strategy reached a primitive; ``schedule`` is set when it was ``mix``."""

    def __init__(self, schedule=None):
        super().__init__()
        self.schedule = schedule


class _Probe(DGraph):
    def mix(self, schedule) -> DGraph:
        raise _Reached(as_schedule(schedule))

    def _stop(self, *args, **kwargs) -> DGraph:
        raise _Reached()

    distribute = cost = balance = broadcast_at = plan = plan_raw = _stop


def mixture_spec(strategy: Callable, mesh: ClientPlaceTree, sources: Sequence[str], global_batch: int,
                 seed: int) -> str:
    """The spec of the strategy's first mixing schedule at step 0 as canonical JSON, or ``"null"``."""
    schedule = mixture_schedule(strategy, mesh, sources, global_batch, seed)
    return UNKNOWN if schedule is None else json.dumps(schedule.spec(), sort_keys=True)


def mixture_schedule(strategy: Callable, mesh: ClientPlaceTree, sources: Sequence[str], global_batch: int,
                     seed: int, step: int = 0):
    """The strategy's first mixing schedule (a :class:`~.schedules.Schedule`) at ``step``, or None when it has
    no ``mix()`` or needs data before it."""
    ctx = PlanContext(mesh, step, seed, global_batch)
    graph = _Probe.from_buffers([BufferMeta(name, [], []) for name in sources], ctx)
    try:
        strategy(graph)
    except _Reached as reached:
        return reached.schedule
    except Exception:  # noqa: BLE001 (a strategy that needs data before mixing: its mixture is unknown)
        pass
    return None
