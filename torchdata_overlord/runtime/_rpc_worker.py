"""What runs inside an RpcTransport worker process: the actor registry and the RPC entry points.

Each actor has its own thread; calls carry a per-actor sequence number from the caller, and the
actor thread runs them strictly in that order (RPC requests may arrive on different TensorPipe
threads out of order). ``_invoke`` is an ``async_execution`` function: it only queues the call
and returns a future, so a slow actor never holds an RPC thread.
"""

from __future__ import annotations

import os
import pickle
import threading
import traceback
import warnings

import torch
import torch.distributed.rpc as rpc

#: the one Gloo deprecation warning every ``init_rpc`` prints (torch 2.14.1)
GLOO_WARNING = r"You are using a Backend .* as a ProcessGroup"
#: interface environment for TensorPipe and Gloo: loopback only
LOOPBACK_ENV = {"TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}


def backend_options(init_method: str, rpc_timeout: float) -> rpc.TensorPipeRpcBackendOptions:
    # uv (TCP) transport and the basic channel only: no shared-memory or multiplexed-uv listeners
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=rpc_timeout,
                                           num_worker_threads=8, _transports=["uv"], _channels=["basic"])


class Failure:
    """An exception raised by an actor's method, shipped back as a normal result."""

    def __init__(self, exc: BaseException):
        self.type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        self.text = str(exc)
        self.remote_traceback = "".join(traceback.format_exception(exc))
        try:
            self.exc_bytes = pickle.dumps(exc)
            pickle.loads(self.exc_bytes)
        except Exception:
            self.exc_bytes = None


class _Actor:
    def __init__(self, name: str, obj: object):
        self.name, self.obj = name, obj
        self.cv = threading.Condition()
        self.pending: dict[int, tuple] = {}
        self.next_seq = 0
        self.thread = threading.Thread(target=self._run, name=f"overlord-actor-{name}", daemon=True)
        self.thread.start()

    def submit(self, seq: int, method: str, args, kwargs) -> torch.futures.Future:
        fut = torch.futures.Future()
        with self.cv:
            self.pending[seq] = (fut, method, args, kwargs)
            self.cv.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self.cv:
                while self.next_seq not in self.pending:
                    self.cv.wait()
                fut, method, args, kwargs = self.pending.pop(self.next_seq)
                self.next_seq += 1
            try:
                result = getattr(self.obj, method)(*args, **kwargs)
            except BaseException as e:      # noqa: BLE001 - delivered to the caller
                result = Failure(e)
            fut.set_result(result)


_ACTORS: dict[str, _Actor] = {}


def _create(name: str, factory, args, kwargs) -> None:
    try:
        obj = factory(*args, **kwargs)
    except BaseException as e:             # noqa: BLE001
        return Failure(e)
    _ACTORS[name] = _Actor(name, obj)
    return None


@rpc.functions.async_execution
def _invoke(name: str, seq: int, method: str, args, kwargs) -> torch.futures.Future:
    actor = _ACTORS.get(name)
    if actor is None:
        fut = torch.futures.Future()
        fut.set_result(Failure(KeyError(f"no actor named {name!r} on {rpc.get_worker_info().name}")))
        return fut
    return actor.submit(seq, method, args, kwargs)


def _watch_master(conn) -> None:
    """Exit this process as soon as the master closes its end of the pipe (stop, crash, kill)."""
    try:
        conn.recv()
    except BaseException:                   # noqa: BLE001 - EOF: the master is gone
        pass
    os._exit(0)


def worker_main(rank: int, world_size: int, init_method: str, rpc_timeout: float, conn) -> None:
    os.environ.update(LOOPBACK_ENV)
    threading.Thread(target=_watch_master, args=(conn,), name="overlord-master-watch", daemon=True).start()
    warnings.filterwarnings("ignore", message=GLOO_WARNING, category=UserWarning)
    rpc.init_rpc(f"overlord-worker-{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=backend_options(init_method, rpc_timeout))
    rpc.shutdown(graceful=True)             # serves calls until the master shuts down too
    os._exit(0)
