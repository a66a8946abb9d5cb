"""The narrow actor transport the runtimes use: start a named actor, call a method on it, get a future.

An *actor* is an object (a role: Planner, Source Loader, Data Constructor) living somewhere and
addressed by name; a *transport* decides where. ``InProcessTransport`` (``inprocess.py``) keeps actors
in this process (one thread each); ``RpcTransport`` (``rpc_transport.py``) keeps them in worker processes reached
with ``torch.distributed.rpc``. Any other engine can back the same four methods.

Contract, for every transport:

* ``call`` returns a :class:`concurrent.futures.Future` (chosen over ``torch.futures.Future`` so
  callers get ``result(timeout)``, ``exception()`` and ``concurrent.futures.wait`` without torch).
* Calls to one actor run one at a time, in the order ``call`` was invoked; calls to different
  actors may run concurrently.
* The future fails with :class:`CallTimeout` when no answer came within ``timeout`` seconds (the
  method may still be running: it is not interrupted), with :class:`ActorDied` when the actor's
  process is gone, and with the method's own exception (its type preserved where it can be
  rebuilt, and a note naming the actor and method) when the method raised.
* A method may return a :class:`concurrent.futures.Future`: the call is then answered when that
  completes, and the actor runs its next call meanwhile (e.g. "this step, once it is built").
* ``call(..., direct=True)`` says the caller is about to wait for the answer and the method waits
  on no actor the caller is running: a transport may then run it on the caller's thread when the
  actor has nothing else queued (in one process this saves a thread hand-over per hop; order and
  one-call-at-a-time still hold). Other transports ignore it.
* ``stop()`` is idempotent and bounded by timeouts.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import itertools
import threading
import time
import weakref
from abc import ABC, abstractmethod
from typing import Callable

from ..errors import ConfigError, OverlordError

__all__ = ["Transport", "ActorDied", "CallTimeout", "ActorError", "TransportClosed"]


class _ActorFailure:
    """Mixin: the failure names its actor (``.actor``), also after pickling across processes."""

    def __init__(self, message: str, actor: str | None = None):
        super().__init__(message, actor)
        self.actor = actor

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self):
        return type(self), (self.args[0], self.actor)


class ActorDied(_ActorFailure, OverlordError, RuntimeError):
    """The process hosting an actor died; every call to it fails with this."""


class CallTimeout(_ActorFailure, OverlordError, TimeoutError):
    """A call got no answer within its timeout (the method may still be running)."""


class ActorError(OverlordError, RuntimeError):
    """An actor's method raised an exception that could not be rebuilt in the caller."""


class TransportClosed(OverlordError, RuntimeError):
    """The transport was stopped (or never started); it takes no more actors or calls."""


