"""What runs in every process of an RPC group: the actor registry, ordered dispatch, and calls out.

Each actor has its own thread. Calls carry ``(caller, seq)``: a sequence number per calling process
and target actor, so the actor runs each caller's calls strictly in the order they were made (RPC
requests may arrive on different TensorPipe threads out of order), and different callers' calls in
arrival order. ``_invoke`` is an ``async_execution`` function: it only queues the call and returns a
future, so a slow actor never holds an RPC thread. A method may return a
:class:`concurrent.futures.Future` (a *deferred* result, e.g. "the step once it is built"): the
actor thread moves on and the caller is answered when that future completes. A call that arrives
before its actor exists waits for it (roles are created by one process while others already call).
A call's arguments and answer travel as one pickle and one tensor buffer (:mod:`.wire`); calls out
are in :mod:`.rpc_calls` (a call to an actor of the caller's own process skips RPC altogether, and one
to a process of the same host takes its :mod:`.lane` once open).

Several jobs may share one RPC group (see :mod:`.rpc_session`): an actor is registered under its
job's prefix (``"<ns><name>"``, ``ns`` like ``"2/"``; ``""`` in a launched job), and a closed job's
actors are dropped from every process (:func:`_drop`), after which calls to them fail at once.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import gc
import itertools
import os
import pickle
import signal
import sys
import threading
import traceback
from typing import Callable

import torch
import torch.distributed.rpc as rpc

from .rpc_agent import CPP_ERRORS_ONLY, LOOPBACK_ENV, init_rpc, set_cpp_log_level
from . import shm
from .wire import pack, unpack
from .transport import ActorError, Deadlines, TransportClosed, name_exception


def worker_name(i: int) -> str:
    """Sorts before every client's name on purpose: torch's start-up all-gather is led by the smallest
    name, and every member opens a pipe to the leader. A role worker outlives the clients, so no
    trainer ever has a peer's pipe close under its running agent (TensorPipe warns of each one)."""
    return f"overlord-actors-{i}"


def worker_index(name: str) -> int:
    """The index ``i`` of ``overlord-actors-<i>``."""
    return int(str(name).rsplit("-", 1)[1])


def client_name(c: int) -> str:
    return f"overlord-client-{c}"


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

    def rebuild(self, actor: str, method: str) -> BaseException:
        """The original exception (its type kept where it unpickles), naming the actor and method."""
        exc = None
        if self.exc_bytes is not None:
            try:
                exc = pickle.loads(self.exc_bytes)
            except Exception:
                exc = None
        if exc is None:
            exc = ActorError(f"{self.type_name}: {self.text}")
        exc = name_exception(exc, actor, method)
        exc.add_note("remote traceback:\n" + self.remote_traceback)
        return exc


def _outcome(f: cf.Future):
    try:
        return f.result()
    except BaseException as e:              # noqa: BLE001 - delivered to the caller
        return Failure(e)


class _Actor:
    _UNSET = object()

    def __init__(self, name: str):
        self.name, self.obj, self.failure = name, self._UNSET, None
        self.cv = threading.Condition()
        self.pending: dict[str, dict[int, tuple]] = collections.defaultdict(dict)   # caller -> seq -> call
        self.next_seq: dict[str, int] = collections.defaultdict(int)
        self.ready: collections.deque = collections.deque()
        self.busy = False                   # one of its calls runs (on its thread, or inline on a caller's)
        self.thread = threading.Thread(target=self._run, name=f"overlord-actor-{name}", daemon=True)
        self.thread.start()

    def set(self, obj=_UNSET, failure: Failure | None = None) -> None:
        with self.cv:
            self.obj, self.failure = obj, failure
            self.cv.notify_all()

    def submit(self, caller: str, seq: int, method: str | None, args, kwargs, reply: Callable[[object], None],
               inline: bool = False) -> None:
        """Queue call ``seq`` of ``caller`` (run in ``seq`` order per caller); ``reply(result)`` gets its
        return value, or a :class:`Failure`. ``inline``: the caller is in this process and waits for the
        answer at once (see ``Transport.call``'s ``direct``): when the actor is idle with nothing
        queued, the call runs on the caller's thread (no thread hand-over)."""
        with self.cv:
            mine = self.pending[caller]
            nxt = self.next_seq[caller]
            run_here = (inline and seq == nxt and not mine and not self.ready and not self.busy
                        and self.obj is not self._UNSET and self.failure is None)
            if run_here:
                self.next_seq[caller], self.busy = nxt + 1, True
            else:
                mine[seq] = (reply, method, args, kwargs)
                while nxt in mine:
                    self.ready.append(mine.pop(nxt))
                    nxt += 1
                self.next_seq[caller] = nxt
                self.cv.notify_all()
        if run_here:
            try:
                self._execute(reply, method, args, kwargs)
            finally:
                with self.cv:
                    self.busy = False
                    if self.ready:
                        self.cv.notify_all()

    def stop(self) -> None:
        """End the actor's thread once the calls already queued ran (its job was closed)."""
        with self.cv:
            self.ready.append(None)
            if self.obj is self._UNSET and self.failure is None:
                self.failure = Failure(TransportClosed(f"actor {self.name!r} was dropped before it was created"))
            self.cv.notify_all()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.ready or self.busy or (self.obj is self._UNSET and self.failure is None):
                    self.cv.wait()
                item = self.ready.popleft()
                self.busy = item is not None
            if item is None:
                return
            try:
                self._execute(*item)
            finally:
                with self.cv:
                    self.busy = False

    def _execute(self, reply: Callable[[object], None], method: str | None, args, kwargs) -> None:
        if self.failure is not None:
            reply(self.failure)
            return
        try:
            if method is None:              # the call's arguments could not be unpickled here
                raise args[0]
            result = getattr(self.obj, method)(*args, **kwargs)
        except BaseException as e:          # noqa: BLE001 - delivered to the caller
            result = Failure(e)
        if isinstance(result, cf.Future):
            result.add_done_callback(lambda f: reply(_outcome(f)))
        else:
            reply(result)


