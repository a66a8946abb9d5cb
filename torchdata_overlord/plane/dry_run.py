"""A strategy planned once on stand-in metadata before any role starts, so that its argument errors
(an unknown source or axis, a bad ``max_tokens``, a global batch smaller than the data-parallel
ranks...) are raised where the loader is made, not at the first step in a worker process.

Every source is given ``global_batch`` one-token samples without images: enough for any mixture.
Only :class:`~torchdata_overlord.errors.ConfigError` counts (a cost asking ``records.column()`` for a
column no source reports is one); a strategy that fails otherwise for want of real data is left to
its first real step. The probe context has no Planner, so no schedule's running state moves (see
:mod:`.primitives.mix`). A source the strategy's first schedule names at none of a range of steps
(0-15, then powers of two to 2**24) is warned about: its loader would read for nothing.
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

__all__ = ["check_strategy"]


def check_strategy(strategy: Callable, mesh: ClientPlaceTree, sources: Sequence[str], global_batch: int,
                   seed: int) -> bool | None:
    """Plan step 0 of ``strategy`` on stand-in buffers; re-raise its :class:`ConfigError`, ignore the rest.
    Returns whether one of its schedules takes trainer feedback (``update``: :class:`Dynamic`), None when the
    stand-ins could not tell."""
    n = max(int(global_batch), 1)
    buffers = [BufferMeta(name, np.arange(n) + i * n, np.ones(n, np.int64)) for i, name in enumerate(sources)]
    ctx = PlanContext(mesh, 0, seed, global_batch)
    try:
        out = strategy(DGraph.from_buffers(buffers, ctx))
        if isinstance(out, DGraph):
            out = out.plan()
        if not isinstance(out, Plan):
            raise ConfigError(f"strategy must return a Plan or a DGraph, got {type(out).__name__}")
        if "mix" not in ctx.state:
            raise ConfigError(f"it never calls mix(), so a step would take every buffered sample (a buffer's worth "
                              f"of each source), not global_batch={global_batch}; start it with "
                              f"g.mix({{source: weight, ...}}) (one source: g.mix({{{sources[0]!r}: 1.0}}))")
        if out.axis == "dp" and global_batch < len(out.buckets):
            # a mix takes global_batch samples a step, whatever the data, and each goes to one DP bucket
            raise ConfigError(f"global_batch {global_batch} is smaller than the {len(out.buckets)} data-parallel ranks "
                              f"of distribute('DP'), so {len(out.buckets) - global_batch} of them would get no "
                              f"sample at any step (padding only, a loss over no token); give global_batch >= "
                              f"{len(out.buckets)}")
    except ConfigError as e:
        raise ConfigError(f"the strategy, planned once before the loader starts: {e}") from e
    except Exception:  # noqa: BLE001 - it needs real data: its first step will say what is wrong
        return None
    named = _named(strategy, mesh, sources, global_batch, seed)
    unmixed = [name for name in sources if named is not None and name not in named]
    if unmixed:
        warnings.warn(f"sources {unmixed} are not in the strategy's mixture (its first schedule names "
                      f"{sorted(named)} at steps 0-15 and at every power of two to 2**24): they are never sampled, "
                      f"and their loaders read for nothing; give them a weight, or leave them out of the loader's "
                      f"sources", stacklevel=3)
    return any(hasattr(s, "update") for s in ctx.live.values())


_PROBED_STEPS = (*range(16), *(2 ** k for k in range(4, 25)))


def _named(strategy: Callable, mesh: ClientPlaceTree, sources: Sequence[str], global_batch: int,
           seed: int) -> set[str] | None:
    """Every source the strategy's first schedule names (with any weight) at the probed steps; None when that
    cannot be told (no mix, or a strategy or schedule that fails on the probe)."""
    named: set[str] = set()
    for step in _PROBED_STEPS:
        try:
            schedule = mixture_schedule(strategy, mesh, sources, global_batch, seed, step)
            if schedule is None:
                return None
            named |= set(schedule.sources()) | set(schedule.weights(step))
        except Exception:  # noqa: BLE001 - a schedule that cannot say: no warning
            return None
    return named
