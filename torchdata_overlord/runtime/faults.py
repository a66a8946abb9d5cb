"""Failure injection for tests and benchmarks: kill a named role (SIGKILL), freeze it (SIGSTOP, so only
a call's timeout can tell), thaw it, or corrupt its newest checkpoint; kill a spare process.

Roles are named as the Planner serves them *now*: ``"planner"``, ``"loader:<source>"`` (the source's
current primary, a promoted shadow included), ``"shadow:<source>"``, ``"constructor:<i>"``. A job is an
:class:`~torchdata_overlord.OverlordLoader` (``runtime="rpc"``) or an
:class:`~torchdata_overlord.runtime.rpc_job.RpcJob`; on an in-process transport a kill stops the
actor (there is no process to signal).
"""

from __future__ import annotations

import os
import signal

from ..errors import ConfigError
from .checkpoint_store import CheckpointStore
from .refs import ActorRef

__all__ = ["resolve", "role_pid", "kill_role", "kill_roles", "kill_spare", "freeze_role", "thaw", "corrupt_newest"]


def _job(job):
    return getattr(job, "_job", job)


def resolve(job, role: str) -> str:
    """The actor serving ``role`` now."""
    job = _job(job)
    if role == "planner":
        return job.planner_name
    info = job.planner.roles().result(job.timeout + 5)
    job.transport.learn(info["where"])
    kind, _, name = role.partition(":")
    if kind == "loader" and name in info["loaders"]:
        return info["loaders"][name]
    if kind == "shadow" and info["shadows"].get(name):
        return info["shadows"][name]
    if kind == "constructor" and name.isdigit() and int(name) < len(info["constructors"]):
        return info["constructors"][int(name)]
    raise ConfigError(f"no role {role!r} serves now; roles: planner, loader:/shadow:<source> for "
                      f"{sorted(info['loaders'])}, constructor:0..{len(info['constructors']) - 1}")


def role_pid(job, role: str) -> int:
    """Process id of the worker hosting ``role``."""
    job = _job(job)
    actor = resolve(job, role)
    return int(ActorRef(job.transport, actor, job.timeout).process().result(job.timeout + 5)["pid"])


def kill_role(job, role: str) -> int:
    """SIGKILL the process hosting ``role`` (every actor it hosts dies); returns its pid."""
    return kill_roles(job, [role])[0]


def kill_roles(job, roles: list[str]) -> list[int]:
    """Kill several roles at once (all are found before any dies); returns their pids."""
    job = _job(job)
    return job.transport.kill([resolve(job, r) for r in roles])


def kill_spare(job, i: int) -> int:
    """SIGKILL spare process ``i`` (as listed in ``stats()["spares"]``), whatever it hosts; returns its pid."""
    job = _job(job)
    pids = job.transport.worker_pids[job.n_workers:]
    if not 0 <= i < len(pids):
        raise ConfigError(f"no spare process {i}: this job has {len(pids)} spare processes")
    os.kill(pids[i], signal.SIGKILL)
    return pids[i]


def freeze_role(job, role: str) -> int:
    """SIGSTOP the process hosting ``role``: it stays connected but answers nothing; returns its pid."""
    pid = role_pid(job, role)
    os.kill(pid, signal.SIGSTOP)
    return pid


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def corrupt_newest(checkpoint_dir: str, key: str) -> int:
    """Corrupt the newest version of ``key`` (``"planner"``, ``"loader/<source>"``); returns its step."""
    store = CheckpointStore(checkpoint_dir)
    steps = store.steps(key)
    if not steps:
        raise ConfigError(f"nothing to corrupt: {checkpoint_dir} has no {key!r} checkpoint")
    store.corrupt(key, steps[-1])
    return steps[-1]