_ACTORS: dict[str, _Actor] = {}
_ACTORS_LOCK = threading.Lock()
_DROPPED: set[str] = set()                  # namespaces of closed jobs (see _drop)


def namespace(key: str) -> str:
    """The job prefix of actor key ``key`` (``"2/planner"`` -> ``"2/"``; ``""`` without one)."""
    return key[:key.index("/") + 1] if "/" in key else ""


def _actor(name: str) -> _Actor | None:
    """The actor registered as ``name`` (created empty: calls may arrive first); None once its job closed."""
    with _ACTORS_LOCK:
        actor = _ACTORS.get(name)
        if actor is None:
            if namespace(name) in _DROPPED:
                return None
            actor = _ACTORS[name] = _Actor(name)
        return actor


def _closed_job(name: str) -> Failure:
    return Failure(TransportClosed(f"actor {name!r} belongs to a job that was closed"))


def _drop(ns: str) -> int:
    """Run in every process of a shared group when job ``ns`` closes: stop and forget its actors."""
    if not ns:
        raise ValueError("only a job's own namespace can be dropped")
    with _ACTORS_LOCK:
        _DROPPED.add(ns)
        mine = [k for k in _ACTORS if k.startswith(ns)]
        actors = [_ACTORS.pop(k) for k in mine]
    with _SEQ_LOCK:
        for k in [k for k in _SEQ if k.startswith(ns)]:
            del _SEQ[k]
    for a in actors:
        a.stop()
    return len(actors)


def forget_actors() -> None:
    """This process left its RPC group: forget every actor and call counter (the next group numbers
    its jobs and calls from 0 again)."""
    with _ACTORS_LOCK:
        actors = list(_ACTORS.values())
        _ACTORS.clear()
        _DROPPED.clear()
    with _SEQ_LOCK:
        _SEQ.clear()
        deadlines = [d for kind in _DEADLINES for d in kind]
        for kind in _DEADLINES:
            kind.clear()
    for a in actors:
        a.stop()
    for d in deadlines:
        d.close()


def _create(name: str, factory, args, kwargs):
    actor = _actor(name)
    if actor is None:
        return _closed_job(name)
    if actor.obj is not _Actor._UNSET:
        return Failure(KeyError(f"an actor named {name!r} already exists on {rpc.get_worker_info().name}"))
    try:
        obj = factory(*args, **kwargs)
    except BaseException as e:             # noqa: BLE001
        failure = Failure(e)
        actor.set(failure=failure)
        return failure
    actor.set(obj)
    return None


def _packed(result, caller: str | None = None) -> tuple:
    """An actor's answer as it travels back to ``caller`` (see :mod:`.wire`); one that does not pickle,
    as its error."""
    try:
        return pack(result, peer=caller)
    except Exception as e:                  # noqa: BLE001 - delivered to the caller
        return pack(Failure(e))