class Transport(ABC):
    """Start named actors and call their methods; see the module docstring for the contract."""

    @abstractmethod
    def start_actor(self, name: str, factory: Callable[..., object], *args, worker: int | None = None,
                    **kwargs) -> None:
        """Create ``factory(*args, **kwargs)`` as actor ``name`` on worker ``worker`` (waits until it exists)."""

    @abstractmethod
    def call(self, name: str, method: str, *args, timeout: float, direct: bool = False, **kwargs) -> cf.Future:
        """Call ``actor.method(*args, **kwargs)``; the future's result is the return value (``direct``:
        see the module docstring)."""

    def ping(self, name: str, timeout: float) -> cf.Future:
        """Whether the process hosting actor ``name`` answers at all, however busy the actor is: a future
        that fails with :class:`CallTimeout` (frozen) or :class:`ActorDied` (gone). One process: it answers."""
        out: cf.Future = cf.Future()
        settle(out, None)
        return out

    @abstractmethod
    def is_alive(self, name: str) -> bool:
        """Whether actor ``name`` exists and its host is alive."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every actor; idempotent, never hangs."""

    @abstractmethod
    def peers(self):
        """A handle with this ``call`` that actors can hold to call each other (picklable where the
        actors live in other processes)."""

    # -- placement: where actors live (one process: nowhere to choose; the defaults say so) ------
    n_workers: int = 1

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the role workers this process started (none in one process)."""
        return []

    def place(self, placement: dict[str, int]) -> None:
        """Record which worker (0-based) hosts each actor, before it starts or as another member says."""

    def learn(self, where: dict[str, str]) -> None:
        """Placement news from a role: actor -> worker name (a replacement started on a spare)."""

    def worker_of(self, name: str) -> int:
        """The 0-based worker hosting actor ``name``."""
        return 0

    def worker_name(self, i: int) -> str:
        """The name of worker ``i``, as roles and :meth:`learn` use it."""
        return f"in-process-worker-{i}"

    def kill(self, names: list[str]) -> list[int]:
        """Failure injection: the workers hosting actors ``names`` die at once (all found before any dies;
        in one process, the actors alone); returns their process ids."""
        raise NotImplementedError

    # -- membership: other clients and a coordinator (one process: none) ------------------------
    def host(self, name: str, obj: object) -> None:
        """Serve ``obj`` as actor ``name`` from this process (e.g. the leader's Planner registry)."""
        self.start_actor(name, lambda: obj)

    def call_client(self, client: int, name: str, method: str, *args, timeout: float) -> cf.Future:
        """Call actor ``name`` hosted by client ``client`` with :meth:`host`."""
        return self.call(name, method, *args, timeout=timeout)

    def leave(self, timeout: float) -> None:
        """Tell the job's coordinator this client leaves (a launched job; elsewhere nothing to do)."""

    def wait_for_clients(self, timeout: float) -> list[int]:
        """Client 0: wait (bounded) until the other clients left; the clients still there."""
        return []

    def on_stopped(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` if the job's coordinator stops it (a launched job)."""

    def mark_unhealthy(self) -> None:
        """Some member may be dead or frozen: give the workers less time when the group ends."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def check_timeout(timeout) -> float:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def settle(fut: cf.Future, result=None, exc: BaseException | None = None) -> bool:
    """Complete ``fut`` unless it is already done (a timeout won the race); True if this call did."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
        return True
    except cf.InvalidStateError:
        return False


def name_exception(exc: BaseException, actor: str, method: str) -> BaseException:
    """The method's exception, its type kept, with the actor and method in its message where the
    type can be rebuilt from one string, and always in a note."""
    where = f"raised by {actor}.{method}()"
    rebuilt = exc
    if len(exc.args) == 1 and isinstance(exc.args[0], str) and where not in exc.args[0]:
        try:
            candidate = type(exc)(f"{exc.args[0]} [{where}]")
            if type(candidate) is type(exc) and candidate.args == (f"{exc.args[0]} [{where}]",):
                candidate.__cause__, candidate.__traceback__ = exc.__cause__, exc.__traceback__
                candidate.__notes__ = list(getattr(exc, "__notes__", []))
                rebuilt = candidate
        except Exception:
            pass
    if where not in str(rebuilt):
        rebuilt.add_note(where)
    return rebuilt


class Deadlines:
    """One daemon thread that fails futures with ``CallTimeout`` when their deadline passes.

    The thread sleeps until the earliest deadline and is woken only for an earlier one (not once per
    call), and holds the futures weakly: an answered call keeps nothing alive. Entries of answered
    calls are dropped when the earliest deadline passes, or in one sweep once they pile up."""

    _SWEEP_AT = 1024

    def __init__(self, name: str):
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._sweep_at = self._SWEEP_AT
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, fut: cf.Future, timeout: float, make_exc: Callable[[], BaseException]) -> None:
        item = (time.monotonic() + timeout, next(self._seq), weakref.ref(fut), make_exc)
        with self._cv:
            wake = not self._heap or item < self._heap[0] or len(self._heap) >= self._sweep_at
            heapq.heappush(self._heap, item)
            if wake:
                self._cv.notify()

    @staticmethod
    def _pending(item) -> cf.Future | None:
        fut = item[2]()
        return None if fut is None or fut.done() else fut

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if len(self._heap) >= self._sweep_at:
                    self._heap = [item for item in self._heap if self._pending(item) is not None]
                    heapq.heapify(self._heap)
                    self._sweep_at = max(self._SWEEP_AT, 2 * len(self._heap))
                now = time.monotonic()
                while self._heap and (self._heap[0][0] <= now or self._pending(self._heap[0]) is None):
                    item = heapq.heappop(self._heap)
                    fut = self._pending(item)
                    if fut is not None:
                        settle(fut, exc=item[3]())
                self._cv.wait(None if not self._heap else max(0.0, self._heap[0][0] - now))

    def close(self, join_timeout: float = 1.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(join_timeout)
