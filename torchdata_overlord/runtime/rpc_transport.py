"""RpcTransport: actors in worker processes on this machine, reached with torch.distributed.rpc.

The caller is rank 0 (``overlord-master``); ``n_workers`` processes (ranks 1..n) are started from
the multiprocessing fork server (which preloads torch, so a worker costs a few MiB, not ~300) and
each may host several actors (``start_actor(..., worker=i)``, round-robin by default).

Loopback only: rendezvous goes through a ``file://`` store in a private temporary directory, not
``tcp://`` (the c10d TCPStore listens on ``::``, every interface, whatever host is given), and
TensorPipe is restricted to its ``uv`` transport and ``basic`` channel with ``TP_SOCKET_IFNAME=lo``
and ``GLOO_SOCKET_IFNAME=lo``, so the only listening sockets are on 127.0.0.1.

Limits of torch 2.14.1's rpc that shape this class: one RPC group per process lifetime (a second
``init_rpc`` after ``shutdown`` hangs creating its Gloo group), so one RpcTransport per process;
a dead peer cannot be replaced (no dynamic membership); ``shutdown(graceful=True)`` hangs on a dead
peer, so ``stop()`` only uses it when every worker is alive, and bounds it anyway.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import itertools
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import threading
import time
import warnings
from typing import Callable

from ..errors import ConfigError, OverlordError
from . import _rpc_worker as W
from .transport import (ActorDied, ActorError, CallTimeout, Transport, TransportClosed, check_timeout,
                        name_exception, settle)

__all__ = ["RpcTransport", "TransportStartupError", "MASTER_NAME"]

MASTER_NAME = "overlord-master"
_DEAD_PEER = ("eof", "econnrefused", "connection reset", "connection refused", "broken pipe", "shutdown")
_TIMEOUT = ("timeout", "timed out", "ran for more than")
_USED = threading.Lock()                  # held for the life of the process once rpc was initialised


class TransportStartupError(OverlordError, RuntimeError):
    """The RPC workers did not come up (a worker died or ``startup_timeout`` passed)."""


class RpcTransport(Transport):
    """``RpcTransport(n_workers=2, startup_timeout=60, rpc_timeout=60, stop_timeout=10,
    start_method="forkserver")``. Arguments, factories and results must be picklable (tensors
    travel without an extra copy); ``call`` returns a ``concurrent.futures.Future``."""

    def __init__(self, n_workers: int = 2, *, startup_timeout: float = 60.0, rpc_timeout: float = 60.0,
                 stop_timeout: float = 10.0, start_method: str = "forkserver"):
        if not isinstance(n_workers, int) or isinstance(n_workers, bool) or n_workers < 1:
            raise ConfigError(f"n_workers must be an integer >= 1, got {n_workers!r}")
        if start_method not in ("forkserver", "spawn"):
            raise ConfigError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.n_workers = n_workers
        self.startup_timeout = check_timeout(startup_timeout)
        self.rpc_timeout = check_timeout(rpc_timeout)
        self.stop_timeout = check_timeout(stop_timeout)
        if not _USED.acquire(blocking=False):
            raise TransportClosed("torch.distributed.rpc can be initialised once per process (a second init_rpc "
                                  "hangs in torch 2.14.1): this process already had an RpcTransport")
        self._closed = False
        self._lock = threading.Lock()
        self._placement: dict[str, int] = {}
        self._seq: dict[str, itertools.count] = {}
        self._rr = itertools.count()
        self._procs: list = []
        self._conns: list = []
        self._rpc_up = False
        self._tmp = tempfile.mkdtemp(prefix="overlord-rpc-")
        atexit.register(self.stop)
        try:
            self._start(start_method)
        except BaseException:
            self._teardown(graceful=False)
            raise

    # -------------------------------------------------------------------------------- start-up

    def _start(self, start_method: str) -> None:
        import torch.distributed.rpc as rpc

        os.environ.update(W.LOOPBACK_ENV)
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["torch", "torch.distributed.rpc", W.__name__])
        init_method = f"file://{os.path.join(self._tmp, 'store')}"
        world = self.n_workers + 1
        for rank in range(1, world):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=W.worker_main, args=(rank, world, init_method, self.rpc_timeout, r),
                            name=f"overlord-worker-{rank}", daemon=True)
            p.start()
            r.close()
            self._procs.append(p)
            self._conns.append(w)

        errors: list = []

        def init():
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=W.GLOO_WARNING, category=UserWarning)
                    rpc.init_rpc(MASTER_NAME, rank=0, world_size=world,
                                 rpc_backend_options=W.backend_options(init_method, self.rpc_timeout))
            except BaseException as e:       # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=init, name="overlord-rpc-init", daemon=True)
        t.start()
        deadline = time.monotonic() + self.startup_timeout
        while t.is_alive():
            dead = [p.name for p in self._procs if not p.is_alive()]
            if dead:
                raise TransportStartupError(f"RPC worker(s) {dead} exited during start-up "
                                            f"(exit codes {[p.exitcode for p in self._procs]})")
            if time.monotonic() > deadline:
                raise TransportStartupError(f"RPC workers did not join within startup_timeout="
                                            f"{self.startup_timeout:g} s")
            t.join(0.05)
        if errors:
            raise TransportStartupError(f"init_rpc failed on the master: {errors[0]}") from errors[0]
        self._rpc_up = True

    # -------------------------------------------------------------------------------- actors

    def _worker_name(self, i: int) -> str:
        return f"overlord-worker-{i + 1}"

    def start_actor(self, name: str, factory: Callable[..., object], *args, worker: int | None = None,
                    **kwargs) -> None:
        """Create actor ``name`` on worker ``worker`` (0-based; round-robin when None)."""
        import torch.distributed.rpc as rpc

        with self._lock:
            if self._closed:
                raise TransportClosed(f"cannot start actor {name!r}: the transport is stopped")
            if name in self._placement:
                raise ConfigError(f"an actor named {name!r} already exists")
            i = next(self._rr) % self.n_workers if worker is None else worker
            if not (isinstance(i, int) and 0 <= i < self.n_workers):
                raise ConfigError(f"worker must be in [0, {self.n_workers}), got {worker!r}")
            self._placement[name] = i
        try:
            if not self._procs[i].is_alive():
                raise ActorDied(f"cannot start actor {name!r}: its worker {self._worker_name(i)} is dead")
            fut = rpc.rpc_async(self._worker_name(i), W._create, args=(name, factory, args, kwargs),
                                timeout=self.startup_timeout)
            failure = self._wait_torch(fut, name, "__init__", self.startup_timeout)
        except BaseException:
            with self._lock:
                self._placement.pop(name, None)
            raise
        if isinstance(failure, W.Failure):
            with self._lock:
                self._placement.pop(name, None)
            raise self._rebuild(failure, name, "__init__")
        self._seq[name] = itertools.count()

    def _wait_torch(self, fut, name: str, method: str, timeout: float):
        try:
            return fut.wait()
        except BaseException as e:           # noqa: BLE001
            raise self._map_error(e, name, method, timeout) from e

    def call(self, name: str, method: str, *args, timeout: float, **kwargs) -> cf.Future:
        import torch.distributed.rpc as rpc

        timeout = check_timeout(timeout)
        with self._lock:
            if self._closed:
                raise TransportClosed(f"cannot call {name}.{method}(): the transport is stopped")
            if name not in self._seq:
                raise ConfigError(f"no actor named {name!r}; actors: {sorted(self._seq)}")
            i = self._placement[name]
            seq = next(self._seq[name])
        out: cf.Future = cf.Future()
        if not self._procs[i].is_alive():
            settle(out, exc=self._died(name, method))
            return out
        try:
            fut = rpc.rpc_async(self._worker_name(i), W._invoke, args=(name, seq, method, args, kwargs),
                                timeout=timeout)
        except BaseException as e:           # noqa: BLE001
            settle(out, exc=self._map_error(e, name, method, timeout))
            return out

        def done(f):
            try:
                result = f.value()
            except BaseException as e:       # noqa: BLE001
                settle(out, exc=self._map_error(e, name, method, timeout))
                return
            if isinstance(result, W.Failure):
                settle(out, exc=self._rebuild(result, name, method))
            else:
                settle(out, result)

        fut.add_done_callback(done)
        return out

    def is_alive(self, name: str) -> bool:
        i = self._placement.get(name)
        return i is not None and not self._closed and self._procs[i].is_alive()

    def worker_of(self, name: str) -> int:
        """The 0-based worker index hosting actor ``name``."""
        return self._placement[name]

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -------------------------------------------------------------------------------- errors

    def _died(self, name: str, method: str) -> ActorDied:
        i = self._placement[name]
        return ActorDied(f"actor {name!r} is dead: its worker process {self._worker_name(i)} (pid "
                         f"{self._procs[i].pid}) exited with code {self._procs[i].exitcode} (calling {method}())")

    def _map_error(self, e: BaseException, name: str, method: str, timeout: float) -> BaseException:
        text = str(e).lower()
        if any(s in text for s in _TIMEOUT):
            return CallTimeout(f"{name}.{method}() got no answer within its timeout of {timeout:g} s")
        i = self._placement.get(name)
        dead = i is not None and not self._procs[i].is_alive()
        if not dead and i is not None and any(s in text for s in _DEAD_PEER):
            self._procs[i].join(0.5)         # the socket closes a moment before the exit is seen
            dead = not self._procs[i].is_alive()
        if dead or any(s in text for s in _DEAD_PEER):
            err = self._died(name, method) if i is not None else ActorDied(f"actor {name!r} is dead: {e}")
            return err
        return ActorError(f"{name}.{method}() failed in the transport: {type(e).__name__}: {e}")

    @staticmethod
    def _rebuild(failure: W.Failure, name: str, method: str) -> BaseException:
        exc = None
        if failure.exc_bytes is not None:
            try:
                exc = pickle.loads(failure.exc_bytes)
            except Exception:
                exc = None
        if exc is None:
            exc = ActorError(f"{failure.type_name}: {failure.text}")
        exc = name_exception(exc, name, method)
        exc.add_note("remote traceback:\n" + failure.remote_traceback)
        return exc

    # -------------------------------------------------------------------------------- stop

    def stop(self) -> None:
        """Shut RPC down (gracefully only if every worker is alive), then reap the workers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._teardown(graceful=all(p.is_alive() for p in self._procs))

    def _teardown(self, graceful: bool) -> None:
        import torch.distributed.rpc as rpc

        self._closed = True
        deadline = time.monotonic() + self.stop_timeout
        if self._rpc_up:
            self._rpc_up = False

            def shut():
                try:
                    if graceful:
                        rpc.shutdown(graceful=True, timeout=self.stop_timeout)
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
            t.join(self.stop_timeout)
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
        shutil.rmtree(self._tmp, ignore_errors=True)
        atexit.unregister(self.stop)
