"""What ``/proc`` (Linux) tells of a process: memory (RSS/PSS in MiB), open files, listening sockets."""

from __future__ import annotations

import os

__all__ = ["smaps_rollup", "process_memory", "process_cpu_seconds", "process_running", "open_paths", "listening_addresses"]


def smaps_rollup(pid: int) -> dict[str, float] | None:
    """Every kB field of ``/proc/<pid>/smaps_rollup`` (``Rss``, ``Pss``, ``Pss_Anon``, ``Pss_File``,
    ...) in MiB; None if the process is gone or the file unreadable."""
    out = {}
    try:
        with open(f"/proc/{int(pid)}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) / 1024
    except (OSError, ValueError):
        return None
    return out


def process_memory(pid: int | None = None) -> dict:
    """``{"pid", "rss_mib", "pss_mib"}`` from ``/proc/<pid>/smaps_rollup`` (None values where unreadable)."""
    pid = os.getpid() if pid is None else int(pid)
    got = smaps_rollup(pid) or {}
    return {"pid": pid, **{f"{k.lower()}_mib": round(got[k], 1) if k in got else None for k in ("Rss", "Pss")}}


def process_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an exited child its parent has not reaped)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _fd_links(pid: int) -> list[str]:
    out = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def open_paths(pid: int, suffix: str = "") -> list[str]:
    """Files process ``pid`` holds open (ending in ``suffix``), from ``/proc/<pid>/fd``."""
    return sorted({p for p in _fd_links(pid) if p.startswith("/") and p.endswith(suffix)})


def listening_addresses(pid: int) -> list[str]:
    """The TCP addresses process ``pid`` listens on: ``"127.0.0.1:port"``, or ``"[<ipv6 hex>]:port"``."""
    inodes = {link[8:-1] for link in _fd_links(pid) if link.startswith("socket:[")}
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for line in rows:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:          # 0A: LISTEN
                continue
            addr, port = cols[1].split(":")
            host = f"[{addr}]" if v6 else ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
            found.append(f"{host}:{int(port, 16)}")
    return sorted(found)


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used (``/proc/<pid>/stat``), None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
