"""Shadows (paper section 6.1): an idle twin of each Source Loader on another process, told the
primary's state after every step, so a failed loader is replaced by a promotion instead of a restore."""

from __future__ import annotations

import concurrent.futures as cf
import logging

from .fault_policy import FAILURES
from .loader_actor import LoaderActor
from .refs import shadow_actor
from .transport import ActorDied

__all__ = ["Shadows"]

log = logging.getLogger("torchdata_overlord")


class Shadows:
    """Starts, adopts, updates and promotes the shadows of a :class:`~.recovery.Recovery` (``names``:
    loader key -> its shadow now, None for none); a shadow starts on a spare without blocking a step."""

    def __init__(self, recovery):
        self.r = recovery
        self.names: dict[str, str | None] = {s: (shadow_actor(s) if recovery.policy.shadows else None)
                                             for s in recovery.keys}
        self.starting: dict[str, tuple] = {}          # source -> (shadow name, worker, future) being started
        self.died: set[tuple[str, str]] = set()       # (source, shadow) whose follow() found it dead
        self.shadowless: set[str] = set()             # sources warned about: no spare can host their shadow

    def ensure(self, source: str) -> None:
        """Start a new shadow for ``source`` on the least-loaded live spare that does not host its
        primary, without waiting (it is adopted once it exists)."""
        r = self.r
        if not r.policy.shadows or self.names.get(source) is not None or source in self.starting:
            return
        order = r.spares.order([r.spares.where.get(r.active[source])])
        if not order:
            if source not in self.shadowless:
                self.shadowless.add(source)
                log.warning("source %r runs without a shadow: no live spare process except its primary's (a "
                            "failure restores it from the checkpoint instead)", source)
            return
        name, args = r.new_name(shadow_actor(source)), r.loader_actor_args(source)
        self.starting[source] = (name, order[0], r.peers.spawn_async(name, LoaderActor, args, order[0]))

    def adopt(self) -> None:
        """Keep a shadow for every source: forget shadows found dead, adopt those started earlier that
        now exist, start new ones where a source has none (after any recovery)."""
        r = self.r
        for source, name in list(self.died):
            self.died.discard((source, name))
            if self.names.get(source) == name:
                log.warning("source %r: its shadow %r died; starting a new one", source, name)
                self.names[source] = None
        for source, (name, worker, fut) in list(self.starting.items()):
            if not fut.done():
                continue
            del self.starting[source]
            if fut.exception() is not None:
                if isinstance(fut.exception(), FAILURES):
                    r.spares.dead.add(worker)
                log.warning("source %r: its new shadow did not start (%s); trying again", source, fut.exception())
                continue
            r.spares.where[name] = worker
            self.names[source] = name
            r.replaced[shadow_actor(source)] += 1
            self.follow(source, r.job.step)
        for source in r.keys:
            self.ensure(source)

    def follow(self, source: str, version: int) -> None:
        """Tell ``source``'s shadow the primary's state at ``version`` (fire and forget: a dead shadow
        is noticed here and replaced at the next step; a frozen one on promote)."""
        r = self.r
        shadow = self.names.get(source)
        if shadow is not None and source in r.loader_state:
            def died(f: cf.Future) -> None:
                if isinstance(f.exception(), ActorDied):
                    self.died.add((source, shadow))

            r.loader_ref(shadow).follow(version, r.loader_state[source]).add_done_callback(died)

    def promote(self, source: str, state: dict | None) -> bool:
        """Make ``source``'s shadow its primary at ``state`` (the state after the last completed step);
        False when there is none to promote (no shadow, no state, or it failed: it is forgotten)."""
        r, shadow = self.r, self.names.get(source)
        if shadow is None or state is None:
            return False
        try:
            r.loader_ref(shadow).promote(r.job.gen, state).result(r.timeout + 5)
        except FAILURES:
            self.names[source] = None
            return False
        r.active[source], self.names[source] = shadow, None
        return True

    def workers(self, source: str) -> tuple:
        """The processes of ``source``'s shadow and of the one being started (a new primary avoids them)."""
        shadow = self.names.get(source)
        return (self.r.spares.where.get(shadow) if shadow else None, self.starting.get(source, (None, None, None))[1])

    def starting_where(self) -> dict[str, str]:
        """Shadow -> worker of each shadow being started (it counts toward its spare's load)."""
        return {name: worker for name, worker, _ in self.starting.values()}
