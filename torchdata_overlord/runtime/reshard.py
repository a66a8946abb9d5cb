"""Resharding a source live (paper 5.2): the Planner moves a source from its data-parallel loader
actors to ``k`` new ones between two steps, with nothing lost or repeated.

The source's state after the last completed step (its parts' states merged: placement-free, see
:mod:`~torchdata_overlord.roles.loader_parts`) is loaded into ``k`` new actors, started on the job's
least-loaded role processes; only once every one of them holds it does the Planner switch to them and
retire the old ones. A new actor that cannot start or load aborts the reshard: the old actors, untouched,
go on serving. The plans do not change: the merged view of any number of parts is one loader's.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time

from ..roles.loader_parts import merge_states
from .fault_policy import FAILURES
from .loader_actor import LoaderActor
from .refs import LoaderRef, loader_actor

__all__ = ["reshard"]

log = logging.getLogger("torchdata_overlord")


def _hosts(r, count: int, retiring: list[str]) -> list:
    """A role process for each of ``count`` new actors: the job's processes hosting the fewest loaders
    (not counting the ``retiring`` ones) first; spares are kept for replacements. None where actors
    are not placed (one process)."""
    placement = getattr(r.peers, "placement", None)
    if not placement:
        return [None] * count
    spares = set(r.policy.spares)
    load = {w: 0 for w in sorted(set(placement.values()) - spares)}
    for key, name in r.active.items():
        if key in retiring:
            continue
        w = placement.get(name)
        if w in load:
            load[w] += 1
    out = []
    for _ in range(count):
        w = min(load, key=lambda w: (load[w], w))
        load[w] += 1
        out.append(w)
    return out


def reshard(job, source: str, actors: int, workers: int) -> dict:
    """Serve ``source`` with ``actors`` new loader actors of ``workers`` threads; returns what happened."""
    r, t0 = job.recovery, time.perf_counter()
    old = list(job.parts.by_source[source])
    state = merge_states([r.loader_state[k] for k in old])
    parts = job.parts.resized({source: actors})
    base = r.policy.loader_args[source]
    started = {}
    try:
        for j, (key, host) in enumerate(zip(parts.by_source[source], _hosts(r, actors, old))):
            name = r.new_name(loader_actor(key))
            args = (base[0], base[1], workers, *base[3:], r.peers, (j, actors))
            r.peers.spawn(name, LoaderActor, args, host)
            started[key] = name
            if host is not None:            # where it lives, for the clients (stats) and the other roles
                r.spares.where[name] = host
        futs = [LoaderRef(r.peers, name, r.timeout).new_generation(job.gen, state) for name in started.values()]
        cf.wait(futs, timeout=r.timeout + 5)
        for f in futs:
            f.result(timeout=0)
    except (FAILURES + (cf.TimeoutError,)) as e:
        for name in started.values():
            LoaderRef(r.peers, name, r.timeout).close()
        log.warning("source %r: resharding %d -> %d loader actors failed (%s); the old ones go on", source,
                    len(old), actors, e)
        return {"source": source, "from": len(old), "to": actors, "ok": False, "error": f"{type(e).__name__}: {e}"}
    for key in old:                         # switch, then retire the old actors and their shadows
        name, shadow = r.active.pop(key), r.shadows.names.pop(key, None)
        r.loader_state.pop(key, None)
        for a in (name, shadow):
            if a is not None:
                LoaderRef(r.peers, a, r.timeout).close()
    job.parts = parts
    r.active.update(started)
    r.loader_state.update({key: state for key in started})
    for key in started:
        r.shadows.names[key] = None
        r.shadows.ensure(key)
    seconds = round(time.perf_counter() - t0, 4)
    log.info("source %r: resharded from %d to %d loader actors (%d workers each) in %.3f s", source, len(old),
             actors, workers, seconds)
    return {"source": source, "from": len(old), "to": actors, "workers": workers, "ok": True, "seconds": seconds,
            "where": {k: getattr(r.peers, "placement", {}).get(n) for k, n in started.items()}}
