"""Where a replacement role starts: the least-loaded live spare process, never beside a role it must
not share a process with (a shadow and its primary), so one process death never takes several
replacements at once. Used by the Planner (loaders, shadows, constructors) and by the leader client
(a replacement Planner); both read the serving roles from the Planner's :func:`serving` placement.
"""

from __future__ import annotations

from typing import Iterable, Mapping

__all__ = ["serving", "spare_order"]


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
