"""RpcJob: the roles as actors in their own processes, and this process as one of the job's clients.

Same public surface and the same results as :class:`~torchdata_overlord.runtime.local.LocalJob`
(same seed and inputs: bit-identical outputs, and the two jobs' ``state_dict`` formats are the
same, so a state of one loads into the other). The roles and the protocol of a step are in
:mod:`~torchdata_overlord.runtime.actors`: the Planner actor, one Source Loader actor per source and
one Data Constructor actor per DP group (``constructors=``), placed one role per worker process by
default (``n_workers=`` fewer puts several roles in one process). Samples go from the loaders to the
constructors and from the constructors to the clients; the Planner sees metadata only.

Where the processes come from:

* default: this process starts the workers on this machine (loopback only) and is the only client;
* ``group=``: every process of a ``torch.distributed`` group (the trainer ranks) is a client; group
  rank 0 starts the workers and hands the rendezvous to the others over the group;
* ``address="host:port"``: the workers were started by ``python -m torchdata_overlord.launch`` on the
  data nodes; this process joins as client ``client`` (its trainer rank);
* ``transport=``: actors placed by a given transport (an :class:`~torchdata_overlord.runtime.transport.
  InProcessTransport` runs the same code in this process, for tests and debugging).

Every call carries ``timeout`` seconds. Sources are rebuilt inside the workers from a
:class:`SourceSpec` (a used ParquetSource holds open Arrow files and does not pickle); the strategy,
transforms and mesh must pickle (a strategy defined at module level does, a closure or lambda does not),
and be loadable in the role processes (checked before any starts: see :mod:`.loadable`).
Several RpcJobs may run in one process: those opened while another runs share its RPC group and
worker processes (see :mod:`~torchdata_overlord.runtime.rpc_session`).
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from ..errors import ConfigError, OverlordError
from ..plane.place_tree import ClientPlaceTree
from ..sources.parquet import ParquetSource
from .actors import (PLANNER, ConstructorActor, JobReset, LoaderActor, constructor_actor, loader_actor,
                     role_names, shadow_actor)
from .checkpoint_store import CheckpointStore
from .loadable import check_loadable
from .planner_actor import PLANNER_KEY, FaultPolicy, PlannerActor, RoleLost
from .local import LocalJob, StepResult, source_settings
from .procstats import process_memory
from .spares import serving, spare_order
from .transport import ActorDied, CallTimeout, Transport, check_timeout, settle

__all__ = ["RpcJob", "SourceSpec", "RoleConfig", "start_roles"]
log = logging.getLogger(__name__)

RECOVERABLE = (JobReset, ActorDied, CallTimeout)
REGISTRY = "planner-registry"


class PlannerRegistry:
    """Hosted by the leader client: where the Planner is, so the other clients follow a replacement."""

    def __init__(self, name: str, worker: str):
        self.current = {"name": name, "worker": worker}
        self.lock = threading.Condition()

    def moved(self, name: str, worker: int | str) -> None:
        from ._rpc_worker import worker_name
        with self.lock:
            self.current = {"name": name, "worker": worker if isinstance(worker, str) else worker_name(worker)}
            self.lock.notify_all()

    def planner_after(self, old: str, timeout: float) -> cf.Future:
        """The Planner once it is no longer ``old`` (None after ``timeout`` seconds): answered later."""
        out: cf.Future = cf.Future()

        def wait():
            with self.lock:
                self.lock.wait_for(lambda: self.current["name"] != old, timeout=timeout)
                settle(out, dict(self.current) if self.current["name"] != old else None)

        threading.Thread(target=wait, name="overlord-registry-wait", daemon=True).start()
        return out


class JobStopped(OverlordError, RuntimeError):
    """The job's coordinator (the launcher) stopped every role, and says why (e.g. another trainer died)."""


class _Request:
    """One step a client asked for, until it is answered (asked again after a failure)."""

    def __init__(self, step: int, wanted: list, consumed: int):
        self.step, self.wanted, self.consumed = step, wanted, consumed
        self.out: cf.Future = cf.Future()
        self.out.step, self.out.delayed = step, False   # delayed: a role's failure held this step up
        self.attempt, self.gen_seen = 0, -1
        self.first_failure: float | None = None


