"""What a client reports about its job: every role's stats, process and memory, and its own faults."""

from __future__ import annotations

import concurrent.futures as cf
import copy
import os
import time

from ..errors import OverlordError
from ..roles.loader_parts import part_keys
from .procstats import process_memory
from .refs import PLANNER, ActorRef, constructor_actor, loader_actor, shadow_actor
from .transport import ActorDied, CallTimeout

__all__ = ["serving", "job_stats", "snapshot", "closed_stats"]


def serving(job, info: dict | None = None) -> tuple[dict[str, str], dict]:
    """Every role that serves now -> its actor (a replacement's name), asking the Planner (``info``: its
    ``roles()`` answer, when the caller has it). Roles keep their names across recoveries: ``planner``,
    ``loader:<source>``, ``shadow:<source>``, ``constructor:<i>``."""
    info = job._ask_planner(lambda p: p.roles()) if info is None else info
    job.transport.learn(info["where"])
    roles = {PLANNER: job.planner_name, **{loader_actor(n): a for n, a in info["loaders"].items()},
             **{constructor_actor(c): a for c, a in enumerate(info["constructors"])},
             **{shadow_actor(n): a for n, a in info["shadows"].items() if a}}
    return roles, info


def job_stats(job, wait: float | None = None, info: dict | None = None, skip_silent: bool = False) -> dict:
    """See :meth:`~.client.Job.stats`; ``wait``: how long to wait for the roles' answers, in all (default: the
    call timeout, plus 5 s); ``info``: the Planner's ``roles()`` answer, when the caller has it (then the
    Planner is not asked again). A Planner that does not answer (busy waiting for a stuck role, frozen, gone)
    is listed in ``"unanswered"``, its roles taken from the configuration. ``skip_silent``: roles whose process
    answered no ping at the close's (:meth:`~.client.Job._find_silent`) are listed so, not asked."""
    wait = job.timeout + 5 if wait is None else wait
    deadline = time.monotonic() + wait
    got, unanswered = {}, {}
    try:
        roles, info = serving(job, info)
    except (ActorDied, CallTimeout, OverlordError) as e:     # diagnostics: said, not raised
        unanswered[PLANNER] = f"{type(e).__name__}: {e}"
        info = {"loaders": {k: loader_actor(k) for k in job.cfg.parts.keys}, "shadows": {},
                "constructors": list(job._constructors), "where": {}, "parts": job.cfg.parts.to_dict()}
        roles = {**{loader_actor(k): a for k, a in info["loaders"].items()},
                 **{constructor_actor(c): a for c, a in enumerate(info["constructors"])}}
    asked = dict(roles)
    for r, a in roles.items() if skip_silent else ():
        if not job._answers(a):
            unanswered[r] = "its process answered no ping (frozen or gone)"
            del asked[r]
    refs = {r: ActorRef(job.transport, a, job.timeout) for r, a in asked.items()}

    def ask(futs: dict) -> None:
        cf.wait(list(futs.values()), timeout=max(0.0, deadline - time.monotonic()))
        for (kind, r), fut in futs.items():
            try:
                got[kind, r] = fut.result(timeout=0)
            except (ActorDied, CallTimeout, cf.TimeoutError) as e:   # a busy or failed role: said, not raised
                unanswered[r] = f"{type(e).__name__}: {e}"

    ask({(kind, r): ref.stats() if kind == "stats" else ref.process(detail=False)
         for r, ref in refs.items() for kind in ("stats", "pid")})
    pids = {r: got["pid", r]["pid"] for r in roles if ("pid", r) in got}
    one_role = {pid: r for r, pid in pids.items() if pid != os.getpid()}       # memory once per process
    ask({("process", r): refs[r].process() for r in one_role.values()})

    def of(r):
        return got.get(("stats", r)) or {"error": unanswered.get(r, "no answer")}

    procs = {m["pid"]: m for (kind, _), m in got.items() if kind == "process"}
    procs[os.getpid()] = process_memory()
    spare_pids = job.transport.worker_pids[job.n_workers:] if job.client == 0 and job.spares else []
    replaced = info.get("replaced", {})
    return {"sources": by_source({n: of(loader_actor(n)) for n in info["loaders"]}, info.get("parts", {})),
            "planner": of(PLANNER),
            "client": {"client": job.client, "fetches": job.fetches, "faults": copy.deepcopy(job.faults)},
            "constructors": {r: of(r) for r in roles if r.startswith("constructor:")},
            "roles": pids, "processes": procs, "spares": spare_pids, "unanswered": unanswered,
            "placement": None if getattr(job, "placement", None) is None else job.placement.to_dict(),
            "loader_parts": dict(info.get("parts", {})),
            "role_recovery": {r: {"actor": a, "pid": pids.get(r), "recoveries": replaced.get(r, 0)}
                              for r, a in roles.items()}}


