"""``InProcessTransport``: every actor an object of this process, running its calls in order on a
thread of its own, arguments and answers passed by reference (``runtime="local"``, and the tests of
every recovery path). It keeps the contract written at the top of ``transport.py``."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import queue
import threading
import time
from typing import Callable

from ..errors import ConfigError
from .transport import (ActorDied, CallTimeout, Deadlines, Transport, TransportClosed, check_timeout, name_exception,
                        settle)

__all__ = ["InProcessTransport"]
log = logging.getLogger("torchdata_overlord")


class _ActorThread:
    """One actor in this process: a thread running its calls in order."""

    _STOP = object()

    def __init__(self, name: str, obj: object, guard: threading.Lock):
        self.name, self.obj, self.killed = name, obj, False
        self.busy: tuple[str, float] | None = None     # (method, since when) of the call it runs on its thread
        self.deferred: set[cf.Future] = set()      # answers still owed (a killed actor owes none)
        self.running = threading.Lock()            # held while one of its calls runs, on any thread
        self.guard, self.pending = guard, 0        # calls queued and not finished (under ``guard``)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"overlord-actor-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is self._STOP:
                self._fail_queued()
                if self.killed:
                    self._release()
                return
            with self.running:
                self.busy = (item[1], time.monotonic())
                try:
                    self.execute(*item)
                finally:
                    self.busy = None
            with self.guard:
                self.pending -= 1

    def execute(self, fut: cf.Future, method: str, args: tuple, kwargs: dict) -> None:
        """Run one call (holding ``running``) and answer ``fut``."""
        if fut.cancelled():
            return
        if self.killed:
            settle(fut, exc=ActorDied(f"actor {self.name!r} was killed ({method}())", self.name))
            return
        try:
            result = getattr(self.obj, method)(*args, **kwargs)
        except BaseException as e:       # noqa: BLE001 - delivered to the caller
            settle(fut, exc=name_exception(e, self.name, method))
        else:
            if isinstance(result, cf.Future):        # deferred: answered when it completes
                self.deferred.add(fut)
                fut.add_done_callback(self.deferred.discard)
                result.add_done_callback(lambda f, fut=fut, m=method: _forward(f, fut, self.name, m))
            else:
                settle(fut, result)

    def _release(self) -> None:
        """A killed actor frees what its object holds (thread pools, files), as a dead process would:
        nobody calls its ``close()`` otherwise, and its threads would outlive the job."""
        _release(self.obj)

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is not self._STOP:
                settle(item[0], exc=ActorDied(f"actor {self.name!r} stopped before {item[1]}() ran", self.name))


def _release(obj: object) -> None:
    """Close ``obj`` if it can be (best effort: its actor is dead or never ran)."""
    close = getattr(obj, "close", None)
    if callable(close):
        try:
            close()
        except Exception:                # noqa: BLE001 - best effort
            pass


def _forward(src: cf.Future, dst: cf.Future, actor: str, method: str) -> None:
    exc = src.exception()
    if exc is not None:
        settle(dst, exc=name_exception(exc, actor, method))
    else:
        settle(dst, src.result())


class InProcessTransport(Transport):
    """Actors are objects in this process; each runs its calls on its own (daemon) thread.

    Arguments and results are passed by reference, not copied. ``stop()`` asks each actor thread
    to finish after its queued calls and waits up to ``stop_timeout`` seconds in all; an actor still
    in a call then (user code that does not return, e.g. a source's transform) is named in a warning
    and left: its thread is a daemon, so it does not keep the process from exiting, and it ends on its
    own once the call returns (Python cannot stop a thread).
    """

    def __init__(self, stop_timeout: float = 5.0):
        self.stop_timeout = check_timeout(stop_timeout)
        self._actors: dict[str, _ActorThread] = {}
        self._killed: set[str] = set()
        self._starting: set[str] = set()           # names of actors being built (outside the lock)
        self._lock = threading.Lock()
        self._closed = False
        self._deadlines = Deadlines("overlord-inprocess-deadlines")

    def start_actor(self, name: str, factory: Callable[..., object], *args, worker: int | None = None,
                    **kwargs) -> None:
        with self._lock:
            if self._closed:
                raise TransportClosed(f"cannot start actor {name!r}: the transport is stopped")
            if name in self._actors or name in self._starting:
                raise ConfigError(f"an actor named {name!r} already exists")
            self._starting.add(name)
        try:                       # built outside the lock: the other actors' calls go on meanwhile
            obj = factory(*args, **kwargs)
        except BaseException:
            with self._lock:
                self._starting.discard(name)
            raise
        with self._lock:
            self._starting.discard(name)
            if not self._closed:
                self._actors[name] = _ActorThread(name, obj, self._lock)
                return
        _release(obj)              # stopped while it was built: it never runs
        raise TransportClosed(f"actor {name!r}: the transport was stopped while it started")

    def call(self, name: str, method: str, *args, timeout: float, direct: bool = False, **kwargs) -> cf.Future:
        timeout = check_timeout(timeout)
        with self._lock:
            if self._closed:
                raise TransportClosed(f"cannot call {name}.{method}(): the transport is stopped")
            actor = self._actors.get(name)
            if actor is None:
                raise ConfigError(f"no actor named {name!r}; actors: {sorted(self._actors)}")
            fut: cf.Future = cf.Future()
            if name in self._killed:
                fut.set_exception(ActorDied(f"actor {name!r} was killed ({method}())", name))
                return fut
            inline = direct and actor.pending == 0 and not actor.killed and actor.running.acquire(blocking=False)
            if not inline:
                actor.pending += 1
                actor.queue.put((fut, method, args, kwargs))
        if inline:                 # idle, and the caller waits anyway: run it here, no thread hand-over
            try:
                actor.execute(fut, method, args, kwargs)
            finally:
                actor.running.release()
            if fut.done():
                return fut         # else deferred: answered later, under the same deadline as any call
        self._deadlines.add(fut, timeout, lambda: CallTimeout(
            f"{name}.{method}() got no answer within its timeout of {timeout:g} s", name))
        return fut

    def busy(self) -> dict[str, tuple[str, float]]:
        """Actor -> (the method it runs, seconds it has run it), for every actor in a call now."""
        now = time.monotonic()
        with self._lock:
            actors = list(self._actors.values())
        return {a.name: (b[0], now - b[1]) for a in actors if (b := a.busy) is not None}

    def is_alive(self, name: str) -> bool:
        actor = self._actors.get(name)
        return actor is not None and not self._closed and actor.thread.is_alive() and name not in self._killed

    def peers(self) -> "InProcessTransport":
        return self

    def actor_names(self) -> list[str]:
        """Every actor started and not killed (replacements and resharded parts included)."""
        with self._lock:
            return [n for n in self._actors if n not in self._killed]

    def actor(self, name: str) -> object:
        """The object behind actor ``name`` (instrumenting and debugging: in this process only)."""
        return self._actors[name].obj

    # the peers interface actors use to replace each other (see RpcPeers)
    def spawn(self, name: str, factory: Callable[..., object], args: tuple, worker: str | None = None) -> None:
        """Start a (replacement) actor; ``worker`` is ignored: every actor lives in this process."""
        self.start_actor(name, factory, *args)

    def spawn_async(self, name: str, factory: Callable[..., object], args: tuple,
                    worker: str | None = None) -> cf.Future:
        out: cf.Future = cf.Future()
        try:
            self.spawn(name, factory, args, worker)
            out.set_result(None)
        except BaseException as e:       # noqa: BLE001 - delivered through the future
            out.set_exception(e)
        return out

    def learn(self, where: dict) -> None:
        """Placement news from another actor: nothing to learn in one process."""

    def kill(self, names: list[str]) -> list[int]:
        """Failure injection: actors ``names`` die; their queued and future calls fail with ActorDied."""
        for name in names:
            with self._lock:
                actor = self._actors[name]
                self._killed.add(name)
                actor.killed = True
            actor.queue.put(_ActorThread._STOP)
            for fut in list(actor.deferred):     # as a dead process's pending answers: the callers learn at once
                settle(fut, exc=ActorDied(f"actor {name!r} was killed", name))
        return [os.getpid()] * len(names)

    def stop(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            actors = list(self._actors.values())
        for a in actors:
            a.queue.put(_ActorThread._STOP)
        deadline = time.monotonic() + self.stop_timeout
        for a in actors:
            a.thread.join(max(0.0, deadline - time.monotonic()))
        self._deadlines.close()
        now = time.monotonic()
        for a in actors:
            busy = a.busy
            if a.thread.is_alive() and busy is not None:
                log.warning("actor %r is still in %s() after %.0f s (thread %r): in user code that does not return "
                            "(a source's transform or read), or waiting for an actor that is; left running as a daemon "
                            "thread, which does not keep the process from exiting, and stops once the call returns",
                            a.name, busy[0], now - busy[1], a.thread.name)
