"""What every benchmark script shares: the machine's description and writing the results JSON."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
from datetime import datetime, timezone
from pathlib import Path


def machine() -> dict:
    """Cores, memory, Python, processor, load and torch threads: printed beside every figure."""
    import torch

    return {"cores": os.cpu_count(), "python": platform.python_version(), "processor": platform.machine(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def write_results(path: Path, payload: dict, started: float | None = None, load_start: float | None = None) -> None:
    """Add the machine, the date and (from ``started``, a ``time.perf_counter()``) the total time to
    ``payload``, write it as JSON to ``path`` (folders created) and say where."""
    import time

    payload["machine"] = {**machine(), **({} if load_start is None else {"load_avg_1m_at_start": load_start})}
    payload["date"] = today()
    note = ""
    if started is not None:
        payload["total_s"] = time.perf_counter() - started
        note = f" ({payload['total_s']:.0f} s in all)"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}{note}")


def spawn_one(script: str, kind: str, args: dict, mark: str, timeout: float, cwd: str | None = None,
              env: dict | None = None) -> dict:
    """Run ``python <script> --one <kind> --args <json>`` (a figure measured in a fresh process, ``env``
    added to its environment) and return the JSON it printed after ``mark``; a failed run raises with
    the end of its output."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, script, "--one", kind, "--args", json.dumps(args)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=None if env is None else {**os.environ, **env})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(mark)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} run failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(mark):])


@contextlib.contextmanager
def building(root: Path):
    """A fresh folder beside ``root`` to write a corpus into: on success it replaces ``root`` in one
    rename (a reader never sees half a corpus), on failure it is removed."""
    tmp = root.parent / f".{root.name}.build-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if root.exists():
            shutil.rmtree(root)
        os.rename(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, from ``/proc/<pid>/task/*/children``."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                continue
    return out


def reap(pids, wait: float = 20.0) -> list[int]:
    """The processes of ``pids`` (every one a finished run saw) still alive after ``wait`` seconds, then
    SIGKILLed: a run's orphans see their parent's exit within a few seconds, so any left is a leak."""
    import signal
    import threading
    import time

    from torchdata_overlord.runtime.procstats import process_running

    deadline = time.monotonic() + wait
    left = [p for p in pids if process_running(p)]
    while left and time.monotonic() < deadline:
        threading.Event().wait(0.1)                  # polling /proc for the exits, bounded by the deadline
        left = [p for p in left if process_running(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
