"""A job's configuration, checked before any process starts, and starting its roles on a transport.

Shared by every way a job starts: :class:`~.local.LocalJob` (in this process), :class:`~.rpc_job.RpcJob`
(worker processes it starts or joins) and ``python -m torchdata_overlord.launch`` (the data nodes).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import ConfigError
from ..plane.place_tree import ClientPlaceTree
from ..roles.loader_parts import Parts
from ..sources.base import Source
from ..sources import read_ahead
from ..sources.parquet import ParquetSource
from .checkpoint_store import CheckpointStore
from .constructor_actor import ConstructorActor
from .loadable import check_loadable
from .loader_actor import LoaderActor
from .planner_actor import PlannerActor
from .fault_policy import FaultPolicy
from .refs import PLANNER, LoaderRef, PlannerRef, constructor_actor, loader_actor, role_names, shadow_actor
from .switches import env_on
from .transport import ActorDied, CallTimeout, Transport

__all__ = ["SourceSpec", "LiveSource", "RoleConfig", "start_roles", "source_settings", "usable_cores"]


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def check_source_names(names: list) -> None:
    """At least one source, each named once (the name the strategy's schedules mix it by)."""
    if not names:
        raise ConfigError("a job needs at least one source")
    twice = sorted({n for n in names if names.count(n) > 1}, key=str)
    if twice:
        raise ConfigError(f"sources: more than one source is named {', '.join(map(repr, twice))}; give each source "
                          f"a name of its own (the name the strategy's schedules mix it by)")


def source_settings(names: list[str]) -> Callable:
    """Check the source names; returns ``get(value, name, default)`` for settings given as one value
    for every source or as a ``{source: value}`` dict (unknown names refused)."""
    check_source_names(names)

    def get(value, name, default, what="settings"):
        if isinstance(value, Mapping):
            unknown = set(value) - set(names)
            if unknown:
                raise ConfigError(f"{what} names unknown sources {sorted(unknown)}; sources are {names} (a "
                                  f"{{source: value}} dict names sources of the loader)")
            return value.get(name, default)
        return default if value is None else value
    return get


@dataclass
class LiveSource:
    """A source used as is by roles that run in this process (nothing to rebuild, nothing to pickle)."""

    source: Any
    transform = None

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def paths(self):
        return self.source

    def build(self, fresh: bool = False):
        """The source itself; ``fresh``: a new one like it (another data-parallel part of it)."""
        return SourceSpec.from_source(self.source).build() if fresh else self.source


@dataclass
class SourceSpec:
    """How to build a source again in another process: ``cls(name, paths, transform, **kwargs)``,
    then its ``state``. ``from_source`` takes these from any :class:`~torchdata_overlord.Source`'s
    ``spec_args()`` (``paths``: a file source's resolved files, a :class:`~torchdata_overlord.NodeSource`'s
    node factory); a name alone (``paths=None``) only names the source (enough for a client joining
    a launched job, whose roles were built from the launcher's config). ``cls=None``: ParquetSource.
    """

    name: str
    paths: Any
    transform: Callable | None = None
    kwargs: dict = field(default_factory=dict)     # columns, shuffle, seed, epochs, on_error, ...
    state: dict | None = None                      # the source's state_dict() to start from
    cls: type | None = None

    @classmethod
    def from_source(cls, src) -> "SourceSpec":
        """A source's spec; a spec as is; a name (str) only names the source."""
        if isinstance(src, SourceSpec):
            return src
        if isinstance(src, str):
            return cls(src, None)
        if not isinstance(src, Source):
            raise ConfigError(f"a source must be a Source (ParquetSource, FileSource, NodeSource, or one with "
                              f"the Source protocol's members) or a SourceSpec, got {type(src).__name__}")
        paths, transform, kwargs = src.spec_args()
        return cls(src.name, paths, transform, dict(kwargs), src.state_dict(), type(src))

    def build(self, fresh: bool = True):
        src = (self.cls or ParquetSource)(self.name, self.paths, self.transform, **self.kwargs)
        if self.state is not None:
            src.load_state_dict(self.state)
        return src


def check_autoscale(value) -> None:
    """``autoscale=`` is True, False or a :class:`~torchdata_overlord.scaling.AutoScaler` (else a ConfigError)."""
    if not isinstance(value, bool) and type(value).__name__ != "AutoScaler":
        raise ConfigError(f"autoscale must be True, False or a torchdata_overlord.scaling.AutoScaler, got {value!r}")


@dataclass
class RoleConfig:
    """Everything needed to start a job's roles (checked here, before any process starts)."""

    specs: list
    strategy: Callable
    mesh: ClientPlaceTree
    global_batch: int
    seq_len: int | None
    seed: int = 0
    buffer_size: Any = None
    workers: Any = 0
    image_token_id: int | None = None
    pad_id: int = 0
    ignore_index: int = -100
    constructors: int | None = None
    clients: int = 1
    timeout: float = 60.0
    checkpoint_dir: str | None = None       # the store of Planner/constructor checkpoints and loader snapshots
    snapshot_every: int = 10                # steps between Source Loader snapshots
    shadows: bool = False                   # a hot-standby Source Loader per source
    in_process: bool = False                # every role in this process: sources used as they are
    actors: Any = 1                         # data-parallel Source Loaders per source (int, or {source: int})
    plan: Any = None                        # a scaling.Placement: actors, workers and process of every role
    autoscale: Any = None                   # a scaling.AutoScaler (bound to the plan), or None

    def __post_init__(self) -> None:
        self.specs = [LiveSource(s) if self.in_process and not isinstance(s, (SourceSpec, str))
                      else SourceSpec.from_source(s) for s in self.specs]
        self.get = source_settings(self.names)
        if self.autoscale is True:
            from ..scaling.autoscaler import AutoScaler
            self.autoscale = AutoScaler()
        elif self.autoscale is False:
            self.autoscale = None
        elif self.autoscale is not None:
            check_autoscale(self.autoscale)
        if self.plan is not None:           # the placement's actors, and its workers where none were given
            from ..scaling.placement import Placement
            if not isinstance(self.plan, Placement):
                raise ConfigError(f"placement must be 'auto', None or a torchdata_overlord.scaling.Placement, got "
                                  f"{self.plan!r:.200}")
            missing = [n for n in self.names if n not in self.plan.sources]
            extra = [n for n in self.plan.sources if n not in self.names]
            if missing or extra:
                raise ConfigError(f"the placement does not place the job's sources {self.names}: "
                                  + "; ".join(f"{what} {names}" for what, names in (("it lacks", missing),
                                              ("it names unknown", extra)) if names)
                                  + " (make it for these sources: auto_partition(...) or Placement(...))")
            self.actors = {n: sp.actors for n, sp in self.plan.sources.items()}
            if self.workers is None:
                self.workers = {n: sp.workers for n, sp in self.plan.sources.items()}
        if not isinstance(self.mesh, ClientPlaceTree):
            raise ConfigError(f"mesh must be a ClientPlaceTree, got {type(self.mesh).__name__}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ConfigError(f"timeout must be a number of seconds > 0, got {self.timeout!r}")
        dp = self.mesh.sizes.get("dp", 1)
        placed = None if self.plan is None else len(self.plan.constructors)
        if self.constructors is None:       # one per DP group, or as many as a given placement places
            self.constructors = dp if placed is None else placed
        c = self.constructors
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= dp or dp % c:
            raise ConfigError(f"constructors={c!r} does not fit the mesh ({self.mesh.describe()}): give a divisor of "
                              f"dp={dp} (one Data Constructor per DP group is {dp}; fewer share groups)"
                              + ("" if placed is None else f"; the placement places {placed}"))
        if placed is not None and placed != c:
            raise ConfigError(f"the placement places {placed} Data Constructor(s) but the job has constructors={c}: "
                              f"place one process per constructor (Placement.constructors) or pass "
                              f"constructors={placed}")
        self.parts = Parts(self.names, {n: self.get(self.actors, n, 1, "actors=") for n in self.names},
                           {n: self.get(self.buffer_size, n, self.global_batch, "buffer_size=") for n in self.names})
        for n in self.names:
            self.get(self.workers, n, 0, "workers=")
        if isinstance(self.clients, bool) or not isinstance(self.clients, int) or not 1 <= self.clients:
            raise ConfigError(f"clients must be an integer >= 1, got {self.clients!r}")
        if self.strategy is not None and not self.in_process:     # None: a client of a launched job
            check_loadable(self.strategy, "the strategy")
        for spec in [] if self.in_process else self.specs:
            if spec.transform is not None:
                check_loadable(spec.transform, f"the transform of source {spec.name!r}")
            if callable(spec.paths):
                check_loadable(spec.paths, f"the node factory of source {spec.name!r}")
            if spec.cls is not None:
                check_loadable(spec.cls, f"the class of source {spec.name!r}")
            settings = {k: v for k, v in spec.kwargs.items() if k != "file_table"}     # (the file table: data)
            check_loadable(settings, f"the settings of source {spec.name!r}", must_pickle=False)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def roles(self) -> list[str]:
        return role_names(self.parts.keys, self.constructors, self.shadows)

    def placement(self, n_workers: int) -> dict[str, int]:
        """actor -> worker index: the :attr:`plan`'s, else role ``j`` (Planner, loaders, constructors,
        shadows) on worker ``j % n_workers``, except that a shadow never shares its primary's worker
        when another exists."""
        if self.plan is not None:
            from ..scaling.auto import actor_processes
            return {a: p % n_workers for a, p in actor_processes(self.plan, self.shadows).items()}
        where = {a: j % n_workers for j, a in enumerate(self.roles)}
        for n in self.parts.keys if self.shadows else []:
            if where[shadow_actor(n)] == where[loader_actor(n)] and n_workers > 1:
                where[shadow_actor(n)] = (where[loader_actor(n)] + 1) % n_workers
        return where

    def shadows_beside_primaries(self, n_workers: int) -> list[str]:
        """The loader keys whose shadow :meth:`placement` puts in its primary's worker (only with a
        single worker, or a given Placement that says so): such a shadow dies with its primary, so it
        protects against nothing but a failure of the actor alone."""
        where = self.placement(n_workers) if self.shadows else {}
        return [k for k in self.parts.keys if self.shadows and where[shadow_actor(k)] == where[loader_actor(k)]]

    def pickle_specs(self) -> None:
        """Pickle every source spec once now and drop the bytes: what is costly to pickle keeps its
        pickled form (a file table of 100,000 files: ~0.15 s here), so the start of the roles, which
        pickles each spec again, does not pay it (a job calls this while its role processes start)."""
        for spec in self.specs:
            try:
                pickle.dumps(spec)
            except Exception:  # noqa: BLE001 - starting the role pickles it again and reports what fails
                pass

    def default_workers(self) -> int:
        """Role worker processes when neither ``n_workers`` nor a placement is given (``placement=None``,
        or sources given as specs, which cannot be profiled here). With fault tolerance (a checkpoint
        store or shadows) one per role, so a failure takes one role. Otherwise the roles share the
        cores this process leaves free: at least one process, at most one per role (a process per
        source costs ~40 MiB and an RPC hop each; actors in one process call each other directly)."""
        if self.shadows or self.checkpoint_dir is not None:
            return len(self.roles)
        return max(1, min(len(self.roles), usable_cores() - 1))

    def store(self) -> CheckpointStore | None:
        return None if self.checkpoint_dir is None else CheckpointStore(self.checkpoint_dir)

    def loader_args(self, spec: SourceSpec) -> tuple:
        return (spec, self.get(self.buffer_size, spec.name, self.global_batch), self.get(self.workers, spec.name, 0) or 0,
                self.image_token_id, self.timeout, not self.in_process and env_on(read_ahead.ENV))

    def policy(self, spares: list) -> FaultPolicy:
        return FaultPolicy(self.store(), self.snapshot_every, self.shadows, list(spares),
                           {spec.name: self.loader_args(spec) for spec in self.specs},
                           (self.seq_len, self.pad_id, self.ignore_index, self.image_token_id),
                           build_thread=not self.in_process)

    def fingerprint(self) -> dict:
        """What a client must agree on with the roles it joins."""
        return {"sources": self.names, "mesh": self.mesh.to_dict(), "global_batch": self.global_batch,
                "seq_len": self.seq_len, "seed": self.seed, "image_token_id": self.image_token_id,
                "constructors": self.constructors, "clients": self.clients}


def start_roles(transport: Transport, cfg: RoleConfig, n_workers: int = 1, spares: list | None = None,
                warm_timeout: float | None = None) -> None:
    """Start every role of ``cfg`` on ``transport``, placed by :meth:`RoleConfig.placement`, each
    knowing where the others are; ``spares`` (worker names) is where the Planner starts replacements.
    With ``warm_timeout``, every Source Loader then opens its source and fills its first buffer within
    that many seconds: the slow first fill happens under the start-up timeout, not the per-call one,
    and a source that cannot be read fails here."""
    if cfg.strategy is None or any(s.paths is None for s in cfg.specs):
        raise ConfigError("starting the roles needs the strategy and every source (not just its name)")
    where = cfg.placement(n_workers)
    transport.place(where)
    peers, store = transport.peers(), cfg.store()
    policy = cfg.policy(spares or [])

    def start(name, factory, *args):
        transport.start_actor(name, factory, *args, worker=where[name])

    actors = [(PLANNER, PlannerActor, (cfg.strategy, cfg.mesh, cfg.global_batch, cfg.seed, cfg.names,
                                       cfg.constructors, cfg.clients, cfg.timeout, peers, policy, cfg.parts.to_dict(),
                                       None if cfg.autoscale is None else cfg.autoscale.bind(cfg.plan)))]
    for key in cfg.parts.keys:
        args = policy.loader_actor_args(cfg.parts.source_of(key), peers, cfg.parts.shard_of(key))
        actors += [(loader_actor(key), LoaderActor, args)] + \
            ([(shadow_actor(key), LoaderActor, args)] if cfg.shadows else [])
    # each Source Loader opens its source where it starts (file table, transform): start them together,
    # and the Planner beside them (it calls no loader before the first step)
    with cf.ThreadPoolExecutor(min(16, len(actors)), thread_name_prefix="overlord-start") as pool:
        for fut in [pool.submit(start, name, factory, *args) for name, factory, args in actors]:
            fut.result()
    for c in range(cfg.constructors):
        start(constructor_actor(c), ConstructorActor, c, *policy.constructor_args, peers, cfg.timeout, store,
              policy.build_thread)
    if warm_timeout is not None:
        warm = {n: LoaderRef(transport, loader_actor(n), cfg.timeout).warm(timeout=warm_timeout) for n in cfg.parts.keys}
        cf.wait(list(warm.values()), timeout=warm_timeout + 5)
        for n, fut in warm.items():
            try:
                fut.result(timeout=1)
            except (ActorDied, CallTimeout, cf.TimeoutError) as e:
                from .rpc_transport import TransportStartupError
                raise TransportStartupError(f"source {n!r}: its Source Loader did not fill its first buffer within "
                                            f"the start-up timeout of {warm_timeout:g} s ({e})") from e
    if store is not None:           # a first checkpoint: a Planner lost before the first step can be restored
        PlannerRef(transport, PLANNER, cfg.timeout).checkpoint_start().result(cfg.timeout + 5)
