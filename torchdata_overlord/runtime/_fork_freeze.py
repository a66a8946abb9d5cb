"""Imported last by the rpc fork server (after :data:`.rpc_session.PRELOAD`): moves every object the
preloads made (torch's, pyarrow's, torchvision's modules) into the collector's permanent generation
before the server forks any worker.

Without it, the first full collection in each worker walks those objects and writes their GC
headers, so every page holding one is copied into the worker: each role process paid for its own
copy of the preloaded modules (about 70 MiB of PSS each with torchvision preloaded, measured by
``benchmarks/fault_recovery.py``'s shadow-cost run), instead of sharing the fork server's. This is
the fork-without-exec recipe of ``gc.freeze``'s documentation. Imported anywhere else, it does nothing.
"""

import gc
import sys


def fork_server_frame():
    """The frame of ``multiprocessing.forkserver.main`` when this runs inside it (its preload loop), else None."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return frame
        frame = frame.f_back
    return None


if fork_server_frame() is not None:
    gc.collect()            # no garbage frozen with the rest (and no holes left in the frozen pages)
    gc.freeze()
