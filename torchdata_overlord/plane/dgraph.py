"""DGraph: one step's samples as metadata, moving through the orchestration primitives (paper 4.1).

A DGraph is built by the Planner from every Source Loader's buffer metadata. Each primitive
returns a new DGraph (the old one is untouched, so a strategy may branch: the same mixed buffer
viewed as text for the backbone and as images for the encoder), and records an edge in the
graph's history, which :meth:`render` shows. ``plan()`` turns the final state into a
:class:`~torchdata_overlord.plane.plan.Plan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from ..errors import ConfigError
from .place_tree import ClientPlaceTree
from .records import BufferMeta, Records

__all__ = ["DGraph", "PlanContext", "MODALITIES"]

MODALITIES = ("text", "image", "all")


@dataclass
class PlanContext:
    """What a step's primitives share: the mesh, the step, the seed, and the Planner's state store.

    ``state`` maps a primitive's key (``"mix"``, ``"mix#1"`` for a second mix...) to its plain
    state; the Planner persists it between steps and in its ``state_dict``. ``restoring`` lists
    keys whose live objects (e.g. a dynamic schedule) must be reset from ``state`` once;
    ``feedback`` is the trainer feedback (e.g. per-source loss) that dynamic schedules take this step.
    """

    mesh: ClientPlaceTree
    step: int = 0
    seed: int = 0
    global_batch: int | None = None
    state: dict = field(default_factory=dict)
    restoring: set = field(default_factory=set)
    live: dict = field(default_factory=dict)
    feedback: list = field(default_factory=list)     # trainer feedback for this step's dynamic schedules
    feedback_used: bool = False
    planner: object = None                           # the Planner planning this step (None: a probe)
    _counts: dict = field(default_factory=dict)

    def key(self, kind: str) -> str:
        n = self._counts.get(kind, 0)
        self._counts[kind] = n + 1
        return kind if n == 0 else f"{kind}#{n}"

    @property
    def rng(self) -> np.random.Generator:
        """The step's random generator: a pure function of (seed, step)."""
        return np.random.default_rng([self.seed, self.step])


@dataclass(frozen=True)
class Layout:
    """Result of ``distribute``: which ranks form each bucket, and optional bucket groups."""

    axis: str
    tree: ClientPlaceTree
    buckets: list
    groups: list | None = None


