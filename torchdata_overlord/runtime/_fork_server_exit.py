"""Imported by the rpc fork server (a preload, after :mod:`._fork_freeze`): when the server exits because the
process that started it is gone, it removes its listening socket, and the socket's folder once empty.

multiprocessing puts that socket in a ``pymp-*`` folder of the temporary folder, which the process that made
the folder removes when it exits normally; a trainer that is killed (SIGKILL, the OOM killer, a preempted
job) left both behind, and the rpc sessions' rendezvous stores the trainer keeps there (``overlord-rpc-*``).
The server exits once the process that started it is gone, however it ended (its
``alive`` pipe reads end-of-file), and then cleans up after it. While that process lives (a normal exit: it
removes its folder itself, after the server's socket) the server leaves everything as it is, and the
folder stays while anything else is in it (a folder a process inherited from a parent is shared with
that parent's own server). The server's children (the role processes) never run it (the check is on the
server's pid). Imported anywhere else, it does nothing.

A SIGTERM sent to the trainer's whole process group (``timeout``, a scheduler cancelling a job) reaches the
server too, which died of it at once and left both behind. The server takes SIGTERM as an order to exit: it
waits up to :data:`_GRACE` seconds for its starter to be gone too, then exits the same way, cleaning up after
a starter that is gone. Its children (the role processes) get SIGTERM's default action back at fork. Whether
the starter is gone is read from its pidfd, which is readable once it has exited and this server has a new
parent (the parent pid alone where there are no pidfds).
"""

import atexit
import os
import select
import shutil
import signal
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


def _starter_gone(parent: int, pidfd: int | None, wait: float = 0.0) -> bool:
    """Whether the process that started the server has exited, waiting up to ``wait`` seconds for it. Its pidfd
    (where the kernel has them) is readable once it has, with its children (this server) already given to
    another parent; the alive pipe is not enough: it ends as the starter's files close, a moment before,
    and a starter that lives closes it too when it stops the server."""
    if pidfd is not None:
        try:
            return bool(select.select([pidfd], [], [], wait)[0])
        except (OSError, ValueError):
            pass
    return os.getppid() != parent


def _clean(path: str, pid: int, parent: int, pidfd: int | None) -> None:
    if os.getpid() != pid or not _starter_gone(parent, pidfd):   # a child, or the starter lives (and cleans up)
        return
    folder = os.path.dirname(path)
    try:
        names = os.listdir(folder)
    except OSError:
        names = []
    for name in names:                                      # its sessions' rendezvous stores (rpc_session)
        if name.startswith("overlord-rpc-"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    for remove, what in ((os.unlink, path), (os.rmdir, folder)):
        try:
            remove(what)
        except OSError:                                     # gone already, or the folder holds more
            return


_GRACE = 2.0        # s a terminated server waits for its starter to be gone too (a group's SIGTERM reaches both)


def _exit_on_sigterm(parent: int, pidfd: int | None):
    def terminated(signum, _frame):                         # (the server's own: children reset it at fork)
        _starter_gone(parent, pidfd, _GRACE)
        raise SystemExit(128 + signum)                      # out of the server's loop: the atexit clean-up runs
    return terminated


def _in_child(pidfd: int | None) -> None:
    """A role process forked by the server: SIGTERM's default action, and no handle on the trainer."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if pidfd is not None:
        os.close(pidfd)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):                       # no pidfds here: the parent pid alone tells
        return None


_frame = fork_server_frame()
if _frame is not None:
    _path = _socket_path(_frame.f_locals["listener_fd"])
    if _path is not None:
        _who = (os.getpid(), os.getppid(), _pidfd(os.getppid()))
        atexit.register(_clean, _path, *_who)
        signal.signal(signal.SIGTERM, _exit_on_sigterm(*_who[1:]))
        os.register_at_fork(after_in_child=lambda: _in_child(_who[2]))
del _frame
