"""RpcTransport: actors in role worker processes, reached with torch.distributed.rpc.

An RPC group has *workers* (``overlord-worker-<i>``, processes that host actors) and *clients*
(``overlord-client-<c>``, trainer processes that call them). ``RpcTransport(n_workers, clients=C)``
makes this process client 0 (rank 0) and starts the workers from the multiprocessing fork server
(which preloads torch, so a worker costs a few MiB, not ~300); the other ``C - 1`` clients join
with :meth:`RpcTransport.join` and the :attr:`rendezvous` it publishes (a trainer group passes it
around with its own collectives). Each worker may host several actors (``start_actor(...,
worker=i)``, round-robin by default). The launcher (``torchdata_overlord.launch``) builds the same
group across machines.

Loopback only by default: rendezvous goes through a ``file://`` store in a private temporary
directory, not ``tcp://`` (the c10d TCPStore listens on ``::``, every interface, whatever host is
given), and TensorPipe is restricted to its ``uv`` transport and ``basic`` channel with
``TP_SOCKET_IFNAME=lo`` and ``GLOO_SOCKET_IFNAME=lo``, so the only listening sockets are on 127.0.0.1.

Limits of torch 2.14.1's rpc that shape this class: one RPC group per process lifetime (a second
``init_rpc`` after ``shutdown`` hangs creating its Gloo group), so one RpcTransport per process;
a dead peer cannot be replaced (no dynamic membership); ``shutdown(graceful=True)`` hangs on a dead
peer, so ``stop()`` bounds it and falls back to a non-graceful shutdown, and it is a barrier of the
whole group, so only a group's single client uses it: where several trainers share the roles, each
:meth:`leave` s (tells the coordinator) and shuts down locally when it is done.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from typing import Callable

from ..errors import ConfigError, OverlordError
from . import _rpc_worker as W
from .transport import ActorDied, CallTimeout, Transport, TransportClosed, check_timeout, settle

__all__ = ["RpcTransport", "TransportStartupError"]
log = logging.getLogger(__name__)

_USED = threading.Lock()                  # held for the life of the process once rpc was initialised


def claim_rpc() -> None:
    """Mark this process as having started torch.distributed.rpc (possible once per process)."""
    if not _USED.acquire(blocking=False):
        raise TransportClosed("torch.distributed.rpc can be initialised once per process (a second init_rpc "
                              "hangs in torch 2.14.1): this process already had an RpcTransport")


#: what the fork server imports once, so every worker (spares included) starts with it in shared pages
PRELOAD = ["torch", "torch.distributed.rpc", "pyarrow.parquet", W.__name__, "torchdata_overlord.runtime.planner_actor",
           "torchdata_overlord.transforms"]


def spawn_workers(members: list[tuple[str, int]], rendezvous: dict, rpc_timeout: float,
                  start_method: str = "forkserver") -> tuple[list, list]:
    """Start one role worker process per ``(name, rank)``; each exits when its pipe (the second
    list) is closed or its parent dies. Workers come from the fork server, which preloads torch."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    procs, conns = [], []
    for name, rank in members:
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=W.worker_main, args=(name, rank, rendezvous["world_size"], rendezvous["init_method"],
                                                    rpc_timeout, r, rendezvous.get("env", {})),
                        name=name, daemon=True)
        p.start()
        r.close()
        procs.append(p)
        conns.append(w)
    return procs, conns


def start_rpc(name: str, rank: int, world_size: int, init_method: str, rpc_timeout: float,
              startup_timeout: float, alive: Callable[[], list[str]] = lambda: []) -> None:
    """``init_rpc`` in a thread, bounded by ``startup_timeout``; ``alive()`` names dead helpers to fail fast."""
    from .rendezvous import register

    register()
    errors: list = []

    def init():
        try:
            W.init_rpc(name, rank, world_size, init_method, rpc_timeout)
        except BaseException as e:       # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=init, name="overlord-rpc-init", daemon=True)
    t.start()
    deadline = time.monotonic() + startup_timeout
    while t.is_alive():
        dead = alive()
        if dead:
            raise TransportStartupError(f"RPC process(es) {dead} exited during start-up")
        if time.monotonic() > deadline:
            raise TransportStartupError(f"the RPC group of {world_size} processes did not assemble within "
                                        f"startup_timeout={startup_timeout:g} s (a member never joined)")
        t.join(0.05)
    if errors:
        raise TransportStartupError(f"init_rpc failed for {name}: {errors[0]}") from errors[0]