_SUMMED = ("buffered", "buffer_bytes", "served", "row_groups_read")


def by_source(loaders: dict[str, dict], counts: dict[str, int]) -> dict[str, dict]:
    """Per-loader stats -> per-source stats: a source split over ``k`` loader actors (``counts``; keys
    ``source@jofk``) gets its parts' stats merged, each part's own under ``"parts"``. Counts add up; a file
    skipped whole is skipped by every part (each opens every file), so it is counted once."""
    out: dict[str, dict] = {}
    named: set[str] = set()
    for source, k in counts.items():
        keys = part_keys(source, k)
        named.update(keys)
        if k == 1 or not all(key in loaders for key in keys):
            out.update({key: loaders[key] for key in keys if key in loaders})
            continue
        parts = {key: loaders[key] for key in keys}
        merged: dict = {"parts": parts}
        if any("error" in st for st in parts.values()):
            merged["error"] = "; ".join(f"{key}: {st['error']}" for key, st in parts.items() if "error" in st)
            out[source] = merged
            continue
        for f in _SUMMED:
            got = [st.get(f) for st in parts.values()]
            merged[f] = None if any(v is None for v in got) else sum(got)
        merged["epochs_started"] = sorted({e for st in parts.values() for e in st.get("epochs_started", ())})
        merged["exhausted"] = any(st.get("exhausted") for st in parts.values())
        files: dict[str, int] = {}
        skipped = distinct = 0
        for st in parts.values():
            whole = st.get("skipped_files", {})
            skipped += st.get("skipped", 0) - sum(whole.values())
            distinct += st.get("skipped_distinct", 0) - len(whole)
            for f, n in whole.items():
                files[f] = max(files.get(f, 0), n)
        merged.update(skipped=skipped + sum(files.values()), skipped_distinct=distinct + len(files),
                      skipped_files=files)
        out[source] = merged
    out.update({key: st for key, st in loaders.items() if key not in named})    # (loaders the counts do not name)
    return out


def snapshot(job) -> dict | None:
    """The stats as :meth:`~.client.Job.close` begins, for ``stats()`` after it: only when the job had
    no failure and its Planner answers, all within ``min(timeout, 5)`` s (a close never waits on a lost role,
    nor a call timeout on a busy one: a role busy in a call that long is listed as unanswered; under a close's
    deadline, :class:`~.local.LocalJob`'s, within what is left of it)."""
    t = job._close_wait(min(job.timeout, 5.0))
    end = time.monotonic() + t
    try:
        if not job._running or job._stopped is not None or job.faults["failures"] or t <= 0 or \
                not job._answers(job.planner_name):
            return None
        info = job.planner.roles(timeout=t).result(t + 1)
        # the roles get what is left of the same few seconds: a role busy in a call (a transform stuck in user
        # code) held an rpc job's close up here until its calls timed out, up to twice (60 to 120 s at the defaults)
        return job_stats(job, wait=max(0.0, min(job._close_wait(t), end - time.monotonic())), info=info,
                         skip_silent=True)
    except Exception:                    # noqa: BLE001 - diagnostics only: close anyway
        return None


def closed_stats(job) -> dict:
    out = copy.deepcopy(job._final_stats) if job._final_stats is not None else {
        "sources": {}, "planner": {}, "constructors": {}, "roles": {}, "spares": [], "unanswered": {},
        "processes": {os.getpid(): process_memory()}}
    out.update(closed=True, client={"client": job.client, "fetches": job.fetches,
                                    "faults": copy.deepcopy(job.faults)})
    if job._stopped is not None:
        out["stopped"] = job._stopped
    return out