@dataclass(frozen=True)
class DGraph:
    ctx: PlanContext
    records: Records
    modality: str = "all"
    layout: Layout | None = None
    costs: np.ndarray | None = None
    cost_fn: Callable | None = None
    placement: object | None = None          # set by balance(): the Assignment
    broadcast: tuple = ()
    mix_info: dict | None = None
    history: tuple = ()

    @classmethod
    def from_buffers(cls, buffers: Sequence[BufferMeta] | Mapping[str, BufferMeta], ctx: PlanContext) -> "DGraph":
        bufs = list(buffers.values()) if isinstance(buffers, Mapping) else list(buffers)
        recs = Records.from_buffers(bufs)
        desc = ", ".join(f"{b.source}={len(b)}" for b in bufs)
        return cls(ctx, recs, history=(f"buffers: {desc}",))

    @classmethod
    def from_plan(cls, plan) -> "DGraph":
        """A graph of a plan's sampled set, to try other primitives on the same batch (what-if)."""
        return cls(PlanContext(plan.mesh, plan.step), plan.records, history=(f"from plan of step {plan.step}",))

    def evolve(self, note: str | None = None, **changes) -> "DGraph":
        hist = self.history + ((note,) if note else ())
        return dataclasses.replace(self, history=hist, **changes)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def sources(self) -> tuple[str, ...]:
        return self.records.sources

    @property
    def step(self) -> int:
        return self.ctx.step

    @property
    def mesh(self) -> ClientPlaceTree:
        return self.ctx.mesh

    def __repr__(self) -> str:
        parts = [f"step {self.step}", f"{len(self)} samples of {list(self.sources)}", f"modality={self.modality!r}"]
        if self.layout is not None:
            parts.append(f"distributed {self.layout.axis!r} over {len(self.layout.buckets)} buckets")
        if self.costs is not None:
            parts.append("costed")
        if self.placement is not None:
            parts.append("balanced")
        return f"DGraph({', '.join(parts)}; render() shows its edges)"

    def _before_balance(self, op: str) -> None:
        """Refuse ``op`` on a balanced graph: it would drop the balance, and plan() would silently fall back to
        arrival order (one microbatch a bucket)."""
        if self.placement is not None:
            raise ConfigError(f"{op}() after balance() would throw the balance away (plan() would then take the "
                              f"samples in arrival order, one microbatch a bucket); call {op}() before balance()")

    # -- selection -----------------------------------------------------------------------------
    def view(self, modality: str) -> "DGraph":
        """The records of one modality from the same buffer: ``"text"`` (samples with text tokens),
        ``"image"`` (samples with images), ``"all"``. Costs and layout are reset for the new view."""
        if modality not in MODALITIES:
            raise ConfigError(f"unknown modality {modality!r}; choose one of {MODALITIES}")
        r = self.records
        mask = {"text": r.tokens > 0, "image": r.num_images > 0, "all": np.ones(len(r), bool)}[modality]
        return self.evolve(f"view({modality!r}): {int(mask.sum())} of {len(r)}", records=r.take(mask),
                           modality=modality, costs=None, cost_fn=None, placement=None, layout=None)

    def select(self, mask) -> "DGraph":
        """Keep the records where ``mask`` (a boolean array or a function of the records) is true."""
        self._before_balance("select")
        m = np.asarray(mask(self.records) if callable(mask) else mask, bool)
        if m.shape != (len(self),):
            raise ConfigError(f"select() mask has shape {m.shape}, expected ({len(self)},)")
        return self.evolve(f"select: {int(m.sum())} of {len(self)}", records=self.records.take(m),
                           costs=None if self.costs is None else self.costs[m], placement=None)

    # -- primitives (each one operator class in plane/primitives) ------------------------------
    def mix(self, schedule) -> "DGraph":
        """Sample this step's global batch from the sources by ``schedule`` (carried-error counts)."""
        self._before_balance("mix")
        from .primitives.mix import Mix
        return Mix(schedule).apply(self)

    def distribute(self, axis: str, group_size: int | None = None, module: str | None = None) -> "DGraph":
        """Split into buckets along ``axis``: ``"DP"``, ``"CP"`` (DP x CP uniform consumers) or ``"WORLD"``."""
        self._before_balance("distribute")
        from .primitives.distribute import Distribute
        return Distribute(axis, group_size, module).apply(self)

    def cost(self, fn: Callable) -> "DGraph":
        """Attach a per-sample cost model ``fn(records) -> array``; ``balance`` equalises it."""
        self._before_balance("cost")
        from .primitives.cost import Cost
        return Cost(fn).apply(self)

    def balance(self, method: str = "karmarkar_karp", microbatches: int = 1, max_tokens: int | None = None,
                intra: bool = False, oversize: str = "error", level: str = "both",
                equal_counts: bool = False) -> "DGraph":
        """Assign samples to (bucket, microbatch) bins with ``method``, never over ``max_tokens``."""
        from .primitives.balance import Balance
        return Balance(method, microbatches, max_tokens, intra, oversize, level, equal_counts).apply(self)

    def broadcast_at(self, dim: str) -> "DGraph":
        """Declare that the trainer broadcasts along ``dim``: its ranks > 0 fetch nothing."""
        from .primitives.broadcast import BroadcastAt
        return BroadcastAt(dim).apply(self)

    def plan(self, **modules: "DGraph"):
        """Finalise into a Plan; other modules' graphs (e.g. ``encoder=image_graph``) ride along, without
        the samples this graph's ``balance(oversize="drop")`` dropped (each is balanced again over the rest)."""
        from .primitives.finalize import finalize
        return finalize(self, modules)

    def plan_raw(self, fn: Callable[["DGraph"], list], **modules: "DGraph"):
        """Low-level hook: ``fn(graph)`` returns, per bucket, its microbatches as lists of record rows."""
        from .primitives.finalize import finalize_raw
        return finalize_raw(self, fn, modules)

    # -- transparency --------------------------------------------------------------------------
    def render(self) -> str:
        """The edges this graph went through, one per line."""
        return "\n".join(f"{'  ' * i}-> {h}" if i else h for i, h in enumerate(self.history))
