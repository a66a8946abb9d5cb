"""RpcTransport: actors in role worker processes, reached with torch.distributed.rpc.

An RPC group has *workers* (``overlord-actors-<i>``, processes that host actors) and *clients*
(``overlord-client-<c>``, trainer processes that call them). ``RpcTransport(n_workers, clients=C)``
makes this process client 0 (rank 0) and starts the workers from the multiprocessing fork server
(which preloads torch, so a worker costs a few MiB, not ~300); the other ``C - 1`` clients join
with :meth:`RpcTransport.join` and the :attr:`rendezvous` it publishes (a trainer group passes it
around with its own collectives). Each worker may host several actors (``start_actor(...,
worker=i)``, round-robin by default). The launcher (``torchdata_overlord.launch``) builds the same
group across machines.

One transport is one job. A process has one RPC group at a time (:mod:`.rpc_session`): a transport
opened while this process's group runs shares it, its actors named under its own prefix and placed
on the same workers (``n_workers`` is then the group's); the last transport to stop ends the group,
and the next one starts a new group. A dead peer cannot be replaced (no dynamic membership), and
nobody waits in a group-wide shutdown barrier: where several trainers share the roles, each stops
locally when it is done (in a launched job after telling the launcher, :meth:`leave`).

Loopback only by default: rendezvous goes through a ``file://`` store in a private temporary
directory, not ``tcp://`` (the c10d TCPStore listens on ``::``, every interface, unless given a bound
socket), and TensorPipe is restricted to its ``uv`` transport and ``basic`` channel with
``TP_SOCKET_IFNAME=lo`` and ``GLOO_SOCKET_IFNAME=lo``, so the only listening sockets are on 127.0.0.1.
Between processes of one host a call's tensors skip the socket: they are written into the sender's
shared memory (an unnamed memfd, opened by peers through ``/proc``; see :mod:`.shm`), and the RPC
carries a handle; that opens no socket. The calls themselves take a *lane* once it is open (an
abstract Unix socket, never on the network; see :mod:`.lane`), not TensorPipe.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import itertools
import logging
import threading
from typing import Callable

from ..errors import ConfigError
from . import _rpc_worker as W
from . import rpc_calls as C
from . import rpc_leave as L
from . import rpc_session as S
from .rpc_agent import CPP_ERRORS_ONLY, TransportStartupError, set_cpp_log_level
from .rpc_session import spawn_workers
from .transport import ActorDied, CallTimeout, Transport, TransportClosed, check_timeout, settle

__all__ = ["RpcTransport", "TransportStartupError", "spawn_workers"]
log = logging.getLogger(__name__)


class RpcTransport(Transport):
    """``RpcTransport(n_workers=2, clients=1, startup_timeout=60, rpc_timeout=60, stop_timeout=10,
    start_method="forkserver", on_rendezvous=None)``: start ``n_workers`` role workers with this
    process as client 0 (or share the group this process started already); ``on_rendezvous(rendezvous)``
    is called once the workers are started and before waiting for the other clients (hand it to them).
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
        self.startup_timeout = check_timeout(startup_timeout)
        self.rpc_timeout = check_timeout(rpc_timeout)
        self.stop_timeout = check_timeout(stop_timeout)
        self._closed = False
        self._lock = threading.Lock()
        self._placement: dict[str, int] = {}
        self._started: set[str] = set()
        self._rr = itertools.count()
        if _join is None:
            self.client = 0
            self.session, self.ns = S.open_spawned(n_workers, clients, self.startup_timeout, self.rpc_timeout,
                                                   self.stop_timeout, start_method, on_rendezvous)
        else:
            self.client = _join["client"]
            self.session, self.ns = S.open_joined(_join["rendezvous"], self.client, self.startup_timeout,
                                                  self.stop_timeout, _join.get("abort") or (lambda: None))
        self.rendezvous = dict(self.session.rendezvous, ns=self.ns)
        self.n_workers, self.clients = self.session.n_workers, self.session.clients
        atexit.register(self.stop)

    @classmethod
    def join(cls, rendezvous: dict, client: int, *, startup_timeout: float = 60.0, stop_timeout: float = 10.0,
             abort: Callable[[], str | None] | None = None) -> "RpcTransport":
        """Join the job described by ``rendezvous`` (another transport's :attr:`rendezvous`, or a
        launcher's) as client ``client``; actors are started by client 0 or the launcher. ``abort()``
        may say why to give up waiting for the group early (None: keep waiting)."""
        n, world = int(rendezvous["n_workers"]), int(rendezvous["world_size"])
        first = 0 if "client_ranks" in rendezvous else 1        # client 0 of a spawned group is its spawner
        if isinstance(client, bool) or not isinstance(client, int) or not first <= client < world - n:
            raise ConfigError(f"client must be in [{first}, {world - n}) to join this group, got {client!r}")
        return cls(n, clients=world - n, startup_timeout=startup_timeout, rpc_timeout=rendezvous["rpc_timeout"],
                   stop_timeout=stop_timeout, _join={"rendezvous": rendezvous, "client": client, "abort": abort})

    def key(self, name: str) -> str:
        """Actor ``name`` of this job as registered in the group's processes."""
        return self.ns + name

    @property
    def _procs(self) -> list:
        return self.session.procs

    @property
    def ledger(self) -> str | None:
        """The member that learns when clients leave this job: a launched job's launcher (None otherwise)."""
        return W.client_name(len(self.rendezvous["client_ranks"]) - 1) if self.session.launched else None

    def leave(self, timeout: float = 10.0) -> None:
        """In a launched job, tell the launcher this client is leaving (call before :meth:`stop`;
        errors are logged). Elsewhere client 0 asks the others whether they closed the job."""
        import torch.distributed.rpc as rpc

        ledger = self.ledger
        if ledger is None or ledger == W.client_name(self.client) or self._closed or not self.session.up:
            return
        if self.session.jobs <= {self.ns}:
            # the launcher may end the group as soon as it hears this: its pipes then close while this
            # process's agent still runs, and TensorPipe would warn of the EOF (quiet until the session ends)
            self.session.quiet()
        try:
            rpc.rpc_sync(ledger, L._client_left, args=(self.ns, self.client), timeout=timeout)
        except BaseException as e:           # noqa: BLE001 - the ledger may be gone: leave anyway
            log.warning("client %d could not tell %s it leaves: %s", self.client, ledger, e)

    def wait_for_clients(self, timeout: float) -> list[int]:
        """Client 0 of a job it started: wait until the other clients closed it (or are unreachable:
        stopped, or died), at most ``timeout`` seconds, before the roles stop under them; the clients
        still there. C++ warnings are off meanwhile (a question may meet a client that is stopping)."""
        if self.client != 0 or self.clients == 1 or self.session.launched or not self.session.up:
            return []
        previous = set_cpp_log_level(CPP_ERRORS_ONLY, at_least=True)
        try:
            return L.wait_clients_gone(self.ns, range(1, self.clients), timeout)
        finally:
            if previous is not None:
                set_cpp_log_level(previous)

    def on_stopped(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` if the job's coordinator (the launcher) stops it; from then on
        C++ warnings are off in this process until its group ends (the peers are going away)."""
        def stopped(reason: str) -> None:
            self.session.quiet()
            callback(reason)

        L.on_job_stopped(self.ns, stopped)

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
            fut = rpc.rpc_async(W.worker_name(i), W._create, args=(self.key(name), factory, args, kwargs),
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

    @property
    def started(self) -> frozenset[str]:
        """The actors this process started (or is starting) that did not fail to start."""
        with self._lock:
            return frozenset(self._started)

    def place(self, placement: dict[str, int]) -> None:
        """Record where actors live before they start (so :meth:`peers` can name them to each other),
        or where another member started them (a joining client calls them too)."""
        with self._lock:
            self._placement.update({str(k): int(v) for k, v in placement.items()})

    def call(self, name: str, method: str, *args, timeout: float, direct: bool = False, **kwargs) -> cf.Future:
        timeout = check_timeout(timeout)
        i, died = self._worker(name, method)
        if died is not None:
            return died
        return C.call_actor(W.worker_name(i), name, method, args, kwargs, timeout, on_error=self._map_error,
                            ns=self.ns)

    def ping(self, name: str, timeout: float) -> cf.Future:
        timeout = check_timeout(timeout)
        i, died = self._worker(name, "ping")
        if died is not None:
            return died
        return C.ping_worker(W.worker_name(i), name, timeout, on_error=self._map_error)

    def _worker(self, name: str, method: str) -> tuple[int, cf.Future | None]:
        """The worker index hosting actor ``name``, and a future failed with ActorDied where that process is gone."""
        with self._lock:
            if self._closed:
                raise TransportClosed(f"cannot call {name}.{method}(): the transport is stopped")
            if name not in self._placement:
                raise ConfigError(f"no actor named {name!r}; actors: {sorted(self._placement)}")
            i = self._placement[name]
        if self._procs and not self._procs[i].is_alive():
            out: cf.Future = cf.Future()
            settle(out, exc=self._died(name, method))
            return i, out
        return i, None

    def is_alive(self, name: str) -> bool:
        i = self._placement.get(name)
        return i is not None and not self._closed and (not self._procs or self._procs[i].is_alive())

    def peers(self) -> C.RpcPeers:
        return C.RpcPeers({a: W.worker_name(i) for a, i in self._placement.items()}, self.ns)

    def mark_unhealthy(self) -> None:
        """Some member may be dead or frozen: when the group ends, give its workers less time."""
        self.session.unhealthy = True

    def worker_of(self, name: str) -> int:
        """The 0-based worker index hosting actor ``name``."""
        return self._placement[name]

    def worker_name(self, i: int) -> str:
        return W.worker_name(i)

    def learn(self, where: dict[str, str]) -> None:
        self.place({a: W.worker_index(w) for a, w in where.items()})

    def kill(self, names: list[str]) -> list[int]:
        """SIGKILL the worker processes hosting actors ``names`` (every actor they host dies)."""
        import os
        import signal
        pids = [int(self.call(n, "process", timeout=self.rpc_timeout).result(self.rpc_timeout + 5)["pid"])
                for n in names]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return pids

    def host(self, name: str, obj: object) -> None:
        W._actor(self.key(name)).set(obj)

    def call_client(self, client: int, name: str, method: str, *args, timeout: float) -> cf.Future:
        return C.call_actor(W.client_name(client), name, method, args, {}, timeout, ns=self.ns)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers this process started (empty for a joined client)."""
        return [p.pid for p in self._procs]

    # -------------------------------------------------------------------------------- errors

    def _died(self, name: str, method: str) -> ActorDied:
        i = self._placement[name]
        return ActorDied(f"actor {name!r} is dead: its worker process {W.worker_name(i)} (pid "
                         f"{self._procs[i].pid}) {self._procs[i].describe_exit()} (calling {method}())", name)

    def _map_error(self, e: BaseException, name: str, method: str, timeout: float) -> BaseException:
        err = C.map_error(e, name, method, timeout)
        if isinstance(err, ActorDied):
            self.session.unhealthy = True
        i = self._placement.get(name)
        if isinstance(err, CallTimeout) or i is None or not self._procs:
            return err
        if isinstance(err, ActorDied) and self._procs[i].is_alive():
            self._procs[i].join(0.5)         # the socket closes a moment before the exit is seen
        return self._died(name, method) if not self._procs[i].is_alive() else err

    # -------------------------------------------------------------------------------- stop

    def stop(self) -> None:
        """Leave the group: client 0 of a job that shares its group drops the job's actors; the last
        job of this process ends the group (this process's agent stops locally, then the workers it
        started exit). Idempotent, bounded by ``stop_timeout``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.stop)
        L.mark_closed(self.ns)
        self.session.release(self.ns, drop=self.client == 0 and not self.session.launched)
