"""SkipLog: what a source skipped under ``on_error="skip"``, counted exactly and logged without flooding.

A bad row is met again every epoch, so a line per skip floods a long run's log (hundreds of lines
saying the same thing). The first skip of a source is logged at once, in full; later ones are
summed up in one line at most every ``interval`` seconds (and on ``flush()``, at close). The
counts themselves are exact and kept apart from the log: one entry per skipped file, row group or
row, counted once per epoch it was skipped in (re-reading the same epoch after a restore does not
count again).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..errors import ConfigError

__all__ = ["SkipLog"]

log = logging.getLogger("torchdata_overlord")


class SkipLog:
    """``SkipLog(source, interval=60.0, clock=time.monotonic)``: the skips of one source (thread-safe:
    a Source Loader's workers transform, and so skip, concurrently)."""

    def __init__(self, source: str, interval: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval >= 0:
            raise ConfigError(f"source {source!r}: skip_log_interval must be a number of seconds >= 0, "
                              f"got {interval!r}")
        self.source, self.interval, self._clock = source, float(interval), clock
        self._entries: dict[tuple, dict] = {}     # (file, row) -> entry; row None: a whole file
        self.total = 0                              # skips counted (once per entry and epoch)
        self._pending = 0                           # counted but not yet in a logged line
        self._latest = ""
        self._logged_at: float | None = None        # when the last line was written
        self._lock = threading.Lock()

    def add(self, file: str, row: int | None, error: str, epoch: int) -> None:
        """Count a skip of ``file`` (``row``: a row or a row group's first row; None: the whole file)."""
        with self._lock:
            entry = self._entries.get((file, row))
            if entry is None:
                entry = self._entries[file, row] = {"file": file, "row": row, "error": error, "count": 0,
                                                    "epochs": set()}
            # the epochs counted, not the latest: a row read again in a rebuild is counted once per epoch, and
            # two epochs' skips of one row transformed concurrently (one refill) count both in either order
            if epoch in entry["epochs"]:
                return                              # this epoch's skip of it is counted already
            entry["epochs"].add(epoch)
            entry["count"] += 1
            entry["error"] = error
            self.total += 1
            self._pending += 1
            self._latest = f"{file}{'' if row is None else f' row {row}'}: {error}"
            now = self._clock()
            if self._logged_at is None:
                self._write(f"skipped {self._latest} (on_error='skip'; further skips of this source are summed "
                            f"up at most every {self.interval:g} s, exact counts in stats())", now)
            elif now - self._logged_at >= self.interval:
                self._write(self._summary(now), now)

    def flush(self) -> None:
        """Log the skips not yet in a line (a source closing, or a run ending)."""
        with self._lock:
            if self._pending:
                now = self._clock()
                self._write(self._summary(now), now)

    def _summary(self, now: float) -> str:
        return (f"skipped {self._pending} more in the last {now - self._logged_at:.0f} s ({self.total} in all, "
                f"{len(self._entries)} distinct files/rows); latest: {self._latest}")

    def _write(self, text: str, now: float) -> None:
        log.warning("source %r: %s", self.source, text)
        self._pending, self._logged_at = 0, now

    @property
    def latest(self) -> str:
        """The latest skip, as ``"file row N: Error: message"``."""
        return self._latest

    @property
    def entries(self) -> list[dict]:
        """One dict per skipped file/row: ``file``, ``row`` (None: the whole file), ``error`` (the
        latest), ``count`` (epochs it was skipped in)."""
        with self._lock:
            return [{k: v for k, v in e.items() if k != "epochs"} for e in self._entries.values()]

    def stats(self) -> dict:
        """``{"skipped": total, "skipped_distinct": files/rows, "skipped_files": {file: count}}``, exact; the
        last lists the files skipped whole (unreadable, or without a projected column)."""
        with self._lock:
            return {"skipped": self.total, "skipped_distinct": len(self._entries),
                    "skipped_files": {f: e["count"] for (f, row), e in self._entries.items() if row is None}}
