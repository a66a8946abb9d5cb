"""Per-step source counts by largest remainder with carried error (deterministic, low discrepancy).

Each source's cumulative target grows by ``batch * weight`` every step; the step's counts round
the gap between target and what was already delivered, so every source's cumulative realised
count stays strictly within one sample of its cumulative target at every step, whatever the
schedule does (i.i.d. draws drift by ~sqrt(steps * batch) instead).
"""

from __future__ import annotations

import math
from typing import Mapping

__all__ = ["Apportioner"]


class Apportioner:
    """Turns a stream of mixtures into integer per-step counts that sum to ``batch``."""

    def __init__(self) -> None:
        self.target: dict[str, float] = {}
        self.realised: dict[str, int] = {}

    def counts(self, weights: Mapping[str, float], batch: int) -> dict[str, int]:
        """Counts for one step; updates the carried state. ``weights`` need not be normalised."""
        total = sum(weights.values())
        names = sorted(set(weights) | set(self.target))
        gap = {}
        for n in names:
            self.target[n] = self.target.get(n, 0.0) + batch * weights.get(n, 0.0) / total
            gap[n] = self.target[n] - self.realised.get(n, 0)
        # floor of each gap (never below zero: a source ahead of its target just takes nothing)
        out = {n: max(math.floor(g), 0) for n, g in gap.items()}
        short = batch - sum(out.values())
        # hand the remaining samples to the largest remainders; ties go to the earliest name
        order = sorted(names, key=lambda n: (-(gap[n] - out[n]), n))
        if short > 0:
            for n in order[:short]:
                out[n] += 1
        elif short < 0:  # only reachable through float rounding at the 1e-9 level: take back from smallest
            for n in reversed(order):
                if short == 0:
                    break
                if out[n] > 0:
                    out[n] -= 1
                    short += 1
        for n, c in out.items():
            self.realised[n] = self.realised.get(n, 0) + c
        return {n: out[n] for n in names}

    def error(self) -> dict[str, float]:
        """Cumulative realised minus cumulative target, per source."""
        return {n: self.realised.get(n, 0) - t for n, t in self.target.items()}

    def state_dict(self) -> dict:
        return {"target": dict(self.target), "realised": dict(self.realised)}

    def load_state_dict(self, state: Mapping) -> None:
        self.target = {str(k): float(v) for k, v in state["target"].items()}
        self.realised = {str(k): int(v) for k, v in state["realised"].items()}