def dispatch(name: str, caller: str, seq: int, method: str, data: bytes, buffer, send: Callable[[tuple], None],
             here: bool = False) -> None:
    """Queue call ``seq`` of ``caller`` on actor ``name``, however it came (RPC or a :mod:`.lane`);
    ``send(packed)`` takes the packed answer, from whichever thread completes it. ``here``: the
    thread that received the call runs it when the method is one of the actor's ``QUICK_METHODS``
    and the actor is idle with nothing queued (no hand-over to the actor's thread)."""
    actor = _actor(name)
    if actor is None:
        shm.unread(buffer)                  # its arguments are never read: their shared memory back to the caller
        send(pack(_closed_job(name)))
        return
    try:
        args, kwargs = unpack(data, buffer)
    except Exception as e:                  # noqa: BLE001 - the call still takes its place in the order
        method, args, kwargs = None, (e,), {}
    actor.submit(caller, seq, method, args, kwargs, lambda result: send(_packed(result, caller)),
                 inline=here and method in getattr(type(actor.obj), "QUICK_METHODS", ()))


@rpc.functions.async_execution
def _invoke(name: str, caller: str, seq: int, method: str, data: bytes, buffer) -> torch.futures.Future:
    fut = torch.futures.Future()
    dispatch(name, caller, seq, method, data, buffer, fut.set_result)
    return fut


def _pid() -> int:
    """A process-level ping (:func:`.rpc_calls.ping_worker`): run by the RPC agent's threads, never queued
    behind an actor's calls, so a process whose actors are busy answers at once and a frozen one does not."""
    return os.getpid()


def _exit_now(code: int = 0) -> None:
    """End this process at once, skipping RPC's shutdown barrier (the job is over, or torn down)."""
    threading.Timer(0.05, os._exit, args=(code,)).start()


# ------------------------------------------------------------------------------ call counters

_SEQ: dict[str, itertools.count] = {}       # actor key -> the next call number from this process (rpc_calls.py)
_SEQ_LOCK = threading.Lock()
# the timeouts of calls within this process, and of calls on lanes (a thread each, made on demand)
_DEADLINES: tuple[list[Deadlines], list[Deadlines]] = ([], [])


def local_deadlines() -> Deadlines:
    """The deadline thread of this process's calls to its own actors (ended when it leaves its group)."""
    return _deadlines(0, "overlord-local-deadlines")


def lane_deadlines() -> Deadlines:
    """The deadline thread of this process's calls on lanes (:mod:`.lane`; RPC times out its own calls)."""
    return _deadlines(1, "overlord-lane-deadlines")


def _deadlines(i: int, name: str) -> Deadlines:
    with _SEQ_LOCK:
        if not _DEADLINES[i]:
            _DEADLINES[i].append(Deadlines(name))
        return _DEADLINES[i][0]


# ------------------------------------------------------------------------------ role worker processes

def _watch_parent(conn) -> None:
    """Exit this process as soon as the process that started it closes its end of the pipe."""
    try:
        conn.recv()
    except BaseException:                   # noqa: BLE001 - EOF: the parent is gone
        pass
    os._exit(0)


def worker_main(name: str, rank: int, world_size: int, init_method: str, rpc_timeout: float, conn,
                env: dict | None = None) -> None:
    """A role worker: join the group and host actors until its parent closes the pipe (or dies), or
    the launcher calls :func:`_exit_now`; then exit at once, without a shutdown barrier."""
    from .rendezvous import register

    # a Ctrl-C in the terminal reaches the whole process group: it is the trainer's to handle (it closes the job,
    # or goes on, as in a notebook); this process ends with its parent's pipe, not with a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(LOOPBACK_ENV if env is None else env)
    set_cpp_log_level(CPP_ERRORS_ONLY, at_least=True)
    register()
    watch = threading.Thread(target=_watch_parent, args=(conn,), name="overlord-parent-watch", daemon=True)
    watch.start()
    try:
        init_rpc(name, rank, world_size, init_method, rpc_timeout)
    except Exception as e:                  # noqa: BLE001 - a member died during start-up: its starter says which
        # one line, not gloo's traceback from every worker: whoever started this process reports why the group failed
        first = str(e).splitlines()[0][:300] if str(e) else ""
        print(f"{name}: the RPC group did not start ({type(e).__name__}: {first}); exiting", file=sys.stderr,
              flush=True)
        os._exit(1)
    # what start-up made (torch, pyarrow, ...) lives as long as the process: keep it out of the
    # collector's full passes, which stop every actor thread while they run
    gc.freeze()
    watch.join()                            # serves calls meanwhile; the watcher ends the process
    os._exit(0)
