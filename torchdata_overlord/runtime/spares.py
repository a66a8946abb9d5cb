"""Where a replacement role starts: the least-loaded live spare process, never beside a role it must
not share a process with (a shadow and its primary), so one process death never takes several
replacements at once. Used by the Planner (loaders, shadows, constructors: :class:`Spares`) and by the
leader client (a replacement Planner); both read the serving roles from the Planner's :func:`serving`
placement.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from .fault_policy import FAILURES, RoleLost

__all__ = ["Spares", "serving", "spare_order"]


def serving(roles: Mapping) -> dict[str, str]:
    """Actor -> worker of every role serving now that a replacement put on a spare, from a Planner's
    roles record (``active``, ``shadow``, ``constructors``, ``where``; ``starting``: shadow -> worker
    being started; ``home``: the Planner's own worker)."""
    where = roles.get("where", {})
    names = list(roles["active"].values()) + [a for a in roles["shadow"].values() if a] + list(roles["constructors"])
    out = {a: where[a] for a in names if a in where}
    out.update(roles.get("starting", {}))
    if roles.get("home"):
        out["<planner>"] = roles["home"]
    return out


def spare_order(spares: Iterable[str], placed: Mapping[str, str], dead: Iterable[str] = (),
                avoid: Iterable[str] = ()) -> list[str]:
    """The live spares to try for a new role, least loaded first (ties: in ``spares`` order);
    ``placed`` is actor -> worker of the serving roles, ``avoid`` the workers it must not share."""
    dead, avoid = set(dead), {w for w in avoid if w}
    load = {w: 0 for w in spares}
    for w in placed.values():
        if w in load:
            load[w] += 1
    live = [w for w in load if w not in dead and w not in avoid]
    return sorted(live, key=lambda w: load[w])


class Spares:
    """The Planner's spare processes: which are dead, and where each replacement it started lives
    (``where``: actor -> worker, for the clients and loaders). ``roles()`` is the Planner's roles
    record now (what :func:`serving` reads)."""

    def __init__(self, peers, workers: list, roles: Callable[[], Mapping]):
        self.peers, self.workers, self.roles = peers, workers, roles
        self.where: dict[str, str] = {}
        self.dead: set[str] = set()

    def order(self, avoid: Iterable[str] = ()) -> list[str]:
        """The live spares to try for a new role, least loaded first, none of ``avoid``."""
        return spare_order(self.workers, serving(self.roles()), self.dead, avoid)

    def spawn(self, name: str, factory, args: tuple, avoid: tuple = ()) -> str:
        """Start ``name`` on the least-loaded live spare not in ``avoid``; a spare that cannot start it
        is dead. Returns the spare."""
        for w in self.order(avoid):
            try:
                self.peers.spawn(name, factory, args, w)
            except FAILURES:
                self.dead.add(w)      # killed, or died with an earlier replacement
                continue
            self.where[name] = w
            return w
        if not self.workers:
            raise RoleLost(f"the job has no spare process to restart {name!r} on (runtime='rpc' with spares=N and "
                           f"fault_tolerance= replaces failed roles; in one process, runtime='local', a role that does "
                           f"not answer is stuck in user code: a source's read or transform)")
        raise RoleLost(f"no live spare process can host {name!r} (spares {self.workers}, dead "
                       f"{sorted(self.dead)}, not beside {sorted(a for a in avoid if a)}); start the job with "
                       f"more spares")
