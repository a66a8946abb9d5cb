"""Memory of a process from ``/proc`` (Linux): resident and proportional set sizes, in MiB."""

from __future__ import annotations

import os

__all__ = ["process_memory"]


def process_memory(pid: int | None = None) -> dict:
    """``{"pid", "rss_mib", "pss_mib"}`` from ``/proc/<pid>/smaps_rollup`` (None values where unreadable)."""
    pid = os.getpid() if pid is None else int(pid)
    out = {"pid": pid, "rss_mib": None, "pss_mib": None}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    out[f"{key.lower()}_mib"] = round(int(rest.split()[0]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return out
