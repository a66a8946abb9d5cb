"""Calls out of any process of an RPC group to the actors of a job: ordered, timed, packed.

Each call takes the next number in its (caller process, actor) sequence, which the actor's process
uses to run the caller's calls in order (see :mod:`._rpc_worker`). A call to an actor of this very
process skips RPC; any other travels as one pickle and one tensor buffer (:mod:`.wire`), the buffer in
shared memory when the actor's process shares this host (:mod:`.shm`), and the call on a Unix socket
instead of TensorPipe once that process's lane is open (:mod:`.lane`).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os

import torch.distributed.rpc as rpc

from ._rpc_worker import (_SEQ, _SEQ_LOCK, Failure, _actor, _closed_job, _create, _invoke, _pid, lane_deadlines,
                          local_deadlines)
from .lane import route
from .rpc_agent import self_name
from .transport import ActorDied, ActorError, CallTimeout, settle
from .wire import discard, pack, unpack

__all__ = ["call_actor", "map_error", "ping_worker", "RpcPeers"]

_DEAD_PEER = ("eof", "econnrefused", "connection reset", "connection refused", "broken pipe", "shutdown")
_TIMEOUT = ("timeout", "timed out", "ran for more than")


def map_error(e: BaseException, actor: str, method: str, timeout: float) -> BaseException:
    """An RPC-level failure as CallTimeout (no answer in time) or ActorDied (peer gone)."""
    text = str(e).lower()
    if any(s in text for s in _TIMEOUT):
        return CallTimeout(f"{actor}.{method}() got no answer within its timeout of {timeout:g} s", actor)
    if any(s in text for s in _DEAD_PEER):
        return ActorDied(f"actor {actor!r} is unreachable, its process is gone ({method}()): {e}", actor)
    return ActorError(f"{actor}.{method}() failed in the transport: {type(e).__name__}: {e}")


def call_actor(worker: str, actor: str, method: str, args, kwargs, timeout: float,
               on_error=map_error, ns: str = "", direct: bool = False) -> cf.Future:
    """Call ``actor.method(*args, **kwargs)`` of job ``ns`` on RPC worker ``worker``; a concurrent
    future (errors name ``actor``, without the job prefix). An actor of this very process is called
    without RPC: no pickling, no socket, arguments passed by reference (as between the actors of
    ``runtime="local"``), in the same order and under the same timeout as any call; ``direct`` (see
    ``Transport.call``) runs it on this thread when the actor is idle."""
    caller = self_name()
    out: cf.Future = cf.Future()
    local = worker == caller
    if not local:
        try:
            payload = pack((args, kwargs), peer=worker)
        except Exception as e:             # noqa: BLE001 - nothing was sent: the order is untouched
            settle(out, exc=ActorError(f"{actor}.{method}(): its arguments do not pickle: {type(e).__name__}: {e}"))
            return out
    key = ns + actor
    with _SEQ_LOCK:
        seq = next(_SEQ.setdefault(key, itertools.count()))

    def answer(result) -> None:
        if isinstance(result, Failure):
            settle(out, exc=result.rebuild(actor, method))
        else:
            settle(out, result)

    if local:
        target = _actor(key)
        if target is None:
            answer(_closed_job(key))
            return out
        local_deadlines().add(out, timeout, lambda: CallTimeout(
            f"{actor}.{method}() got no answer within its timeout of {timeout:g} s", actor))
        target.submit(caller, seq, method, args, kwargs, answer, inline=direct)
        return out

    def arrived(packed) -> None:
        try:
            result = unpack(*packed)
        except Exception as e:             # noqa: BLE001
            settle(out, exc=ActorError(f"{actor}.{method}(): its answer does not unpickle here: "
                                       f"{type(e).__name__}: {e}"))
            return
        answer(result)

    def failed(e: BaseException) -> None:
        settle(out, exc=on_error(e, actor, method, timeout))

    lane = route(worker)
    if lane is not None and lane.call(key, caller, seq, method, payload, arrived, failed):
        lane_deadlines().add(out, timeout, lambda: on_error(TimeoutError("timed out"), actor, method, timeout))
        return out
    try:
        fut = rpc.rpc_async(worker, _invoke, args=(key, caller, seq, method, *payload), timeout=timeout)
    except BaseException as e:             # noqa: BLE001
        discard(payload[1])
        failed(e)
        return out

    def done(f):
        try:
            packed = f.value()
        except BaseException as e:         # noqa: BLE001
            failed(e)
            return
        arrived(packed)

    fut.add_done_callback(done)
    return out


def ping_worker(worker: str, actor: str, timeout: float, on_error=map_error) -> cf.Future:
    """Whether the process hosting ``actor`` (RPC worker ``worker``) answers at all: a future of its pid, or
    of :class:`CallTimeout` / :class:`ActorDied` naming ``actor``. Answered by that process's RPC threads,
    never queued behind its actors' calls: a process whose actors are busy (a Planner replacing a loader)
    answers at once, a frozen (SIGSTOP) or dead one does not. Not over a lane: its reader is one thread."""
    out: cf.Future = cf.Future()
    if worker == self_name():
        settle(out, os.getpid())
        return out
    try:
        fut = rpc.rpc_async(worker, _pid, timeout=timeout)
    except BaseException as e:             # noqa: BLE001
        settle(out, exc=on_error(e, actor, "ping", timeout))
        return out

    def done(f):
        try:
            settle(out, int(f.value()))
        except BaseException as e:         # noqa: BLE001
            settle(out, exc=on_error(e, actor, "ping", timeout))

    fut.add_done_callback(done)
    return out


class RpcPeers:
    """Calls from any process of the group to the actors of job ``ns`` by name (``placement``: actor
    -> RPC worker name).

    Picklable: a role receives one to talk to the other roles (a loader to its constructors).
    """

    def __init__(self, placement: dict[str, str], ns: str = ""):
        self.placement, self.ns = dict(placement), ns

    def call(self, name: str, method: str, *args, timeout: float, direct: bool = False, **kwargs) -> cf.Future:
        return call_actor(self.placement[name], name, method, args, kwargs, timeout, ns=self.ns, direct=direct)

    def ping(self, name: str, timeout: float) -> cf.Future:
        """Whether actor ``name``'s process answers (see :func:`ping_worker`)."""
        return ping_worker(self.placement[name], name, timeout)

    def spawn(self, name: str, factory, args: tuple, worker: str, timeout: float = 60.0) -> None:
        """Start a (replacement) actor on RPC worker ``worker`` and remember where it lives."""
        self.spawn_async(name, factory, args, worker, timeout).result(timeout + 5)

    def spawn_async(self, name: str, factory, args: tuple, worker: str, timeout: float = 60.0) -> cf.Future:
        """:meth:`spawn` without waiting: the future completes (None) once the actor exists, and
        only then is it placed."""
        out: cf.Future = cf.Future()
        try:
            fut = rpc.rpc_async(worker, _create, args=(self.ns + name, factory, args, {}), timeout=timeout)
        except BaseException as e:          # noqa: BLE001
            settle(out, exc=map_error(e, name, "__init__", timeout))
            return out

        def done(f):
            try:
                failure = f.value()
            except BaseException as e:      # noqa: BLE001
                settle(out, exc=map_error(e, name, "__init__", timeout))
                return
            if isinstance(failure, Failure):
                settle(out, exc=failure.rebuild(name, "__init__"))
            else:
                self.placement[name] = worker
                settle(out, None)

        fut.add_done_callback(done)
        return out

    def learn(self, where: dict[str, str]) -> None:
        """Placement news (actor -> RPC worker name), e.g. a replacement started elsewhere."""
        self.placement.update(where)

    def where(self, name: str) -> str:
        return self.placement[name]
