"""Imported by the rpc fork server (a preload, after :mod:`._fork_freeze`): when the server exits because the
process that started it is gone, it removes its listening socket, and the socket's folder once empty.

multiprocessing puts that socket in a ``pymp-*`` folder of the temporary folder, which the process that made
the folder removes when it exits normally; a trainer that is killed (SIGKILL, the OOM killer, a preempted
job) left both behind. The server exits once the process that started it is gone, however it ended (its
``alive`` pipe reads end-of-file), and then cleans up after it. While that process lives (a normal exit: it
removes its folder itself, after the server's socket) the server leaves everything as it is, and the
folder stays while anything else is in it (a folder a process inherited from a parent is shared with
that parent's own server). The server's children (the role processes) never run it (the check is on the
server's pid). Imported anywhere else, it does nothing.
"""

import atexit
import os
import socket

from ._fork_freeze import fork_server_frame


def _socket_path(listener_fd: int) -> str | None:
    """The path of the server's listening socket, when it is one in a ``pymp-*`` folder."""
    s = socket.socket(fileno=os.dup(listener_fd))
    try:
        path = s.getsockname()
    finally:
        s.close()
    ok = isinstance(path, str) and os.path.basename(os.path.dirname(path)).startswith("pymp-")
    return path if ok else None


def _clean(path: str, pid: int, parent: int) -> None:
    if os.getpid() != pid or os.getppid() == parent:        # a child, or the starter lives (and cleans up)
        return
    for remove, what in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
        try:
            remove(what)
        except OSError:                                     # gone already, or the folder holds more
            return


_frame = fork_server_frame()
if _frame is not None:
    _path = _socket_path(_frame.f_locals["listener_fd"])
    if _path is not None:
        atexit.register(_clean, _path, os.getpid(), os.getppid())
del _frame
