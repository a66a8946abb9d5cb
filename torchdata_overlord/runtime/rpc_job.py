"""RpcJob: the roles as actors in their own processes, and this process as one of the job's clients.

Same public surface and the same results as :class:`~torchdata_overlord.runtime.local.LocalJob`
(same seed and inputs: bit-identical outputs, and the two jobs' ``state_dict`` formats are the
same, so a state of one loads into the other). The roles and the protocol of a step are in
:mod:`~torchdata_overlord.runtime.planner_actor` and its siblings: the Planner actor, one Source
Loader actor per source and one Data Constructor actor per DP group (``constructors=``), placed on
worker processes by :meth:`~.job_config.RoleConfig.default_workers` (or ``n_workers=``); actors of
one process call each other directly. Samples go from the loaders to the
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
:class:`SourceSpec` (a source's class, constructor arguments and state: a used source holds open files
and need not pickle); the strategy,
transforms and mesh must pickle (a strategy defined at module level does, a closure or lambda does not),
and be loadable in the role processes (checked before any starts: see :mod:`.loadable`).
Several RpcJobs may run in one process: those opened while another runs share its RPC group and
worker processes (see :mod:`~torchdata_overlord.runtime.rpc_session`).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping

from ..errors import ConfigError
from ..plane.place_tree import ClientPlaceTree
from .client import Job, StepResult
from .client_recovery import JobStopped
from .job_config import RoleConfig, SourceSpec, start_roles
from .fault_policy import RoleLost
from .transport import Transport

__all__ = ["RpcJob", "SourceSpec", "RoleConfig", "start_roles", "JobStopped", "RoleLost", "StepResult"]
log = logging.getLogger("torchdata_overlord")


class RpcJob(Job):
    """``RpcJob(sources, strategy, mesh, global_batch, seq_len, seed=0, buffer_size=None, workers=None,
    image_token_id=None, pad_id=0, ignore_index=-100, n_workers=None, *, constructors=None, timeout=60,
    startup_timeout=60, stop_timeout=10, transport=None, group=None, address=None, client=None, spares=0,
    checkpoint_dir=None, snapshot_every=10, shadows=False, recovery_timeout=120)``:
    LocalJob's API (``step``, ``submit``, ``state_dict``, ``load_state_dict``, ``add_feedback``,
    ``step_index``, ``stats``, ``close``, context manager) with the roles in worker processes.
    ``n_workers=None``: see :meth:`~.job_config.RoleConfig.default_workers`; ``n_workers=N`` places one
    actor per source round robin, each with its measured transform threads when ``workers=None``
    (:func:`~torchdata_overlord.scaling.auto.chain_workers`); ``spares`` more worker
    processes start with the group and stay idle (RPC membership is fixed at start: a replacement
    must exist then).
    ``checkpoint_dir``, ``snapshot_every`` and ``shadows`` make failed roles replaceable (see
    :mod:`~torchdata_overlord.runtime.planner_actor`); ``timeout`` is each call's, so also how long a
    frozen role goes unnoticed (joining a launched job, ``address=``: the launcher's, which its roles use)."""

    def __init__(self, sources: Iterable, strategy: Callable, mesh: ClientPlaceTree, global_batch: int,
                 seq_len: int | None, seed: int = 0, buffer_size: int | Mapping[str, int] | None = None,
                 workers: int | Mapping[str, int] | None = None, image_token_id: int | None = None, pad_id: int = 0,
                 ignore_index: int = -100, n_workers: int | None = None, *, constructors: int | None = None,
                 timeout: float = 60.0, startup_timeout: float = 60.0, stop_timeout: float = 10.0,
                 transport: Transport | None = None, group=None, address: str | None = None,
                 client: int | None = None, spares: int = 0, checkpoint_dir: str | None = None,
                 snapshot_every: int = 10, shadows: bool = False, recovery_timeout: float = 120.0,
                 actors: int | Mapping[str, int] = 1, placement="auto", autoscale=True):
        if sum(x is not None for x in (transport, group, address)) > 1:
            raise ConfigError("give at most one of transport=, group= and address=")
        clients = 1
        if group is not None:
            import torch.distributed as dist
            if not dist.is_initialized():
                raise ConfigError("group= needs torch.distributed initialised (init_process_group) in every trainer")
            self._pg = None if group in (True, "default") else group
            clients = dist.get_world_size(self._pg)
        sources = list(sources)
        starts_roles = transport is None and address is None and self._rank(group) == 0
        if starts_roles:
            from .loadable import check_main_guarded
            from .rpc_session import preload_also, prestart_fork_server
            check_main_guarded("OverlordLoader(runtime='rpc')")
            preload_also(m for s in sources for m in getattr(getattr(s, "transform", None), "preload", ()))
            prestart_fork_server()          # its torch import overlaps the profiling and placement below
        plan, workers = self._placement(placement, sources, strategy, mesh, global_batch, seed, constructors,
                                        buffer_size, checkpoint_dir, bool(shadows), n_workers, actors, workers,
                                        starts_roles=starts_roles)
        cfg = RoleConfig(sources, strategy, mesh, global_batch, seq_len, seed, buffer_size, workers,
                         image_token_id, pad_id, ignore_index, constructors, clients, timeout, checkpoint_dir,
                         snapshot_every, bool(shadows), actors=actors, plan=plan, autoscale=autoscale)
        self.placement = plan
        if n_workers is None:
            n_workers = plan.processes if plan is not None else cfg.default_workers()
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
            raise ConfigError(f"n_workers must be an integer >= 1 (or None: see RoleConfig.default_workers), got "
                              f"{n_workers!r}")
        super().__init__(cfg, timeout=timeout, recovery_timeout=recovery_timeout, n_workers=n_workers, spares=spares)
        together = cfg.shadows_beside_primaries(n_workers) if transport is None and address is None else []
        if together:
            log.warning("shadows=True with %s: the shadows of %s are in their primaries' process and die with it; "
                        "give n_workers >= 2 (or leave placement='auto', which gives the shadows a process of "
                        "their own)", f"{n_workers} role process" if plan is None else "this placement", together)
        self._own_transport = transport is None
        self._launched = address is not None           # the launcher owns the roles, not client 0
        try:
            if transport is not None:
                self.client = 0
                self.transport = transport
                start_roles(transport, cfg, transport.n_workers, self._spare_names(), startup_timeout)
            elif group is not None:
                self._start_in_group(startup_timeout, stop_timeout)
            elif address is not None:
                from .rendezvous import join_launched
                self.client = 0 if client is None else client
                self.transport, layout = join_launched(address, cfg, self.client, startup_timeout, stop_timeout)
                # the roles' call timeout, the launcher's: this client's fetches wait a few of them, as the roles do
                # for each other (a frozen constructor is then found within a trainer's next() timeout)
                self.timeout = float(layout["rendezvous"]["rpc_timeout"])
                self.n_workers = int(layout.get("role_workers", self.transport.n_workers))
                self.spares = len(layout.get("spares", []))     # the launcher's: it starts a new Planner there
                self._host_registry(int(layout["fingerprint"]["clients"]))
            else:
                from .rpc_transport import RpcTransport
                self.client = 0
                cfg.pickle_specs()              # while the fork server imports torch
                self.transport = RpcTransport(n_workers + spares, startup_timeout=startup_timeout, rpc_timeout=self.timeout,
                                              stop_timeout=stop_timeout)
                self._fit_workers()
                start_roles(self.transport, cfg, self.n_workers, self._spare_names(), startup_timeout)
            self._connected()
        except BaseException as e:
            if group is not None and self.client == 0 and self.transport is not None:
                self._abort(f"trainer rank 0 could not start the data plane's roles: {type(e).__name__}: {e}")
            self.close()
            raise

    def _abort(self, reason: str) -> None:
        """Tell the other trainer ranks, waiting to attach to the Planner, why the job will not start (they would
        wait for an attach timeout, and rank 0's close for them to leave), if the Planner was started."""
        try:
            self.planner.abort(reason, timeout=5.0).result(10.0)
        except Exception as err:        # noqa: BLE001 - no Planner (it failed first): they learn by their timeout
            log.debug("could not tell the other ranks why the job did not start: %s", err)

    @staticmethod
    def _rank(group) -> int:
        if group is None:
            return 0
        import torch.distributed as dist
        return dist.get_rank(None if group in (True, "default") else group)

    @staticmethod
    def _placement(placement, sources, strategy, mesh, global_batch, seed, constructors, buffer_size, checkpoint_dir,
                   shadows, n_workers, actors, workers, starts_roles):
        """``(plan, workers)`` this process starts the roles with. The plan: the
        :class:`~torchdata_overlord.scaling.Placement` given, or ``"auto"``'s (measured) when this process
        starts the roles and neither ``n_workers`` nor ``actors`` overrides it; None: round robin over
        ``n_workers`` (see ``RoleConfig.placement``), whose actors get the measured transform threads
        (:func:`~torchdata_overlord.scaling.auto.chain_workers`) unless ``workers`` is given."""
        from ..scaling import Placement
        if placement is None or isinstance(placement, Placement):
            if placement is not None and (n_workers is not None or actors != 1):
                raise ConfigError("give either placement= (a Placement) or n_workers=/actors=, not both")
            return placement, workers
        if placement != "auto":
            raise ConfigError(f"placement must be 'auto', a torchdata_overlord.scaling.Placement or None (round robin "
                              f"over n_workers), got {placement!r}")
        from ..sources.base import Source
        if actors != 1 or not starts_roles or not all(isinstance(s, Source) for s in sources):
            return None, workers            # round robin (specs or names only: nothing to profile here)
        from .job_config import usable_cores
        from ..scaling.auto import auto_placement, chain_workers
        if n_workers is not None:
            if workers is None:
                workers = chain_workers(sources, strategy, mesh, global_batch, seed, thread_cores=usable_cores(),
                                        checkpoint_dir=checkpoint_dir)
            return None, workers
        dp = mesh.sizes.get("dp", 1)
        return auto_placement(sources, strategy, mesh, global_batch, seed, constructors or dp,
                              cores=max(1, usable_cores() - 1), shadows=shadows, checkpoint_dir=checkpoint_dir,
                              buffer_size=buffer_size, thread_cores=usable_cores()), workers

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
                dist.broadcast_object_list([{"rendezvous": rendezvous, "where": self.cfg.placement(self.n_workers)}],
                                           src=src, group=pg)
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
            self.transport.place(box[0]["where"])            # rank 0's placement (it may have measured it)

