"""What every role actor shares: it answers where it runs, and how actors wait on each other."""

from __future__ import annotations

import concurrent.futures as cf
import os
from typing import Iterable, Mapping

from .procstats import listening_addresses, process_memory
from .transport import settle

__all__ = ["RoleActor", "gather", "fail_all"]


class RoleActor:
    """Base of the role actors: ``process()`` is the role's process id, memory and listening sockets
    (``detail=False``: the id only, cheap: many roles share a process, whose memory is read once)."""

    def process(self, detail: bool = True) -> dict:
        if not detail:
            return {"pid": os.getpid()}
        return {**process_memory(os.getpid()), "listening": listening_addresses(os.getpid())}


def gather(futs: Mapping, timeout: float) -> dict:
    """Wait for every future (issued together), then their results, or raise the first error."""
    cf.wait(list(futs.values()), timeout=timeout + 5)
    return {k: f.result(timeout=1) for k, f in futs.items()}


def fail_all(futs: Iterable[cf.Future], exc: BaseException) -> None:
    for fut in futs:
        settle(fut, exc=exc)