def stop_rpc(graceful: bool, timeout: float) -> None:
    """``rpc.shutdown``, graceful (every member) at most ``timeout`` seconds, else non-graceful."""
    import torch.distributed.rpc as rpc

    def shut():
        try:
            if graceful:
                rpc.shutdown(graceful=True, timeout=timeout)
            else:
                rpc.shutdown(graceful=False)
        except BaseException:        # noqa: BLE001
            if graceful:
                try:
                    rpc.shutdown(graceful=False)
                except BaseException:  # noqa: BLE001
                    pass

    t = threading.Thread(target=shut, name="overlord-rpc-shutdown", daemon=True)
    t.start()
    t.join(timeout + 2)
    if t.is_alive():
        log.error("rpc.shutdown did not finish within %g s; RPC threads may still run", timeout + 2)


class TransportStartupError(OverlordError, RuntimeError):
    """The RPC workers did not come up (a worker died or ``startup_timeout`` passed)."""


class RpcTransport(Transport):
    """``RpcTransport(n_workers=2, clients=1, startup_timeout=60, rpc_timeout=60, stop_timeout=10,
    start_method="forkserver", on_rendezvous=None)``: start ``n_workers`` role workers with this
    process as client 0; ``on_rendezvous(rendezvous)`` is called once the workers are started and
    before waiting for the other clients (hand it to them).
    Arguments, factories and results must be picklable (tensors travel without an extra copy);
    ``call`` returns a ``concurrent.futures.Future``."""

    def __init__(self, n_workers: int = 2, *, clients: int = 1, startup_timeout: float = 60.0,
                 rpc_timeout: float = 60.0, stop_timeout: float = 10.0, start_method: str = "forkserver",
                 on_rendezvous: Callable[[dict], None] | None = None, _join: dict | None = None):
        for arg, v in (("n_workers", n_workers), ("clients", clients)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{arg} must be an integer >= 1, got {v!r}")
        if start_method not in ("forkserver", "spawn"):
            raise ConfigError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.n_workers, self.clients = n_workers, clients
        self.startup_timeout = check_timeout(startup_timeout)
        self.rpc_timeout = check_timeout(rpc_timeout)
        self.stop_timeout = check_timeout(stop_timeout)
        claim_rpc()
        self._closed = False
        self._lock = threading.Lock()
        self._placement: dict[str, int] = {}
        self._started: set[str] = set()
        self._rr = itertools.count()
        self._procs: list = []
        self._conns: list = []
        self._rpc_up = False
        self._peer_died = False
        self._tmp = None
        atexit.register(self.stop)
        try:
            if _join is None:
                self._tmp = tempfile.mkdtemp(prefix="overlord-rpc-")
                self.rendezvous = {"init_method": f"file://{os.path.join(self._tmp, 'store')}",
                                   "world_size": n_workers + clients, "n_workers": n_workers,
                                   "rpc_timeout": self.rpc_timeout, "env": dict(W.LOOPBACK_ENV)}
                self.client = 0
                self._spawn(start_method, on_rendezvous)
            else:
                self.rendezvous = dict(_join["rendezvous"])
                self.client = _join["client"]
                os.environ.update(self.rendezvous.get("env", {}))
                start_rpc(W.client_name(self.client), self.client_rank(self.client), self.rendezvous["world_size"],
                          self.rendezvous["init_method"], self.rpc_timeout, self.startup_timeout)
            self._rpc_up = True
        except BaseException:
            self._teardown(graceful=False)
            raise

    @classmethod
    def join(cls, rendezvous: dict, client: int, *, startup_timeout: float = 60.0, stop_timeout: float = 10.0
             ) -> "RpcTransport":
        """Join the group described by ``rendezvous`` (another transport's :attr:`rendezvous`, or a
        launcher's) as client ``client``; actors are started by client 0 or the launcher."""
        n, world = int(rendezvous["n_workers"]), int(rendezvous["world_size"])
        first = 0 if "client_ranks" in rendezvous else 1        # client 0 of a spawned group is its spawner
        if isinstance(client, bool) or not isinstance(client, int) or not first <= client < world - n:
            raise ConfigError(f"client must be in [{first}, {world - n}) to join this group, got {client!r}")
        return cls(n, clients=world - n, startup_timeout=startup_timeout, rpc_timeout=rendezvous["rpc_timeout"],
                   stop_timeout=stop_timeout, _join={"rendezvous": rendezvous, "client": client})

    @property
    def coordinator(self) -> str | None:
        """The member that learns when clients leave: a launched job's launcher, else client 0; None
        when this process is the group's only client."""
        if "client_ranks" in self.rendezvous:
            return W.client_name(len(self.rendezvous["client_ranks"]) - 1)
        return W.client_name(0) if self.clients > 1 else None

    def leave(self, timeout: float = 10.0) -> None:
        """Tell the coordinator this client is leaving (call before :meth:`stop`; errors are logged)."""
        import torch.distributed.rpc as rpc

        coordinator = self.coordinator
        if coordinator is None or coordinator == W.client_name(self.client) or not self._rpc_up:
            return
        try:
            rpc.rpc_sync(coordinator, W._client_left, args=(self.client,), timeout=timeout)
        except BaseException as e:           # noqa: BLE001 - the coordinator may be gone: leave anyway
            log.warning("client %d could not tell %s it leaves: %s", self.client, coordinator, e)

    def wait_for_clients(self, timeout: float) -> list[int]:
        """Client 0 of a group it started: wait until the other clients left (or are unreachable),
        at most ``timeout`` seconds, before the workers stop under them; the clients still there."""
        if self.client != 0 or self.clients == 1 or "client_ranks" in self.rendezvous or not self._rpc_up:
            return []
        return W.wait_clients_left(range(1, self.clients), timeout)

    def client_rank(self, c: int) -> int:
        """RPC rank of client ``c``: client 0 is rank 0 and workers 1..n unless the rendezvous says otherwise."""
        if "client_ranks" in self.rendezvous:
            return int(self.rendezvous["client_ranks"][c])
        return 0 if c == 0 else self.n_workers + c

    # -------------------------------------------------------------------------------- start-up

    def _spawn(self, start_method: str, on_rendezvous: Callable[[dict], None] | None) -> None:
        os.environ.update(W.LOOPBACK_ENV)
        rv = self.rendezvous
        self._procs, self._conns = spawn_workers([(W.worker_name(i), i + 1) for i in range(self.n_workers)], rv,
                                                 self.rpc_timeout, start_method)
        if on_rendezvous is not None:        # the other clients learn how to join (before we wait for them)
            on_rendezvous(dict(rv))
        start_rpc(W.client_name(0), 0, rv["world_size"], rv["init_method"], self.rpc_timeout, self.startup_timeout,
                  alive=lambda: [f"{p.name} (exit code {p.exitcode})" for p in self._procs if not p.is_alive()])

    # -------------------------------------------------------------------------------- actors

    def start_actor(self, name: str, factory: Callable[..., object], *args, worker: int | None = None,
                    **kwargs) -> None:
        """Create actor ``name`` on worker ``worker`` (0-based; round-robin when None)."""
        import torch.distributed.rpc as rpc

        with self._lock:
            if self._closed:
                raise TransportClosed(f"cannot start actor {name!r}: the transport is stopped")
            if name in self._started:
                raise ConfigError(f"an actor named {name!r} already exists")
            i = next(self._rr) % self.n_workers if worker is None else worker
            if not (isinstance(i, int) and 0 <= i < self.n_workers):
                raise ConfigError(f"worker must be in [0, {self.n_workers}), got {worker!r}")
            if self._placement.get(name, i) != i:
                raise ConfigError(f"actor {name!r} was placed on worker {self._placement[name]}, not {i}")
            placed_before = name in self._placement
            self._placement[name] = i
            self._started.add(name)
        try:
            if self._procs and not self._procs[i].is_alive():
                raise ActorDied(f"cannot start actor {name!r}: its worker {W.worker_name(i)} is dead", name)
            fut = rpc.rpc_async(W.worker_name(i), W._create, args=(name, factory, args, kwargs),
                                timeout=self.startup_timeout)
            try:
                failure = fut.wait()
            except BaseException as e:           # noqa: BLE001
                raise self._map_error(e, name, "__init__", self.startup_timeout) from e
            if isinstance(failure, W.Failure):
                raise failure.rebuild(name, "__init__")
        except BaseException:
            with self._lock:                     # not started: the name may be started again elsewhere
                self._started.discard(name)
                if not placed_before:
                    self._placement.pop(name, None)
            raise

    def place(self, placement: dict[str, int]) -> None:
        """Record where actors live before they start (so :meth:`peers` can name them to each other),
        or where another member started them (a joining client calls them too)."""
        with self._lock:
            self._placement.update({str(k): int(v) for k, v in placement.items()})

    def call(self, name: str, method: str, *args, timeout: float, **kwargs) -> cf.Future:
        timeout = check_timeout(timeout)
        with self._lock:
            if self._closed:
                raise TransportClosed(f"cannot call {name}.{method}(): the transport is stopped")
            if name not in self._placement:
                raise ConfigError(f"no actor named {name!r}; actors: {sorted(self._placement)}")
            i = self._placement[name]
        if self._procs and not self._procs[i].is_alive():
            out: cf.Future = cf.Future()
            settle(out, exc=self._died(name, method))
            return out
        return W.call_actor(W.worker_name(i), name, method, args, kwargs, timeout, on_error=self._map_error)

    def is_alive(self, name: str) -> bool:
        i = self._placement.get(name)
        return i is not None and not self._closed and (not self._procs or self._procs[i].is_alive())

    def peers(self) -> W.RpcPeers:
        return W.RpcPeers({a: W.worker_name(i) for a, i in self._placement.items()})

    def mark_unhealthy(self) -> None:
        """Some member may be dead or frozen: stop without waiting for a graceful shutdown."""
        self._peer_died = True

    def worker_of(self, name: str) -> int:
        """The 0-based worker index hosting actor ``name``."""
        return self._placement[name]

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers this transport started (empty for a joined client)."""
        return [p.pid for p in self._procs]

    # -------------------------------------------------------------------------------- errors

    def _died(self, name: str, method: str) -> ActorDied:
        i = self._placement[name]
        return ActorDied(f"actor {name!r} is dead: its worker process {W.worker_name(i)} (pid "
                         f"{self._procs[i].pid}) exited with code {self._procs[i].exitcode} (calling {method}())", name)

    def _map_error(self, e: BaseException, name: str, method: str, timeout: float) -> BaseException:
        err = W.map_error(e, name, method, timeout)
        if isinstance(err, ActorDied):
            self._peer_died = True            # a graceful shutdown would wait for it in vain
        i = self._placement.get(name)
        if isinstance(err, CallTimeout) or i is None or not self._procs:
            return err
        if isinstance(err, ActorDied) and self._procs[i].is_alive():
            self._procs[i].join(0.5)         # the socket closes a moment before the exit is seen
        return self._died(name, method) if not self._procs[i].is_alive() else err

    # -------------------------------------------------------------------------------- stop

    def stop(self) -> None:
        """Shut RPC down (gracefully, bounded, when every worker is alive), then reap the workers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # the shutdown barrier only when this is the group's one client: other clients leave on their own
        self._teardown(graceful=self.clients == 1 and not self._peer_died and all(p.is_alive() for p in self._procs))

    def _teardown(self, graceful: bool) -> None:
        self._closed = True
        # after a failure a worker may be frozen (it never reads its pipe): kill stragglers sooner
        deadline = time.monotonic() + (self.stop_timeout if graceful else 2.0)
        if self._rpc_up:
            self._rpc_up = False
            stop_rpc(graceful, self.stop_timeout)
        for c in self._conns:                # EOF on the pipe: every worker exits
            try:
                c.close()
            except OSError:
                pass
        for p in self._procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(2.0)
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
        atexit.unregister(self.stop)
