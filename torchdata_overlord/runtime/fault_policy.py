"""What a job does when a role fails: the fault policy the Planner follows, what counts as a failed
call, and the error when nothing can replace a role."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..errors import ConfigError, OverlordError
from .transport import ActorDied, CallTimeout

__all__ = ["FaultPolicy", "RoleLost", "FAILURES", "unanswering"]

FAILURES = (ActorDied, CallTimeout)      # a call that failed: the actor is dead (or frozen past its timeout)


def unanswering(ping: Callable[[str, float], cf.Future], actors: Iterable[str], timeout: float) -> dict:
    """Which of ``actors`` live in a process that answers no ``ping`` (a transport's or the peers'; answered by
    any live process, however busy its actors) within ``timeout``, all asked at once: actor -> the failure
    (:class:`CallTimeout`: frozen, :class:`ActorDied`: gone)."""
    futs = {a: ping(a, timeout) for a in actors}
    cf.wait(list(futs.values()), timeout=timeout + 5)
    out = {}
    for a, f in futs.items():
        try:
            f.result(timeout=0)
        except FAILURES as e:
            out[a] = e
        except cf.TimeoutError:
            out[a] = CallTimeout(f"{a}'s process did not answer a ping within {timeout:g} s", a)
    return out


class RoleLost(OverlordError, RuntimeError):
    """A role failed and nothing could replace it (no live shadow, no spare process)."""


@dataclass
class FaultPolicy:
    """How the Planner keeps the stream going: the checkpoint store (None: no checkpoints, no
    restore after a Planner failure), loader snapshot interval, shadows, and the spare workers
    where replacements start (RPC worker names; in one process any name works)."""

    store: object = None
    snapshot_every: int = 10
    shadows: bool = False
    spares: list = field(default_factory=list)
    loader_args: dict = field(default_factory=dict)     # source -> LoaderActor args before ``peers``
    constructor_args: tuple = ()                        # ConstructorActor args after ``index``, before ``peers``
    build_thread: bool = True                           # constructors build on a thread of their own (rpc)

    def __post_init__(self) -> None:
        if isinstance(self.snapshot_every, bool) or not isinstance(self.snapshot_every, int) or self.snapshot_every < 1:
            raise ConfigError(f"snapshot_every must be an integer >= 1 (steps between loader snapshots), got "
                              f"{self.snapshot_every!r}")

    def loader_actor_args(self, source: str, peers, part: tuple[int, int] = (0, 1)) -> tuple:
        """The :class:`~.loader_actor.LoaderActor` arguments of a loader of ``source`` (part ``j`` of ``k``)."""
        return (*self.loader_args[source], peers, tuple(part))

    def constructor_actor_args(self, c: int, peers, timeout: float) -> tuple:
        """The :class:`~.constructor_actor.ConstructorActor` arguments of a replacement constructor ``c``."""
        return (c, *self.constructor_args, peers, timeout, self.store, self.build_thread)
