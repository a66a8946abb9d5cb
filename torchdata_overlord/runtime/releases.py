"""What every client has consumed, and releasing the steps all of them consumed.

The constructors answer each of the Planner's commits with the consumed position of every client
they heard from; the Planner hears those answers while it plans the next step (not before), and
once every client has consumed a step the constructors forget it (``release``) and the Planner
drops the states it kept to rewind to. A failure rewinds to :attr:`Releases.released`.
"""

from __future__ import annotations

from .fault_policy import FAILURES
from .role import gather

__all__ = ["Releases"]


class Releases:
    """The consumed positions of a :class:`~.planner_actor.PlannerActor`'s clients (see the module docstring)."""

    def __init__(self, planner):
        self.p = planner
        self.consumed: dict[int, int] = {}            # client -> steps it consumed (as the constructors heard)
        self.released = 0                             # every step before this one is consumed by every client
        self.pending: tuple[int, int, dict] | None = None   # (gen, step, constructor -> commit answer) not heard yet

    def reset(self, step: int) -> None:
        """A new generation starts at ``step``: nothing heard yet, nothing before ``step`` kept."""
        self.consumed, self.released, self.pending = {}, step, None

    def committed(self, gen: int, step: int, answers: dict) -> None:
        """The commit of ``step`` was sent; ``answers`` (constructor -> future) are heard later."""
        self.pending = (gen, step, answers)

    def hear(self) -> None:
        """The answers to the last commit: a constructor that failed it is raised (and replaced by
        the caller); any other error fails that step."""
        pending, self.pending = self.pending, None
        if pending is None or pending[0] != self.p.gen:
            return
        try:
            heard = gather(pending[2], self.p.timeout)
        except FAILURES:
            raise
        except BaseException as e:         # noqa: BLE001
            self.p.fail_from(pending[1], e)
            raise
        for got in heard.values():
            for client, n in got.items():
                self.consumed[int(client)] = max(self.consumed.get(int(client), 0), int(n))
        self._release()

    def _release(self) -> None:
        p = self.p
        below = min(self.consumed.get(c, self.released) for c in range(p.clients))
        if below <= self.released:
            return
        self.released = below
        for v in [v for v in p.versions if v < below]:
            del p.versions[v]
        for name in p.recovery.constructor_names:   # answered in order before any later commit to this constructor
            p.recovery.constructor_ref(name).release(p.gen, below)