@dataclass
class SourceSpec:
    """How to rebuild a ParquetSource in another process: its constructor arguments and position.

    ``from_source`` reads a ParquetSource's public attributes: for local files, ``paths`` are its
    resolved :attr:`~ParquetSource.files` (the worker reads exactly the same files in the same
    order); for URIs or a ``filesystem=`` (pyarrow filesystems pickle), the paths as given, which the
    worker resolves again; the state's file fingerprint then refuses a file set that changed.
    """

    name: str
    paths: Any
    transform: Callable | None = None
    kwargs: dict = field(default_factory=dict)     # columns, shuffle, seed, epochs, on_error, ...
    state: dict | None = None                      # ParquetSource.state_dict() to start from

    @classmethod
    def from_source(cls, src) -> "SourceSpec":
        """A ParquetSource's spec; a spec as is; a name (str) only names the source (enough for a
        client joining a launched job, whose roles were built from the launcher's config)."""
        if isinstance(src, SourceSpec):
            return src
        if isinstance(src, str):
            return cls(src, None)
        if not isinstance(src, ParquetSource):
            raise ConfigError(f"RpcJob sources must be ParquetSource or SourceSpec, got {type(src).__name__}")
        kwargs = dict(columns=src.columns, shuffle=src.shuffle, seed=src.seed, epochs=src.epochs,
                      on_error=src.on_error, skip_log_interval=src.skip_log_interval)
        paths = list(src.files)
        if src.filesystem is not None or any("://" in f for f in src.files):
            paths, kwargs["filesystem"] = src.paths, src.filesystem
        return cls(src.name, paths, src.transform, kwargs, src.state_dict())

    def build(self) -> ParquetSource:
        src = ParquetSource(self.name, self.paths, self.transform, **self.kwargs)
        if self.state is not None:
            src.load_state_dict(self.state)
        return src


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

    def __post_init__(self) -> None:
        self.specs = [SourceSpec.from_source(s) for s in self.specs]
        self.get = source_settings(self.names)
        if not isinstance(self.mesh, ClientPlaceTree):
            raise ConfigError(f"mesh must be a ClientPlaceTree, got {type(self.mesh).__name__}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ConfigError(f"timeout must be a number of seconds > 0, got {self.timeout!r}")
        dp = self.mesh.sizes.get("dp", 1)
        if self.constructors is None:
            self.constructors = dp
        c = self.constructors
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= dp or dp % c:
            raise ConfigError(f"constructors={c!r} does not fit the mesh ({self.mesh.describe()}): give a divisor of "
                              f"dp={dp} (one Data Constructor per DP group is {dp}; fewer share groups)")
        if isinstance(self.clients, bool) or not isinstance(self.clients, int) or not 1 <= self.clients:
            raise ConfigError(f"clients must be an integer >= 1, got {self.clients!r}")
        if self.strategy is not None:          # None: a client of a launched job (the roles have it)
            check_loadable(self.strategy, "the strategy")
        for spec in self.specs:
            if spec.transform is not None:
                check_loadable(spec.transform, f"the transform of source {spec.name!r}")

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def roles(self) -> list[str]:
        return role_names(self.names, self.constructors, self.shadows)

    def placement(self, n_workers: int) -> dict[str, int]:
        """actor -> worker index: role ``j`` (Planner, loaders, constructors, shadows) on worker
        ``j % n_workers``, except that a shadow never shares its primary's worker when another exists."""
        where = {a: j % n_workers for j, a in enumerate(self.roles)}
        for n in self.names if self.shadows else []:
            if where[shadow_actor(n)] == where[loader_actor(n)] and n_workers > 1:
                where[shadow_actor(n)] = (where[loader_actor(n)] + 1) % n_workers
        return where

    def store(self) -> CheckpointStore | None:
        return None if self.checkpoint_dir is None else CheckpointStore(self.checkpoint_dir)

    def loader_args(self, spec: SourceSpec) -> tuple:
        return (spec, self.get(self.buffer_size, spec.name, self.global_batch), self.get(self.workers, spec.name, 0),
                self.image_token_id, self.timeout)

    def policy(self, spares: list) -> FaultPolicy:
        return FaultPolicy(self.store(), self.snapshot_every, self.shadows, list(spares),
                           {spec.name: self.loader_args(spec) for spec in self.specs},
                           (self.seq_len, self.pad_id, self.ignore_index, self.image_token_id))

    def fingerprint(self) -> dict:
        """What a client must agree on with the roles it joins."""
        return {"sources": self.names, "mesh": self.mesh.to_dict(), "global_batch": self.global_batch,
                "seq_len": self.seq_len, "seed": self.seed, "image_token_id": self.image_token_id,
                "constructors": self.constructors, "clients": self.clients}


def start_roles(transport: Transport, cfg: RoleConfig, n_workers: int = 1, spares: list | None = None,
                warm_timeout: float | None = None) -> None:
    """Start every role of ``cfg`` on ``transport`` (placed by :meth:`RoleConfig.placement` when the
    transport places actors), each knowing where the others are; ``spares`` (RPC worker names) is
    where the Planner starts replacements. With ``warm_timeout``, every Source Loader then opens its
    source and fills its first buffer within that many seconds: the slow first fill happens under
    the start-up timeout, not the per-call one, and a source that cannot be read fails here."""
    if cfg.strategy is None or any(s.paths is None for s in cfg.specs):
        raise ConfigError("starting the roles needs the strategy and every source (not just its name)")
    where = cfg.placement(n_workers)
    placed = hasattr(transport, "place")
    if placed:
        transport.place(where)
    peers, store = transport.peers(), cfg.store()
    policy = cfg.policy(spares or [])

    def start(name, factory, *args):
        transport.start_actor(name, factory, *args, **({"worker": where[name]} if placed else {}))

    start(PLANNER, PlannerActor, cfg.strategy, cfg.mesh, cfg.global_batch, cfg.seed, cfg.names, cfg.constructors,
          cfg.clients, cfg.timeout, peers, policy)
    for spec in cfg.specs:
        start(loader_actor(spec.name), LoaderActor, *cfg.loader_args(spec), peers, store, cfg.snapshot_every)
        if cfg.shadows:
            start(shadow_actor(spec.name), LoaderActor, *cfg.loader_args(spec), peers, store, cfg.snapshot_every)
    for c in range(cfg.constructors):
        start(constructor_actor(c), ConstructorActor, c, *policy.constructor_args, store)
    if warm_timeout is not None:
        warm = {n: transport.call(loader_actor(n), "warm", timeout=warm_timeout) for n in cfg.names}
        cf.wait(list(warm.values()), timeout=warm_timeout + 5)
        for n, fut in warm.items():
            try:
                fut.result(timeout=1)
            except (ActorDied, CallTimeout, cf.TimeoutError) as e:
                from .rpc_transport import TransportStartupError
                raise TransportStartupError(f"source {n!r}: its Source Loader did not fill its first buffer within "
                                            f"the start-up timeout of {warm_timeout:g} s ({e})") from e


class RpcJob:
    """``RpcJob(sources, strategy, mesh, global_batch, seq_len, seed=0, buffer_size=None, workers=0,
    image_token_id=None, pad_id=0, ignore_index=-100, n_workers=None, *, constructors=None, timeout=60,
    startup_timeout=60, stop_timeout=10, transport=None, group=None, address=None, client=None, spares=0,
    checkpoint_dir=None, snapshot_every=10, shadows=False, recovery_timeout=120)``:
    LocalJob's API (``step``, ``submit``, ``state_dict``, ``load_state_dict``, ``add_feedback``,
    ``step_index``, ``stats``, ``close``, context manager) with the roles in worker processes.
    ``n_workers=None`` gives every role its own process; ``spares`` more worker processes start
    with the group and stay idle (RPC membership is fixed at start: a replacement must exist then).
    ``checkpoint_dir``, ``snapshot_every`` and ``shadows`` make failed roles replaceable (see
    :mod:`~torchdata_overlord.runtime.planner_actor`); ``timeout`` is each call's, so also how long a
    frozen role goes unnoticed."""

    PLANNER, LOADERS, FEEDBACK = LocalJob.PLANNER, LocalJob.LOADERS, LocalJob.FEEDBACK

    def __init__(self, sources: Iterable, strategy: Callable, mesh: ClientPlaceTree, global_batch: int,
                 seq_len: int | None, seed: int = 0, buffer_size: int | Mapping[str, int] | None = None,
                 workers: int | Mapping[str, int] = 0, image_token_id: int | None = None, pad_id: int = 0,
                 ignore_index: int = -100, n_workers: int | None = None, *, constructors: int | None = None,
                 timeout: float = 60.0, startup_timeout: float = 60.0, stop_timeout: float = 10.0,
                 transport: Transport | None = None, group=None, address: str | None = None,
                 client: int | None = None, spares: int = 0, checkpoint_dir: str | None = None,
                 snapshot_every: int = 10, shadows: bool = False, recovery_timeout: float = 120.0):
        if sum(x is not None for x in (transport, group, address)) > 1:
            raise ConfigError("give at most one of transport=, group= and address=")
        clients = 1
        if group is not None:
            import torch.distributed as dist
            if not dist.is_initialized():
                raise ConfigError("group= needs torch.distributed initialised (init_process_group) in every trainer")
            self._pg = None if group in (True, "default") else group
            clients = dist.get_world_size(self._pg)
        cfg = RoleConfig(list(sources), strategy, mesh, global_batch, seq_len, seed, buffer_size, workers,
                         image_token_id, pad_id, ignore_index, constructors, clients, timeout, checkpoint_dir,
                         snapshot_every, bool(shadows))
        if n_workers is None:
            n_workers = len(cfg.roles)
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
            raise ConfigError(f"n_workers must be an integer >= 1 (or None: one process per role), got {n_workers!r}")
        self.cfg, self.mesh, self.names, self.timeout = cfg, mesh, cfg.names, float(timeout)
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise ConfigError(f"spares must be an integer >= 0, got {spares!r}")
        self.n_workers, self.spares = n_workers, spares
        self.recovery_timeout = check_timeout(recovery_timeout)
        self.planner_name = PLANNER
        self.faults = {"failures": [], "recoveries": [], "reissued": 0}
        self._requests: dict[int, _Request] = {}        # step -> request not yet answered
        self._recovery_lock = threading.Lock()
        self._recovery = cf.ThreadPoolExecutor(1, thread_name_prefix="overlord-recovery")
        self._closed = False
        self._own_transport = transport is None
        self._launched = address is not None           # the launcher owns the roles, not client 0
        self._gen: int | None = None
        self._next = 0
        self._feedback_futs: list[cf.Future] = []
        self.transport = None
        self.fetches = 0                   # constructor fetch calls this client made
        self._registry = None              # the leader tells the other clients where a new Planner is
        self._planners = 0                 # replacement Planners started
        self._stopped: str | None = None   # why the launcher stopped the job, once it did
        self._final_stats: dict | None = None
        self._running = False              # every role started
        try:
            if transport is not None:
                self.client = 0
                self.transport = transport
                start_roles(transport, cfg, getattr(transport, "n_workers", 1), self._spare_names(), startup_timeout)
            elif group is not None:
                self._start_in_group(startup_timeout, stop_timeout)
            elif address is not None:
                from .rendezvous import join_launched
                self.client = 0 if client is None else client
                self.transport = join_launched(address, cfg, self.client, startup_timeout, stop_timeout)
            else:
                from .rpc_transport import RpcTransport
                self.client = 0
                self.transport = RpcTransport(n_workers + spares, startup_timeout=startup_timeout, rpc_timeout=self.timeout,
                                              stop_timeout=stop_timeout)
                self._fit_workers()
                start_roles(self.transport, cfg, self.n_workers, self._spare_names(), startup_timeout)
            if hasattr(self.transport, "on_stopped"):
                self.transport.on_stopped(self._on_stopped)
            self._running = True
        except BaseException:
            self.close()
            raise

    def _fit_workers(self) -> None:
        """A job sharing this process's RPC group with another (see rpc_session) places its roles and
        spares on that group's workers."""
        have = self.transport.n_workers
        if have >= self.n_workers + self.spares:
            return
        if have - self.spares < 1:
            raise ConfigError(f"this process's RPC group, started by the rpc loader opened first, has {have} worker "
                              f"process(es) (its membership is fixed): too few for spares={self.spares}; give the "
                              f"first loader more spares=, or close it before opening this one")
        self.n_workers = have - self.spares

    def _on_stopped(self, reason: str) -> None:
        """The launcher stopped the job (another trainer died, Ctrl-C...): every step asked for fails
        with JobStopped saying why, now and later."""
        self._stopped = reason
        for req in list(self._requests.copy().values()):
            settle(req.out, exc=JobStopped(reason))

    def _snapshot(self) -> dict | None:
        """:meth:`stats` as :meth:`close` begins, for ``stats()`` after it: only when the job had no
        failure and its Planner answers within a few seconds (a close never waits on a lost role)."""
        t = min(self.timeout, 5.0)
        try:
            if not self._running or self._stopped is not None or self.faults["failures"]:
                return None
            self._call(self.planner_name, "roles", timeout=t).result(t + 1)
            return self.stats()
        except Exception:                    # noqa: BLE001 - diagnostics only: close anyway
            return None

    def _closed_stats(self) -> dict:
        out = copy.deepcopy(self._final_stats) if self._final_stats is not None else {
            "sources": {}, "planner": {}, "constructors": {}, "roles": {}, "spares": [], "unanswered": {},
            "processes": {os.getpid(): process_memory()}}
        out.update(closed=True, client={"client": self.client, "fetches": self.fetches,
                                        "faults": copy.deepcopy(self.faults)})
        if self._stopped is not None:
            out["stopped"] = self._stopped
        return out

    def _host_registry(self) -> None:
        """The leader, in a job with other clients, serves where the Planner is (it may replace it)."""
        if self.client == 0 and self.cfg.clients > 1 and hasattr(self.transport, "place"):
            from . import _rpc_worker as W
            self._registry = PlannerRegistry(self.planner_name, W.worker_name(self.transport.worker_of(PLANNER)))
            W._actor(self.transport.key(REGISTRY)).set(self._registry)

    def _start_in_group(self, startup_timeout: float, stop_timeout: float) -> None:
        """Group rank 0 starts the workers and broadcasts the rendezvous; every rank joins as a client."""
        import torch.distributed as dist

        from .rpc_transport import RpcTransport, TransportStartupError

        pg = self._pg
        self.client = dist.get_rank(pg)
        src = dist.get_global_rank(pg, 0) if pg is not None else 0
        if self.client == 0:
            sent = []

            def publish(rendezvous):
                dist.broadcast_object_list([{"rendezvous": rendezvous}], src=src, group=pg)
                sent.append(True)

            try:
                self.transport = RpcTransport(self.n_workers + self.spares, clients=self.cfg.clients,
                                              startup_timeout=startup_timeout,
                                              rpc_timeout=self.timeout, stop_timeout=stop_timeout, on_rendezvous=publish)
            except BaseException as e:
                if not sent:            # the others wait in the broadcast: tell them why nothing comes
                    dist.broadcast_object_list([{"error": f"{type(e).__name__}: {e}"}], src=src, group=pg)
                raise
            self._fit_workers()
            start_roles(self.transport, self.cfg, self.n_workers, self._spare_names(), startup_timeout)
            self._host_registry()
        else:
            box = [None]
            dist.broadcast_object_list(box, src=src, group=pg)
            if "error" in box[0]:
                raise TransportStartupError(f"trainer rank 0 could not start the data plane's roles: {box[0]['error']}")
            self.transport = RpcTransport.join(box[0]["rendezvous"], self.client, startup_timeout=startup_timeout,
                                               stop_timeout=stop_timeout)
            self._fit_workers()
            self.transport.place(self.cfg.placement(self.n_workers))

    def _spare_names(self) -> list[str]:
        """Where replacements start: the spare workers (any name in one process)."""
        from ._rpc_worker import worker_name
        if not hasattr(self.transport, "place"):       # names only: where the Planner would place them
            return [f"in-process-spare-{i}" for i in range(self.spares)]
        return [worker_name(self.n_workers + i) for i in range(self.spares)]

    # ------------------------------------------------------------------------------ calls

    def _call(self, actor: str, method: str, *args, timeout: float | None = None):
        return self.transport.call(actor, method, *args, timeout=timeout or self.timeout)

    @property
    def wait_timeout(self) -> float:
        """How long a step request may take: the Planner may be replacing a loader meanwhile (it
        waits up to twice the call timeout for a frozen one), so a few call timeouts."""
        return 4 * self.timeout

    def _attach(self, state: Mapping | None, step: int) -> None:
        got = self._call(self.planner_name, "attach", self.client, state if self.client == 0 else None, step)
        reply = got.result(self.timeout + 5)
        self._gen, self._next = reply["gen"], reply["step"]

    def _learn(self, where: Mapping[str, str]) -> None:
        """Replacements started by the Planner: tell our transport where they live."""
        if where and hasattr(self.transport, "place"):
            from ._rpc_worker import worker_index
            self.transport.place({a: worker_index(w) for a, w in where.items()})

    # ------------------------------------------------------------------------------ LocalJob API

    @property
    def is_leader(self) -> bool:
        """Whether this client's feedback and loaded states drive the job (client 0)."""
        return self.client == 0

    def add_feedback(self, step: int, values: Mapping[str, float]) -> None:
        """Send feedback to the Planner (from the leader; other clients' feedback is not sent, the
        trainer ranks are expected to agree on it, e.g. an all-reduced loss)."""
        if not self.is_leader:
            return
        self._check_feedback()
        self._feedback_futs.append(self._call(self.planner_name, "add_feedback", int(step),
                                              {str(k): float(v) for k, v in values.items()}))

    def _check_feedback(self) -> None:
        done = [f for f in self._feedback_futs if f.done()]
        self._feedback_futs = [f for f in self._feedback_futs if not f.done()]
        for f in done:
            f.result()

    @property
    def step_index(self) -> int:
        return self._next

    def submit(self, ranks: Iterable[int] | None = None, consumed: int | None = None) -> cf.Future:
        """Ask for the next step for ``ranks`` (all when None); a future of its :class:`StepResult`
        (with ``state``, the job's state after it). ``consumed``: steps this client has consumed
        (default: all before this one), so the roles can free what every client has used. A request
        that fails because a role failed is asked again once the role is replaced (the future's
        ``delayed`` attribute is True when a failure held the step up)."""
        if self._stopped is not None:
            raise JobStopped(self._stopped)
        if self._gen is None:
            self._attach(None, self._next)
        self._check_feedback()
        step = self._next
        self._next += 1
        wanted = list(range(self.mesh.world_size)) if ranks is None else [self.mesh._check_rank(int(r)) for r in ranks]
        req = _Request(step, wanted, step if consumed is None else int(consumed))
        self._requests[step] = req
        self._issue(req)
        return req.out

    def _issue(self, req: "_Request") -> None:
        req.attempt += 1
        attempt, gen = req.attempt, self._gen
        try:
            routed = self._call(self.planner_name, "ensure", self.client, gen, req.step, req.consumed, self.is_leader,
                                timeout=self.wait_timeout)
        except BaseException as e:          # noqa: BLE001
            self._failed(req, attempt, gen, e)
            return
        routed.add_done_callback(lambda f: self._on_route(req, attempt, gen, f))

    def _on_route(self, req: "_Request", attempt: int, gen: int, f: cf.Future) -> None:
        try:
            info = f.result()
            self._learn(info.get("where"))
            if info.get("delayed"):
                req.out.delayed = True
            names = info["constructors"]
            by_c: dict[int, list] = {}
            for r in req.wanted:
                if info["routing"][r] >= 0:
                    by_c.setdefault(info["routing"][r], []).append(r)
            parts = [self._call(names[c], "fetch", gen, req.step, rs, timeout=self.wait_timeout)
                     for c, rs in by_c.items()]
            self.fetches += len(parts)
        except BaseException as e:     # noqa: BLE001
            self._failed(req, attempt, gen, e)
            return
        remaining = [len(parts)]

        def finish():
            try:
                outputs = dict(info["empty"])
                for p in parts:
                    outputs.update(p.result(0))
                res = StepResult(req.step, info["plan"], {r: outputs[r] for r in req.wanted}, info["state"])
            except BaseException as e:  # noqa: BLE001
                self._failed(req, attempt, gen, e)
                return
            if attempt == req.attempt and settle(req.out, res):
                self._requests.pop(req.step, None)

        def on_part(_):
            remaining[0] -= 1
            if not remaining[0]:
                finish()

        for p in parts:
            p.add_done_callback(on_part)
        if not parts:
            finish()

    # ------------------------------------------------------------------------------ recovery

    def _failed(self, req: "_Request", attempt: int, gen: int, err: BaseException) -> None:
        if attempt != req.attempt or req.out.done():
            return                          # an older attempt; a newer one is on its way
        if not isinstance(err, RECOVERABLE):
            settle(req.out, exc=err)
            return
        self.faults["failures"].append({"step": req.step, "error": f"{type(err).__name__}: {str(err)[:200]}",
                                        "actor": getattr(err, "actor", None)})
        if req.first_failure is None:
            req.first_failure = time.monotonic()
        try:
            self._recovery.submit(self._recover_and_reissue, req, attempt, gen, err)
        except RuntimeError:                # closed
            settle(req.out, exc=err)

    def _recover_and_reissue(self, req: "_Request", attempt: int, gen: int, err: BaseException) -> None:
        if attempt != req.attempt or req.out.done() or self._closed:
            return
        try:
            with self._recovery_lock:
                if self._gen == gen:         # nobody recovered from this failure yet
                    self._recover(err, req.step)
            if time.monotonic() - req.first_failure > self.recovery_timeout:
                raise RoleLost(f"step {req.step} could not be delivered within recovery_timeout="
                               f"{self.recovery_timeout:g} s after a failure ({err})")
        except BaseException as e:          # noqa: BLE001 - the trainer's next() raises it
            settle(req.out, exc=e)
            return
        self.faults["reissued"] += 1
        req.out.delayed = True
        for other in sorted(self._requests.values(), key=lambda r: r.step):   # everything of the old generation
            if other.out.done() or (other is not req and other.gen_seen >= self._gen):
                continue
            other.gen_seen = self._gen
            self._issue(other)

    def _recover(self, err: BaseException, step: int) -> None:
        """Replace what failed (leader), or learn the new generation (everyone)."""
        t0 = time.monotonic()
        actor = getattr(err, "actor", None)
        how = "new generation"
        if isinstance(err, JobReset) or actor is None:
            pass
        elif actor == self.planner_name and self.is_leader:
            self._replace_planner(err)
            how = "replaced the Planner"
        elif actor == self.planner_name:
            self._await_new_planner(err)
            how = "learned the leader's new Planner"
        elif actor.startswith("constructor"):
            info = self._call(self.planner_name, "report_failure", actor, step).result(self.recovery_timeout)
            self._learn(info["where"])
            how = "constructor replaced by the Planner"
        info = self._call(self.planner_name, "generation").result(self.timeout + 5)
        self._learn(info["where"])
        self._gen = info["gen"]
        self.faults["recoveries"].append({"step": step, "actor": actor, "how": how,
                                          "seconds": round(time.monotonic() - t0, 4)})

    def _await_new_planner(self, err: BaseException) -> None:
        """Another client: wait (bounded) until the leader has a new Planner, then use it."""
        if not hasattr(self.transport, "place"):
            raise RoleLost(f"client {self.client} lost the Planner ({err}) and cannot learn its replacement") from err
        from . import _rpc_worker as W
        got = W.call_actor(W.client_name(0), REGISTRY, "planner_after", (self.planner_name, self.recovery_timeout),
                           {}, self.recovery_timeout + 5, ns=self.transport.ns).result(self.recovery_timeout + 10)
        if got is None:
            raise RoleLost(f"client {self.client} lost the Planner ({err}) and the leader (client 0) started no new one "
                           f"within recovery_timeout={self.recovery_timeout:g} s") from err
        self.transport.place({got["name"]: W.worker_index(got["worker"])})
        self.planner_name = got["name"]

    def _replace_planner(self, err: BaseException) -> None:
        spares = self._spare_names()
        if not spares or self.cfg.checkpoint_dir is None:
            raise RoleLost(f"the Planner failed ({err}) and cannot be replaced: give the job spares= and "
                           f"checkpoint_dir=") from err
        self._planners += 1
        name, cfg = f"{PLANNER}#{self._planners}", self.cfg
        home, dead = None, set()           # the new Planner's spare; spares known or found dead
        if not hasattr(self.transport, "place"):
            self.transport.start_actor(name, PlannerActor, *self._planner_args(spares))
        else:
            from ._rpc_worker import worker_index, worker_name
            dead.add(worker_name(self.transport.worker_of(self.planner_name)))
            newest = cfg.store().latest(PLANNER_KEY)
            roles = newest[1]["roles"] if newest is not None else {}
            dead.update(roles.get("dead_spares", []))
            for w in spare_order(spares, serving(roles) if roles else {}, dead):      # the least-loaded live spare
                live = [s for s in spares if s not in dead]
                try:
                    self.transport.start_actor(name, PlannerActor, *self._planner_args(live), worker=worker_index(w))
                    home = w
                    break
                except (ActorDied, CallTimeout):
                    dead.add(w)
            else:
                raise RoleLost(f"the Planner failed ({err}) and no spare process can host a new one (dead: "
                               f"{sorted(dead)})") from err
        info = self._call(name, "recover", home).result(self.recovery_timeout)
        self.planner_name = name
        self._learn(info["where"])
        if self._registry is not None:
            self._registry.moved(name, self.transport.worker_of(name))

    def _planner_args(self, spares: list) -> tuple:
        cfg = self.cfg
        return (cfg.strategy, cfg.mesh, cfg.global_batch, cfg.seed, cfg.names, cfg.constructors, cfg.clients,
                cfg.timeout, self.transport.peers(), cfg.policy(spares))

    def step(self, ranks: Iterable[int] | None = None) -> StepResult:
        """Plan and build the next step for ``ranks`` (all ranks when None)."""
        return self.submit(ranks).result(self.timeout + self.recovery_timeout + 10)

    def state_dict(self) -> dict:
        """The job's state at the Planner's current position (no step in flight)."""
        return self._ask_planner("state_dict")

    def load_state_dict(self, state: Mapping) -> None:
        """Restart at ``state`` (the leader resets every role; another client checks it starts at the
        same step as the leader)."""
        theirs, ours = set(state[self.LOADERS]), set(self.names)
        if theirs != ours:
            raise ConfigError(f"state has sources {sorted(theirs)}, this job has {sorted(ours)}")
        self._attach(dict(state), int(state[self.PLANNER]["step"]))

    def _ask_planner(self, method: str, *args):
        """A synchronous Planner call that survives a Planner failure (replaced first, then asked again)."""
        name = self.planner_name
        try:
            return self._call(name, method, *args).result(self.timeout + 5)
        except (ActorDied, CallTimeout) as e:
            if getattr(e, "actor", None) != name:
                raise
            with self._recovery_lock:
                if self.planner_name == name:
                    self._recover(e, self._next)
            return self._call(self.planner_name, method, *args).result(self.timeout + 5)

    def _serving(self) -> tuple[dict[str, str], dict]:
        """Every role that serves now -> its actor (a replacement's name), asking the Planner. Roles keep
        their names across recoveries: ``planner``, ``loader:<source>``, ``shadow:<source>``, ``constructor:<i>``."""
        info = self._ask_planner("roles")
        self._learn(info["where"])
        roles = {PLANNER: self.planner_name, **{loader_actor(n): a for n, a in info["loaders"].items()},
                 **{constructor_actor(c): a for c, a in enumerate(info["constructors"])},
                 **{shadow_actor(n): a for n, a in info["shadows"].items() if a}}
        return roles, info

    def stats(self) -> dict:
        """Per-source loader stats, Planner and constructor queue depths, recoveries, each role's process
        and memory, and this client's failures and reissued requests. Roles keep their names after a
        recovery (``"roles"``: role -> its current pid; ``"role_recovery"``: role -> the actor serving it,
        its pid and how many times a replacement took it over). A role that does not answer within the
        call timeout (busy with a long fill, or failed) is listed in ``"unanswered"`` and its entry is
        ``{"error": ...}``: diagnostics never stop the training loop. After :meth:`close`: the roles'
        stats as the close began (they are gone), this client's final ones, and ``"closed": True``."""
        if self._closed:
            return self._closed_stats()
        roles, info = self._serving()
        futs = {(kind, r): self._call(a, kind) for kind in ("stats", "process") for r, a in roles.items()}
        cf.wait(list(futs.values()), timeout=self.timeout + 5)
        got, unanswered = {}, {}
        for (kind, r), fut in futs.items():
            try:
                got[kind, r] = fut.result(timeout=0)
            except (ActorDied, CallTimeout, cf.TimeoutError) as e:   # a busy or failed role: said, not raised
                unanswered[r] = f"{type(e).__name__}: {e}"

        def of(r):
            return got.get(("stats", r)) or {"error": unanswered.get(r, "no answer")}

        pids = {r: got["process", r]["pid"] for r in roles if ("process", r) in got}
        procs = {m["pid"]: m for (kind, _), m in got.items() if kind == "process"}
        procs[os.getpid()] = process_memory()
        worker_pids = getattr(self.transport, "worker_pids", [])
        spare_pids = worker_pids[self.n_workers:] if self.client == 0 and self.spares else []
        replaced = info.get("replaced", {})
        return {"sources": {n: of(loader_actor(n)) for n in info["loaders"]}, "planner": of(PLANNER),
                "client": {"client": self.client, "fetches": self.fetches, "faults": copy.deepcopy(self.faults)},
                "constructors": {r: of(r) for r in roles if r.startswith("constructor:")},
                "roles": pids, "processes": procs, "spares": spare_pids, "unanswered": unanswered,
                "role_recovery": {r: {"actor": a, "pid": pids.get(r), "recoveries": replaced.get(r, 0)}
                                  for r, a in roles.items()}}

    def close(self) -> None:
        """Leave the job, first keeping what :meth:`stats` says (bounded). A client of a launched job
        tells the launcher and leaves, another client of a trainer group just leaves; client 0 of a
        job it started first waits (up to the timeout) for the other clients to close it, then closes
        the roles (bounded, errors ignored) and stops the workers (unless another job shares them)."""
        if self._closed:
            return
        self._final_stats = self._snapshot()
        self._closed = True
        self._recovery.shutdown(wait=False, cancel_futures=True)
        try:
            if self.transport is not None and hasattr(self.transport, "leave") and self._stopped is None:
                self.transport.leave(self.timeout)
            if self.transport is not None and self.client == 0 and not self._launched:
                missing = self.transport.wait_for_clients(self.timeout) if hasattr(self.transport, "leave") else []
                if missing:
                    log.warning("closing the roles while client(s) %s have not left after %g s", missing,
                                self.timeout)
                try:
                    actors = list(self._serving()[0].values())
                    replaced = self._call(self.planner_name, "stats").result(self.timeout)["recoveries"]
                    if (replaced or self.faults["recoveries"]) and hasattr(self.transport, "mark_unhealthy"):
                        self.transport.mark_unhealthy()      # a replaced role may be frozen: no graceful wait
                except Exception:            # noqa: BLE001 - the Planner may be gone: close what we know
                    actors = [self.planner_name] + [loader_actor(n) for n in self.names] + \
                        [constructor_actor(c) for c in range(self.cfg.constructors)]
                futs = []
                for a in actors:
                    try:
                        futs.append(self.transport.call(a, "close", timeout=self.timeout))
                    except Exception:        # noqa: BLE001 - the actor may never have started
                        pass
                cf.wait(futs, timeout=self.timeout + 5)
        finally:
            if self._own_transport and self.transport is not None:
                self.transport.stop()

    def __enter__(self) -> "RpcJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
