"""``TransformPool``: the threads a Source Loader runs its source's transform on.

Not a ``concurrent.futures.ThreadPoolExecutor``: the interpreter joins that one's threads at exit, with
no timeout, so one transform stuck in user code (a hung network read, a deadlock) kept the process from
exiting even after the loader closed or a Ctrl-C. No Python thread can be stopped from outside, so a
thread stuck that way is abandoned instead: ``shutdown`` waits a bounded time, logs which threads are
still in a transform, and leaves them as daemon threads, which end with the process.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable, Iterable

__all__ = ["TransformPool"]
log = logging.getLogger("torchdata_overlord")


class TransformPool:
    """``workers`` daemon threads named ``<name>_<i>``, started at the first ``map``; ``map(fn, items)`` runs
    ``fn`` over ``items`` on them and returns the results in order (the first failure, in order, is raised
    and the items not started are dropped). A pool dropped without ``shutdown`` stops its idle threads,
    as a ``ThreadPoolExecutor`` does."""

    def __init__(self, workers: int, name: str):
        self.name, self.workers = name, workers
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        weakref.finalize(self, _stop, self._work, workers)

    def _start(self) -> None:
        with self._lock:
            if not self._threads:
                self._threads = [threading.Thread(target=_run, args=(self._work,), name=f"{self.name}_{i}",
                                                  daemon=True) for i in range(self.workers)]
                for t in self._threads:
                    t.start()

    def map(self, fn: Callable[[Any], Any], items: Iterable) -> list:
        self._start()
        futs = []
        for x in items:
            futs.append(cf.Future())
            self._work.put((futs[-1], fn, x))
        try:
            return [f.result() for f in futs]      # as long as the transform takes: the caller's call has the deadline
        finally:
            for f in futs:
                f.cancel()

    def shutdown(self, timeout: float) -> list[str]:
        """Stop the threads after the transforms they run, waiting up to ``timeout`` seconds in all; returns
        the names of those still in a transform then (logged, and left running as daemon threads)."""
        for _ in self._threads:
            self._work.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive() and t is not threading.current_thread()]
        if stuck:
            log.warning("%s: transform thread(s) %s still in a transform after %g s (user code that does not return; "
                        "Python cannot stop a thread): left running as daemon threads, which do not keep the process "
                        "from exiting", self.name, stuck, timeout)
        return stuck


def _run(work: queue.SimpleQueue) -> None:
    """A pool thread (holding the queue, not the pool: a dropped pool is collected, and stops it)."""
    while True:
        item = work.get()
        if item is None:
            return
        fut, fn, arg = item
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(arg))
        except BaseException as e:      # noqa: BLE001 - raised by map() on the caller's thread
            fut.set_exception(e)
        del item, fut, fn, arg          # (an idle thread holds no record)


def _stop(work: queue.SimpleQueue, workers: int) -> None:
    for _ in range(workers):
        work.put(None)
