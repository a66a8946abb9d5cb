"""A strategy planned once on stand-in metadata before any role starts, so that its argument errors
(an unknown source or axis, a bad ``max_tokens``, a global batch smaller than the data-parallel
ranks...) are raised where the loader is made, not at the first step in a worker process.

Every source is given ``global_batch`` one-token samples without images: enough for any mixture.
Only :class:`~torchdata_overlord.errors.ConfigError` counts; a strategy that fails for want of real
data (a cost reading a field the stand-ins lack) is left to its first real step. The probe context
has no Planner, so no schedule's running state moves (see :mod:`.primitives.mix`). A source the
strategy's schedule never names is warned about: its loader would read for nothing.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import numpy as np

from ..errors import ConfigError
from .dgraph import DGraph, PlanContext
from .mixture_probe import mixture_schedule
from .place_tree import ClientPlaceTree
from .plan import Plan
from .records import BufferMeta
from .schedules import FromCallable

__all__ = ["check_strategy"]


def check_strategy(strategy: Callable, mesh: ClientPlaceTree, sources: Sequence[str], global_batch: int,
                   seed: int) -> None:
    """Plan step 0 of ``strategy`` on stand-in buffers; re-raise its :class:`ConfigError`, ignore the rest."""
    n = max(int(global_batch), 1)
    buffers = [BufferMeta(name, np.arange(n) + i * n, np.ones(n, np.int64)) for i, name in enumerate(sources)]
    ctx = PlanContext(mesh, 0, seed, global_batch)
    try:
        out = strategy(DGraph.from_buffers(buffers, ctx))
        if isinstance(out, DGraph):
            out = out.plan()
        if not isinstance(out, Plan):
            raise ConfigError(f"strategy must return a Plan or a DGraph, got {type(out).__name__}")
        if out.axis == "dp" and len(out.records) < len(out.buckets):
            # a step plans this many samples whatever the data (its mix), and each goes to one DP bucket
            raise ConfigError(f"global_batch {global_batch} is smaller than the {len(out.buckets)} data-parallel ranks "
                              f"of distribute('DP'), so {len(out.buckets) - len(out.records)} of them would get no "
                              f"sample at any step (padding only, a loss over no token); give global_batch >= "
                              f"{len(out.buckets)}")
    except ConfigError as e:
        raise ConfigError(f"the strategy, planned once before the loader starts: {e}") from e
    except Exception:  # noqa: BLE001 - it needs real data: its first step will say what is wrong
        return
    schedule = mixture_schedule(strategy, mesh, sources, global_batch, seed)
    if schedule is None or isinstance(schedule, FromCallable):     # (a callable's names are known step by step)
        return
    unmixed = [name for name in sources if name not in schedule.sources()]
    if unmixed:
        warnings.warn(f"sources {unmixed} are not in the strategy's mixture ({type(schedule).__name__} of "
                      f"{sorted(schedule.sources())}): they are never sampled, and their loaders read for nothing; "
                      f"give them a weight, or leave them out of the loader's sources", stacklevel=3)
