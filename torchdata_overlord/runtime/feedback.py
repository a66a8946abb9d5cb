"""FeedbackLog: trainer feedback (e.g. per-source loss) waiting for the plan of its step.

One list for every holder: the Planner plans with it, the client keeps what it has sent until the
step it targets is planned, and the loader keeps what is not planned at the consumed position (it
goes into ``state_dict()``). Entries are ``[step, {source: value}]``; only the leader client's
feedback counts (every trainer rank is expected to give the same values, e.g. an all-reduced loss).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ..errors import ConfigError

__all__ = ["FeedbackLog"]


class FeedbackLog:
    """``[step, values]`` entries in the order given; a plain-types :meth:`state`."""

    def __init__(self, entries: Iterable = ()):
        self.entries: list[list] = [[int(s), {str(k): float(v) for k, v in dict(vals).items()}] for s, vals in entries]

    def add(self, step: int, values: Mapping[str, float], first_open: int) -> list:
        """Queue ``values`` for the plan of ``step``; ``first_open`` is the first step not yet planned
        (or requested), so feedback for an earlier one is refused, never silently dropped."""
        if int(step) < first_open:
            raise ConfigError(f"feedback for step {step} comes too late: step {first_open} is the first not yet "
                              f"planned")
        entry = [int(step), {str(k): float(v) for k, v in values.items()}]
        self.entries.append(entry)
        return entry

    def due(self, step: int) -> list[dict]:
        """The values for the plan of ``step``, in the order given."""
        return [dict(v) for s, v in self.entries if s == step]

    def after(self, step: int) -> "FeedbackLog":
        """The entries for steps after ``step`` (what is still open once ``step`` is planned)."""
        return FeedbackLog(e for e in self.entries if e[0] > step)

    def drop_through(self, step: int) -> None:
        """Forget the entries for ``step`` and before (planned)."""
        self.entries = [e for e in self.entries if e[0] > step]

    def replace_from(self, step: int, entries: Iterable) -> None:
        """The entries for ``step`` and later become ``entries`` (the leader's own list is the truth:
        sending it again after a failure never counts an entry twice)."""
        self.entries = [e for e in self.entries if e[0] < step] + FeedbackLog(
            e for e in entries if int(e[0]) >= step).entries

    def state(self) -> list[list]:
        return [[s, dict(v)] for s, v in self.entries]

    def __len__(self) -> int:
        return len(self.entries)
