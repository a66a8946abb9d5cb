"""What a client reports about its job: every role's stats, process and memory, and its own faults."""

from __future__ import annotations

import concurrent.futures as cf
import copy
import os

from .procstats import process_memory
from .refs import PLANNER, ActorRef, constructor_actor, loader_actor, shadow_actor
from .transport import ActorDied, CallTimeout

__all__ = ["serving", "job_stats", "snapshot", "closed_stats"]


def serving(job) -> tuple[dict[str, str], dict]:
    """Every role that serves now -> its actor (a replacement's name), asking the Planner. Roles keep
    their names across recoveries: ``planner``, ``loader:<source>``, ``shadow:<source>``, ``constructor:<i>``."""
    info = job._ask_planner(lambda p: p.roles())
    job.transport.learn(info["where"])
    roles = {PLANNER: job.planner_name, **{loader_actor(n): a for n, a in info["loaders"].items()},
             **{constructor_actor(c): a for c, a in enumerate(info["constructors"])},
             **{shadow_actor(n): a for n, a in info["shadows"].items() if a}}
    return roles, info


def job_stats(job) -> dict:
    """See :meth:`~.client.Job.stats`."""
    roles, info = serving(job)
    refs = {r: ActorRef(job.transport, a, job.timeout) for r, a in roles.items()}
    got, unanswered = {}, {}

    def ask(futs: dict) -> None:
        cf.wait(list(futs.values()), timeout=job.timeout + 5)
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
    return {"sources": {n: of(loader_actor(n)) for n in info["loaders"]}, "planner": of(PLANNER),
            "client": {"client": job.client, "fetches": job.fetches, "faults": copy.deepcopy(job.faults)},
            "constructors": {r: of(r) for r in roles if r.startswith("constructor:")},
            "roles": pids, "processes": procs, "spares": spare_pids, "unanswered": unanswered,
            "placement": None if getattr(job, "placement", None) is None else job.placement.to_dict(),
            "loader_parts": dict(info.get("parts", {})),
            "role_recovery": {r: {"actor": a, "pid": pids.get(r), "recoveries": replaced.get(r, 0)}
                              for r, a in roles.items()}}


def snapshot(job) -> dict | None:
    """The stats as :meth:`~.client.Job.close` begins, for ``stats()`` after it: only when the job had
    no failure and its Planner answers within a few seconds (a close never waits on a lost role)."""
    t = min(job.timeout, 5.0)
    try:
        if not job._running or job._stopped is not None or job.faults["failures"]:
            return None
        job.planner.roles(timeout=t).result(t + 1)
        return job_stats(job)
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
