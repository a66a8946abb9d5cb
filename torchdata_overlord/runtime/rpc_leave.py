"""Clients leaving a job, in every process of an RPC group: who left (the launcher's ledger), who
closed a job (asked by a trainer group's client 0), and why a launcher stopped a job.

A trainer client leaves a job on its own time: in a launched job it tells the launcher (the job's
ledger, which tells a trainer that left from one that died), then it shuts its RPC agent down
locally. No group-wide shutdown barrier: trainers finish seconds apart, and a barrier that times
out in one of them leaves RPC threads running Python while that interpreter finalizes (they abort
the process). No trainer calls another but a trainer group's client 0, asking the others whether
they closed (:func:`wait_clients_gone`): a trainer that accepted a pipe from a leaving one would log
its EOF.
"""

from __future__ import annotations

import collections
import threading

import torch.distributed.rpc as rpc

from ._rpc_worker import client_name

__all__ = ["left_clients", "wait_left", "wait_clients_gone", "mark_closed", "on_job_stopped", "forget_job", "forget"]


_LEFT: dict[str, set[int]] = collections.defaultdict(set)     # job namespace -> clients that left
_LEFT_CV = threading.Condition()


def _client_left(ns: str, client: int) -> None:
    """Run in the ledger: client ``client`` has left job ``ns``."""
    with _LEFT_CV:
        _LEFT[ns].add(int(client))
        _LEFT_CV.notify_all()


def left_clients(ns: str) -> set[int]:
    """The clients that told this process (their ledger) they left job ``ns``."""
    with _LEFT_CV:
        return set(_LEFT[ns])


def wait_left(ns: str, clients, timeout: float) -> set[int]:
    """Wait up to ``timeout`` seconds until every client in ``clients`` left job ``ns``; those that did not."""
    import time

    deadline, clients = time.monotonic() + timeout, set(clients)
    with _LEFT_CV:
        while not clients <= _LEFT[ns] and time.monotonic() < deadline:
            _LEFT_CV.wait(max(0.0, deadline - time.monotonic()))
        return clients - _LEFT[ns]


_CLOSED_HERE: set[str] = set()               # jobs this process's client closed (its group may go on)


def closed_here(ns: str) -> bool:
    """Asked by client 0: has this process's client of job ``ns`` closed?"""
    with _LEFT_CV:
        return ns in _CLOSED_HERE


def mark_closed(ns: str) -> None:
    """This process's client of job ``ns`` closed (its group may go on for other jobs)."""
    with _LEFT_CV:
        _CLOSED_HERE.add(ns)


def wait_clients_gone(ns: str, clients, timeout: float, ping_every: float = 0.25) -> list[int]:
    """In client 0 of a trainer group, closing job ``ns``: wait up to ``timeout`` seconds until every
    client in ``clients`` closed it (or its process is unreachable: it stopped, or died); the clients
    still there. Only this process calls the others, so none leaving closes a pipe it accepted."""
    import time

    deadline, missing, pause = time.monotonic() + timeout, set(clients), threading.Event()
    while missing and time.monotonic() < deadline:
        pings = {c: rpc.rpc_async(client_name(c), closed_here, args=(ns,), timeout=ping_every) for c in missing}
        for c, f in pings.items():
            try:
                if f.wait():
                    missing.discard(c)
            except BaseException:        # noqa: BLE001 - unreachable: gone
                missing.discard(c)
        if missing:
            pause.wait(min(ping_every, max(0.0, deadline - time.monotonic())))
    return sorted(missing)


_STOPPED: dict[str, str] = {}                     # job namespace -> why its coordinator stopped it
_ON_STOP: dict[str, list] = collections.defaultdict(list)


def on_job_stopped(ns: str, callback) -> None:
    """Call ``callback(reason)`` (on an RPC thread) when the coordinator of job ``ns`` stops it."""
    with _LEFT_CV:
        _ON_STOP[ns].append(callback)
        reason = _STOPPED.get(ns)
    if reason is not None:
        callback(reason)


def forget_job(ns: str) -> None:
    """This process is done with job ``ns``: drop its stop callbacks and notice."""
    with _LEFT_CV:
        _ON_STOP.pop(ns, None)
        _STOPPED.pop(ns, None)
        _LEFT.pop(ns, None)


def _job_stopped(ns: str, reason: str) -> None:
    """Run in a client: the coordinator (the launcher) stops job ``ns`` for ``reason``."""
    with _LEFT_CV:
        _STOPPED[ns] = reason
        callbacks = list(_ON_STOP[ns])
    for cb in callbacks:
        cb(reason)


def forget() -> None:
    """This process left its RPC group: forget every job's leavers, closings and stop notices."""
    with _LEFT_CV:
        _LEFT.clear()
        _STOPPED.clear()
        _ON_STOP.clear()
        _CLOSED_HERE.clear()
