"""Placement: how many Source Loader actors each source gets, their workers, and which role process
hosts every actor (paper 5.1's configuration, and the round-robin rule it replaces).

Immutable and JSON-able. Process ``i`` hosts ``planner`` if ``planner == i``, the constructors whose
entry in ``constructors`` is ``i``, actor ``j`` of source ``s`` if ``sources[s].processes[j] == i``
and the shadow of ``s`` if ``shadows[s] == i``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping

from ..errors import ConfigError

__all__ = ["SourcePlacement", "Placement", "PROCESS_BYTES", "METHODS"]

PROCESS_BYTES = 40 << 20     # a role process's own memory before it reads anything (DESIGN.md, measured)
METHODS = ("auto", "n_workers", "explicit")


@dataclass(frozen=True)
class SourcePlacement:
    """One source: ``actors`` data-parallel Source Loader actors of ``workers`` transform threads each
    (0: the transform runs on the actor's own thread), actor ``j`` in process ``processes[j]``.
    ``cluster`` is its cost cluster (-1: none); ``transform_s`` (P) and ``group_bytes`` (M) come from its
    profile, ``cpu`` (cores) and ``memory_bytes`` are the estimated load of one actor."""

    source: str
    actors: int
    workers: int
    processes: tuple[int, ...]
    cluster: int
    reason: str
    transform_s: float = 0.0
    group_bytes: int = 0
    cpu: float = 0.0
    memory_bytes: int = 0

    def __post_init__(self):
        object.__setattr__(self, "processes", tuple(int(p) for p in self.processes))
        if self.actors < 1 or self.workers < 0 or len(self.processes) != self.actors:
            raise ConfigError(f"source {self.source!r}: {self.actors} actors x {self.workers} workers on processes "
                              f"{self.processes}: need >= 1 actor, >= 0 workers and one process per actor")


@dataclass(frozen=True)
class Placement:
    """Every source's :class:`SourcePlacement` (in the job's source order) and the role processes:
    ``processes`` of them, the Planner's, each constructor's and each shadow's. ``budget``: cores and
    memory given and the estimate of what is used; ``method``: ``"auto"`` (profiled), ``"n_workers"``
    (round robin over a given process count) or ``"explicit"``; ``notes``: what the planner had to give up."""

    sources: Mapping[str, SourcePlacement]
    processes: int
    planner: int
    constructors: tuple[int, ...]
    shadows: Mapping[str, int] = field(default_factory=dict)
    budget: Mapping = field(default_factory=dict)
    method: str = "auto"
    notes: tuple[str, ...] = ()
    profiles: Mapping[str, dict] = field(default_factory=dict)     # source -> SourceProfile.to_dict() it came from

    def __post_init__(self):
        for name, value in (("sources", self.sources), ("shadows", self.shadows), ("budget", self.budget),
                            ("profiles", self.profiles)):
            object.__setattr__(self, name, MappingProxyType(dict(value)))
        object.__setattr__(self, "constructors", tuple(int(c) for c in self.constructors))
        object.__setattr__(self, "notes", tuple(self.notes))
        if self.method not in METHODS:
            raise ConfigError(f"placement method must be one of {METHODS}, got {self.method!r}")
        used = [self.planner, *self.constructors, *self.shadows.values()]
        used += [p for sp in self.sources.values() for p in sp.processes]
        if self.processes < 1 or not all(0 <= p < self.processes for p in used):
            raise ConfigError(f"placement puts actors on processes {sorted(set(used))}, not all in 0..{self.processes - 1}")

    def actor_count(self) -> int:
        """Every actor the placement starts: the Planner, the loader actors, the constructors, the shadows."""
        return 1 + sum(sp.actors for sp in self.sources.values()) + len(self.constructors) + len(self.shadows)

    def loads(self) -> list[tuple[float, int]]:
        """Estimated (cores, bytes) of each process: its actors' estimates plus :data:`PROCESS_BYTES`."""
        cpu, mem = [0.0] * self.processes, [PROCESS_BYTES] * self.processes
        cpu[self.planner] += self.budget.get("planner_cores", 0.0)
        for c in self.constructors:
            cpu[c] += self.budget.get("constructor_cores", 0.0)
        for sp in self.sources.values():
            for p in sp.processes:
                cpu[p] += sp.cpu
                mem[p] += sp.memory_bytes
        return list(zip(cpu, mem))

    # -- the rule it replaces ------------------------------------------------------------------
    @classmethod
    def uniform(cls, sources: Iterable[str], n_processes: int, constructors: int,
                workers: int | Mapping[str, int] = 0, shadows: bool = False) -> "Placement":
        """Today's ``n_workers=`` rule (``RoleConfig.placement``): one actor per source, role ``j`` of
        [Planner, loaders..., constructors..., shadows...] on process ``j % n_processes``, a shadow moved
        to the next process when it lands on its primary's and another exists."""
        names = list(sources)
        n = int(n_processes)
        if n < 1:
            raise ConfigError(f"n_processes must be >= 1, got {n_processes!r}")
        loader_at = {s: (1 + i) % n for i, s in enumerate(names)}
        first_shadow = 1 + len(names) + constructors
        shadow_at = {}
        for i, s in enumerate(names if shadows else []):
            p = (first_shadow + i) % n
            shadow_at[s] = (p + 1) % n if p == loader_at[s] and n > 1 else p
        per = {s: workers.get(s, 0) if isinstance(workers, Mapping) else workers for s in names}
        placed = {s: SourcePlacement(s, 1, per[s], (loader_at[s],), -1, f"n_workers={n}: round robin, role {1 + i}")
                  for i, s in enumerate(names)}
        return cls(placed, n, 0, tuple((1 + len(names) + c) % n for c in range(constructors)), shadow_at,
                   method="n_workers")

    # -- plain form ----------------------------------------------------------------------------
    def __reduce__(self):
        """Pickled as its plain form (its read-only mappings do not pickle): the rpc runtime sends the
        placement to the Planner's process (``AutoScaler.bind``)."""
        return Placement.from_dict, (self.to_dict(),)

    def to_dict(self) -> dict:
        return {"sources": {n: dataclasses.asdict(sp) | {"processes": list(sp.processes)}
                            for n, sp in self.sources.items()},
                "processes": self.processes, "planner": self.planner, "constructors": list(self.constructors),
                "shadows": dict(self.shadows), "budget": dict(self.budget), "method": self.method,
                "notes": list(self.notes), "profiles": {n: dict(p) for n, p in self.profiles.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Placement":
        return cls({n: SourcePlacement(**sp) for n, sp in d["sources"].items()}, d["processes"], d["planner"],
                   tuple(d["constructors"]), d["shadows"], d["budget"], d["method"], tuple(d["notes"]),
                   d.get("profiles", {}))

    # -- transparency --------------------------------------------------------------------------
    def render(self) -> str:
        """Per process its actors and estimated load, per source its actors x workers and why, the totals."""
        b, estimated = self.budget, self.method == "auto"
        loaders = sum(sp.actors for sp in self.sources.values())
        shadows = f", {plural(len(self.shadows), 'shadow')}" if self.shadows else ""
        lines = [f"placement ({self.method}): {plural(len(self.sources), 'source')} -> {plural(loaders, 'loader actor')}"
                 f", 1 planner, {plural(len(self.constructors), 'constructor')}{shadows} in "
                 f"{plural(self.processes, 'process')}"]
        if estimated:
            lines.append(f"  budget: {b['cores']:g} cores (planner {b['planner_cores']:.2f}, constructors "
                         f"{b['constructor_cores'] * len(self.constructors):.2f}, loaders {b['loader_cores']:.2f}); "
                         f"memory {_bytes(b['memory_bytes'])}")
        actors: list[list[str]] = [[] for _ in range(self.processes)]
        actors[self.planner].append("planner")
        for c, p in enumerate(self.constructors):
            actors[p].append(f"constructor:{c}")
        for name, sp in self.sources.items():
            for j, p in enumerate(sp.processes):
                label = name if sp.actors == 1 else f"{name}#{j}"
                actors[p].append(f"{label} ({plural(sp.workers, 'worker') if sp.workers else 'inline'})")
        for name, p in self.shadows.items():
            actors[p].append(f"shadow:{name}")
        for p, (cpu, mem) in enumerate(self.loads()):
            load = f" (cpu {cpu:.2f}, mem {_bytes(mem)}):" if estimated else ":"
            lines.append(f"  process {p}{load} {', '.join(actors[p]) or '(empty)'}")
        for name, sp in self.sources.items():
            cost = f", P {sp.transform_s * 1e3:.3g} ms, M {_bytes(sp.group_bytes)}" if estimated else ""
            lines.append(f"  source {name}: process{'es' if sp.actors > 1 else ''} "
                         f"{','.join(map(str, sp.processes))}{cost} -- {sp.reason}")
        if estimated:
            workers = sum(sp.actors * sp.workers for sp in self.sources.values())
            lines.append(f"  totals: {plural(self.actor_count(), 'actor')}, {plural(workers, 'worker')}, cpu {b['cpu']:.2f} of "
                         f"{b['cores']:g} cores, memory {_bytes(b['memory'])} of {_bytes(b['memory_bytes'])}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def plural(k: int, what: str) -> str:
    """``1 actor``, ``2 actors``, ``3 processes``."""
    return f"{k} {what}{'' if k == 1 else 'es' if what.endswith('s') else 's'}"


def _bytes(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
