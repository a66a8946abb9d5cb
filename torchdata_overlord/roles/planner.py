"""Planner: runs the user's strategy on the Source Loaders' buffer metadata, once per step.

It owns the step counter, the seed and every primitive's state (mixing carry, dynamic schedule
weights), so a plan is a pure function of (seed, step, buffer metadata, that state) and a
``state_dict`` round trip reproduces the next plans exactly.
"""

from __future__ import annotations

import copy
import numbers
from typing import Callable, Mapping, Sequence

from ..errors import ConfigError
from ..plane.dgraph import DGraph, PlanContext
from ..plane.place_tree import ClientPlaceTree
from ..plane.primitives.mix import _owned_by
from ..plane.plan import Plan
from ..plane.records import BufferMeta

__all__ = ["Planner", "check_seed"]


def check_seed(seed) -> int:
    """A plan's seed seeds numpy's generators: an integer >= 0 (returned as an int)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
    return int(seed)


class Planner:
    """``Planner(strategy, mesh, global_batch, seed)``; ``plan(buffers)`` gives the next step's Plan.

    ``strategy(graph) -> Plan | DGraph`` is the declarative data plane (a DGraph is finalised
    with ``plan()``). ``summary_buffer(meta) -> meta`` is the low-level hook that rewrites each
    source's reported metadata before planning (drop, annotate or re-estimate fields).
    """

    STEP, SEED, PRIMITIVES, MESH, BATCH = "step", "seed", "primitives", "mesh", "global_batch"
    BATCHES = "batches"      # [[first step, global batch], ...] when an elastic resume changed the batch

    def __init__(self, strategy: Callable[[DGraph], "Plan | DGraph"], mesh: ClientPlaceTree, global_batch: int,
                 seed: int = 0, summary_buffer: Callable[[BufferMeta], BufferMeta] | None = None):
        if not callable(strategy):
            raise ConfigError(f"strategy must be a callable of a DGraph, got {strategy!r}")
        if not isinstance(mesh, ClientPlaceTree):
            raise ConfigError(f"mesh must be a ClientPlaceTree, got {type(mesh).__name__}")
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ConfigError(f"global_batch must be an integer >= 1, got {global_batch!r}")
        self.strategy, self.mesh, self.global_batch, self.seed = strategy, mesh, global_batch, check_seed(seed)
        self.summary_buffer = summary_buffer
        self.step = 0
        self.batches = [[0, global_batch]]
        self._state: dict = {}
        self._restoring: set = set()
        self._live: dict = {}

    def plan(self, buffers: Sequence[BufferMeta] | Mapping[str, BufferMeta],
             feedback: Sequence[Mapping[str, float]] = ()) -> Plan:
        """Plan the current step from the buffers' metadata and advance the step counter.

        ``feedback`` (e.g. per-source loss) is given to the strategy's dynamic schedules
        (``Schedule.update``) before they weigh this step, so it is an input of the plan.
        """
        bufs = list(buffers.values()) if isinstance(buffers, Mapping) else list(buffers)
        if self.summary_buffer is not None:
            bufs = [self.summary_buffer(b) for b in bufs]
        # primitives write into a copy: a strategy that raises leaves the planner unchanged
        ctx = PlanContext(self.mesh, self.step, self.seed, self.global_batch, copy.deepcopy(self._state),
                          set(self._restoring), {}, [dict(f) for f in feedback], planner=self)
        out = self.strategy(DGraph.from_buffers(bufs, ctx))
        if ctx.feedback and not ctx.feedback_used:
            raise ConfigError(f"step {self.step}: feedback was given but no schedule of the strategy takes it; "
                              f"mix with a dynamic schedule such as ol.Dynamic")
        plan = out.plan() if isinstance(out, DGraph) else out
        if not isinstance(plan, Plan):
            raise ConfigError(f"strategy must return a Plan or a DGraph, got {type(out).__name__}")
        self._state, self._restoring = ctx.state, ctx.restoring
        self._live.update(ctx.live)
        self.step += 1
        return plan

    def state_dict(self) -> dict:
        """Plain-typed state: step, seed, and each primitive's state (live schedules read now, unless another
        Planner of this process has moved the shared schedule object since: then as this Planner left it)."""
        prim = copy.deepcopy(self._state)
        for key, sched in self._live.items():
            if _owned_by(sched, self):
                prim.setdefault(key, {})["schedule"] = sched.state_dict()
        out = {self.STEP: self.step, self.SEED: self.seed, self.BATCH: self.global_batch,
               self.MESH: self.mesh.to_dict(), self.PRIMITIVES: prim}
        if len(self.batches) > 1:
            out[self.BATCHES] = copy.deepcopy(self.batches)
        return out

    def load_state_dict(self, state: Mapping) -> None:
        diffs = []
        if state[self.SEED] != self.seed:
            diffs.append(f"seed {state[self.SEED]} vs {self.seed}")
        if state[self.BATCH] != self.global_batch:
            diffs.append(f"global_batch {state[self.BATCH]} vs {self.global_batch}")
        if state[self.MESH] != self.mesh.to_dict():
            diffs.append(f"mesh {state[self.MESH]} vs {self.mesh.to_dict()}")
        if diffs:
            raise ConfigError("planner state comes from another configuration: " + "; ".join(diffs))
        self.step = int(state[self.STEP])
        self.batches = copy.deepcopy(state.get(self.BATCHES) or [[0, self.global_batch]])
        self._state = copy.deepcopy(dict(state[self.PRIMITIVES]))
        self._restoring = set(self._state)
