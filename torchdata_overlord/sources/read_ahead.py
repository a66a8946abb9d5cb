"""Read ahead: a source whose next rows are read, and transformed on a thread of their own, between steps.

In the rpc runtime a Source Loader refills its buffer while its parts travel to the constructors
(``LoaderActor.deliver``), answers, and then waits for the Planner, which orders the next step only
once every loader answered. On a machine with few cores the loaders that finish first leave their
cores idle until the slowest one is done: 12-16% of the CPU sat idle in ``benchmarks/runtimes.py``'s
rpc run, 3-6% in the DataLoader's. :class:`ReadAhead` wraps a source so that
:meth:`~ReadAhead.ahead`\\ ``(n)`` reads the next ``n`` rows at once, on the caller's thread (reading is
cheap, and the Arrow allocations of decoding stay on the loader's own thread: a thread per source
that allocates costs memory, and processes host many sources), and a thread of its own transforms
them; the next refill finds them done.

What the Source Loader sees does not change: ``next_raw`` gives the same rows in the same order,
``apply`` the same sample (transformed ahead, or now when the thread has not reached it yet), and
``state_dict``, ``position``, ``epoch``, ``rows_passed`` and ``last_order`` describe the rows *consumed*,
not those read ahead: no checkpoint counts a row read ahead. What reading ahead met (a row group that does not
decode, a transform that raised, the end of the source) is raised where its row is consumed, as it
would have been; a row skipped under ``on_error="skip"`` is counted in the source's ``skips`` when its
transform ran, so up to ``n`` rows before it is consumed. ``load_state_dict`` drops the rows read
ahead; ``close`` also stops the thread. Every other attribute is the source's own.

The rpc runtime reads ahead in every loader; ``OVERLORD_READ_AHEAD=0`` in the trainer's environment
turns it off for the jobs it starts. ``finish`` (None, or a function of a sample) is applied to what
the thread's transform returned, on that thread (a row skipped under ``on_error="skip"`` gives its
marker: ``finish`` returns what it does not know as it is): the rpc runtime's loader sets it to put
big samples into shared memory ahead of their delivery (:func:`~torchdata_overlord.runtime.wire.hold`).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

from .base import positions

__all__ = ["ReadAhead"]

log = logging.getLogger("torchdata_overlord")

_PENDING, _TAKEN = 0, 1         # a row read ahead: nobody transforms it yet / somebody does
_IDLE_WAIT = 5.0                # s between looks at the stop flag (close() notifies; a process may host hundreds)
_JOIN_TIMEOUT = 30.0            # s close() waits for a transform in flight
ENV = "OVERLORD_READ_AHEAD"      # the rpc runtime reads it (runtime/job_config.py)


class _Row:
    """A row read ahead, with the source's position before it was read (``at``: position, rows passed,
    epoch, last order) and, once transformed, its sample (or the exception the transform raised)."""

    __slots__ = ("index", "row", "where", "at", "error", "state", "sample", "failure", "done")

    def __init__(self, index, row, where, at: tuple, error: BaseException | None = None):
        self.index, self.row, self.where, self.at, self.error = index, row, where, at, error
        self.state, self.sample, self.failure = _PENDING, None, None
        self.done = False           # transformed (set under the ReadAhead's condition, which is then notified)


class ReadAhead:
    """``ReadAhead(source)``: ``source`` with its next rows read, and transformed in the background, on request."""

    def __init__(self, source):
        self.inner = source
        self.name = source.name
        self._rows: collections.deque[_Row] = collections.deque()
        self._cv = threading.Condition()          # guards the source's reading and position, _rows and their state
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._has_order = hasattr(source, "last_order")
        self._position, self._state_at = positions(source)
        self.finish = None                        # applied to each sample the thread transformed
        # rows read ahead; of those consumed: transformed by then, transformed by the consumer, waited for
        self.counts = {"read": 0, "ready": 0, "claimed": 0, "waited": 0, "dropped": 0}

    def __getattr__(self, name: str):
        if name == "inner":                        # (before __init__ set it)
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- where the consumed rows end -------------------------------------------------------------
    def _at(self) -> tuple:
        s = self.inner
        return self._position(), s.rows_passed, s.epoch, (s.last_order if self._has_order else None)

    def position(self):
        """The source's :meth:`position` (its state, for a source without one) before the oldest row
        read ahead and not consumed, else now."""
        with self._cv:
            return self._rows[0].at[0] if self._rows else self._position()

    def state_at(self, position) -> dict:
        return self._state_at(position)

    def state_dict(self) -> dict:
        return self.state_at(self.position())

    @property
    def rows_passed(self) -> int:
        with self._cv:
            return self._rows[0].at[1] if self._rows else self.inner.rows_passed

    @property
    def epoch(self) -> int:
        with self._cv:
            return self._rows[0].at[2] if self._rows else self.inner.epoch

    @property
    def last_order(self):
        if not self._has_order:
            raise AttributeError(f"{type(self.inner).__name__} has no last_order")
        with self._cv:
            return self._rows[0].at[3] if self._rows else self.inner.last_order

    def check_progress(self, since: int) -> None:
        with self._cv:
            ahead = self.inner.rows_passed - self._rows[0].at[1] if self._rows else 0
            self.inner.check_progress(since + ahead)

    # -- reading ---------------------------------------------------------------------------------
    def next_raw(self) -> tuple[int, Any, Any]:
        """The next row: the oldest read ahead (raising what reading it raised), else read now."""
        with self._cv:
            if not self._rows:
                return self.inner.next_raw()
            r = self._rows.popleft()
        if r.error is not None:
            raise r.error
        return r.index, r, r.where

    def apply(self, row, where):
        """The row's sample: transformed ahead (waiting for the thread if it is at it), or now."""
        if type(row) is not _Row:
            return self.inner.apply(row, where)
        with self._cv:
            mine = row.state == _PENDING
            row.state = _TAKEN
            self.counts["claimed" if mine else "ready" if row.done else "waited"] += 1
            while not mine and not row.done:
                self._cv.wait(_IDLE_WAIT)
                mine = not row.done and not self._thread.is_alive()   # (it ended mid-transform: shutdown)
        if mine:
            return self.inner.apply(row.row, where)
        if row.failure is not None:
            raise row.failure
        return row.sample

    def ahead(self, n: int) -> None:
        """Read the next rows until ``n`` are read ahead, here (the source's reading and its Arrow
        allocations stay on the loader's thread: one such thread per source, as without reading ahead),
        and have the read-ahead thread transform them. Reading stops at an error or the end."""
        with self._cv:
            if self._stopped:
                return
            while len(self._rows) < n and not (self._rows and self._rows[-1].error is not None):
                at = self._at()
                try:
                    r = _Row(*self.inner.next_raw(), at)
                except Exception as e:             # noqa: BLE001 - raised where the row is consumed
                    r = _Row(None, None, None, at, error=e)
                self._rows.append(r)
                self.counts["read"] += 1
            if self._thread is None and any(r.error is None for r in self._rows):
                self._thread = threading.Thread(target=self._run, name=f"overlord-ahead-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _pending(self) -> _Row | None:
        """The oldest row read ahead that nobody transforms yet (the caller holds ``_cv``)."""
        return next((r for r in self._rows if r.state == _PENDING and r.error is None), None)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (r := self._pending()) is None:
                    self._cv.wait(_IDLE_WAIT)
                if self._stopped:
                    return
                r.state = _TAKEN
            try:
                r.sample = self.inner.apply(r.row, r.where)
            except BaseException as e:             # noqa: BLE001 - raised where the row is consumed
                r.failure = e
            finish = self.finish
            if finish is not None and r.failure is None:
                try:
                    r.sample = finish(r.sample)
                except Exception as e:             # noqa: BLE001 - the sample as transformed, unfinished
                    log.warning("source %r: finishing a sample read ahead failed, kept as transformed: %s: %s",
                                self.name, type(e).__name__, e)
            with self._cv:
                r.done = True
                self._cv.notify_all()              # (apply and wait_ready)

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every row read ahead is transformed; False if ``timeout`` s passed first. For tests
        and benchmarks."""
        with self._cv:
            return self._cv.wait_for(
                lambda: self._stopped or all(r.error is not None or r.done for r in self._rows), timeout)

    # -- position and life -----------------------------------------------------------------------
    def load_state_dict(self, state: dict) -> None:
        """Go to ``state``, dropping the rows read ahead."""
        with self._cv:
            self.counts["dropped"] += len(self._rows)
            self._rows.clear()
            self.inner.load_state_dict(state)

    @property
    def buffer_bytes(self) -> int:
        """The source's own bytes plus the samples transformed ahead."""
        from ..roles.source_loader import record_bytes

        with self._cv:
            done = [r.sample for r in self._rows if r.done and r.failure is None]
        return self.inner.buffer_bytes + sum(map(record_bytes, done))

    def close(self) -> None:
        """Stop the thread (after the transform it runs) and close the source."""
        with self._cv:
            self._stopped = True
            self._rows.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(_JOIN_TIMEOUT)
            if thread.is_alive():
                log.warning("source %r: its read-ahead thread is still in a transform after %.0f s; left running "
                            "(a daemon thread)", self.name, _JOIN_TIMEOUT)
        self.inner.close()
