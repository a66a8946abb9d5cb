"""Where a Source Loader keeps its buffered samples' metadata rows: numpy slots, one per sample.

A row is written once, when its sample is buffered, and its slot is freed when the sample is taken;
the report to the Planner gathers the buffered samples' rows with one numpy indexing instead of
converting every buffered sample's row from Python objects again at every step.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MetaSlots"]


class MetaSlots:
    """``put(rows, orders) -> slots``, ``free(slot)``, ``gather(slots) -> (rows, orders)``; grows as needed."""

    WIDTH = 4     # (tokens, images, patches, sum of squared patches)

    def __init__(self, capacity: int):
        self.version = 0        # moves at every put, free and clear: a report of an unchanged buffer is reused
        self.rows = np.zeros((0, self.WIDTH))
        self.order = np.zeros(0, np.int64)
        self._free: list[int] = []
        self._grow(max(int(capacity), 1))

    def _grow(self, more: int) -> None:
        n = len(self.order)
        self.rows = np.concatenate([self.rows, np.zeros((more, self.WIDTH))])
        self.order = np.concatenate([self.order, np.zeros(more, np.int64)])
        self._free.extend(range(n + more - 1, n - 1, -1))       # lowest slot first out

    def put(self, rows: list[tuple], orders: list[int]) -> list[int]:
        """Store samples' metadata rows and read-order keys (one numpy write for them all); returns their slots."""
        k = len(rows)
        self.version += k > 0
        if len(self._free) < k:
            self._grow(max(k, len(self.order)))
        slots = self._free[:-k - 1:-1] if k else []
        del self._free[len(self._free) - k:]
        if k:
            self.rows[slots] = rows
            self.order[slots] = orders
        return slots

    def free(self, slot: int) -> None:
        self.version += 1
        self._free.append(slot)

    def clear(self) -> None:
        """Every slot free (the buffer was emptied)."""
        n = len(self.order)
        self.version += 1
        self._free = list(range(n - 1, -1, -1))

    def gather(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, read-order keys) of ``slots``, in that order (copies)."""
        return self.rows[slots], self.order[slots]
