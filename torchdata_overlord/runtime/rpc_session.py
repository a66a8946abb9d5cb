"""This process's RPC group, shared by every job (``RpcTransport``) that runs while it is up.

torch.distributed.rpc runs one agent per process, in a group whose members are fixed when it
starts. A *session* is that group as this process sees it: the first rpc job starts it (spawning
role worker processes with this process as client 0, or joining a trainer group's or a launcher's
group), jobs opened while it runs share it (each job's actors under its own prefix, on the same
worker processes), and the last job to close ends it: this process's agent stops locally, then the
workers it started exit. The next job starts a new session. :mod:`.rpc_agent` says why a process
can be in one group after another.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import select
import shutil
import signal
import tempfile
import threading
import time
import uuid
import weakref
from typing import Callable

from ..errors import ConfigError
from . import _rpc_worker as W
from . import rpc_leave as L
from .procstats import process_running
from .rpc_agent import CPP_ERRORS_ONLY, LOOPBACK_ENV, TransportStartupError, set_cpp_log_level, start_rpc, stop_rpc
from .transport import TransportClosed

__all__ = ["RpcSession", "open_spawned", "open_joined", "spawn_workers", "exited_during_start_up",
           "prestart_fork_server", "preload_also", "WorkerProcess"]

#: what the fork server imports once, so every worker (spares included) starts with it in shared pages
PRELOAD = ["torch", "torch.distributed.rpc", "pyarrow.parquet", W.__name__, "torchdata_overlord.runtime.planner_actor",
           "torchdata_overlord.transforms"]
_FREEZE = "torchdata_overlord.runtime._fork_freeze"   # imported last: freezes what the others made
_EXIT = "torchdata_overlord.runtime._fork_server_exit"   # the server removes its socket's folder when it exits
FIRST_JOB = "0/"
_ALSO: list[str] = []                         # modules the jobs' transforms asked the fork server to import


def preload_also(modules) -> None:
    """Have the fork server import ``modules`` too (a transform's ``preload``, e.g. torchvision for
    images): a loader actor started later, by a reshard or a recovery, then does not import them under
    the GIL of a process whose other actors serve steps. Only before the fork server starts."""
    for m in modules:
        if m not in _ALSO:
            _ALSO.append(m)

_LOCK = threading.Lock()                      # held while a session starts, joins, gains or loses a job
_CURRENT: "RpcSession | None" = None


_SUN_PATH_MAX = 107             # bytes of a Unix socket's path on Linux (its sun_path, 108 with the NUL)
_MP_NAMES = len("/pymp-xxxxxxxx/listener-xxxxxxxx")     # what multiprocessing adds to the temporary folder
_SHORT_TEMP = ("/tmp", "/var/tmp", "/usr/tmp")


def _socket_safe_tempdir() -> None:
    """Have multiprocessing keep its temporary folder, where the fork server's Unix socket lies, under a
    short system folder when ``TMPDIR`` is too long for that socket's path (a scheduler's per-job
    ``TMPDIR`` often is: the bind failed with ``OSError: AF_UNIX path too long``). multiprocessing
    does the same since CPython gh-132124 (3.13 and later releases); 3.11 and 3.12 do not. The folder is
    removed at exit, as multiprocessing's own is."""
    from multiprocessing import process, util

    config = process.current_process()._config
    if config.get("tempdir") is not None or len(os.fsencode(tempfile.gettempdir())) + _MP_NAMES <= _SUN_PATH_MAX:
        return
    base = next((d for d in _SHORT_TEMP if os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK)), None)
    if base is None:
        return                          # nowhere else to go: the bind below says why it fails
    folder = tempfile.mkdtemp(prefix="pymp-", dir=base)
    util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
    config["tempdir"] = folder


_UNGUARDED = ("the rpc runtime was started while a role process was importing the main module: the script "
              "builds its OverlordLoader at import time. Every role process imports the main module (for the "
              "strategy and transforms defined there), so put the code that builds and runs the loader under "
              "`if __name__ == \"__main__\":` (the strategy and transform definitions stay at module level)")


def _ensure_fork_server() -> None:
    """Start the fork server if it is not running (its socket in a folder short enough, see above), with
    :data:`PRELOAD`, the transforms' modules, then the freeze and the exit clean-up as its preloads."""
    from multiprocessing import forkserver, process
    if getattr(process.current_process(), "_inheriting", False):
        raise ConfigError(_UNGUARDED)
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD + _ALSO + [_FREEZE, _EXIT])
    _socket_safe_tempdir()
    try:
        forkserver.ensure_running()
    except OSError as e:
        if "too long" not in str(e):
            raise
        folder = process.current_process()._config.get("tempdir", tempfile.gettempdir())
        raise ConfigError(f"the rpc runtime's fork server cannot listen in {folder!r}: a Unix socket's path has at "
                          f"most {_SUN_PATH_MAX} bytes and multiprocessing adds {_MP_NAMES} to its temporary folder "
                          f"({e}); set TMPDIR to a shorter folder (e.g. /tmp)") from e


SESSION_PREFIX = "overlord-rpc-"     # a session's folder (its rendezvous file store)


def _session_folder(start_method: str) -> str:
    """A new folder for a session's rendezvous store: under the fork server's ``pymp-*`` folder when the
    workers come from it, since the server removes it after a trainer that was killed (SIGKILL, the OOM
    killer), with its socket (:mod:`._fork_server_exit`); else in the temporary folder. A trainer that
    exits removes it itself."""
    base = None
    if start_method == "forkserver":
        from multiprocessing import util
        base = util.get_temp_dir()
    return tempfile.mkdtemp(prefix=SESSION_PREFIX, dir=base)


def prestart_fork_server() -> None:
    """Start the fork server now (it returns at once; the server imports :data:`PRELOAD`, mostly torch,
    seconds on a small machine, in its own process), so that import overlaps what this process does
    before it spawns the workers: profiling the sources, placing the roles."""
    _ensure_fork_server()


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exited; it names that process even if the pid is reused), or None
    where the kernel or Python has none, or the process is gone already."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _exited(fd: int | None, pid: int) -> bool:
    """Whether process ``pid`` exited: its pidfd ``fd`` is readable, else (no pidfd) ``/proc`` says so."""
    if fd is not None:
        try:
            return bool(select.select([fd], [], [], 0)[0])
        except (OSError, ValueError):
            pass
    return not process_running(pid)


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class WorkerProcess:
    """A role worker process that :func:`spawn_workers` started, its liveness read from the process itself.

    Under the ``forkserver`` start method a worker is the fork server's child, and multiprocessing learns that
    it exited (its ``is_alive()``, ``exitcode``, ``join()``) from the fork server's socket: a fork server that
    dies (SIGKILL, the OOM killer picks it: it holds torch) closed that socket, and every worker then read as
    exited with code 255 while each still served its roles. Here a worker is alive while its pid is (a pidfd
    opened at its start; ``/proc`` where there are none), the exit code is multiprocessing's where the fork
    server reported it, and unknown (None, :meth:`describe_exit` says why) where the fork server died first."""

    def __init__(self, proc, server_pid: int | None = None):
        self._proc = proc
        self.name, self.pid = proc.name, proc.pid
        self._fd = _pidfd(proc.pid)
        if self._fd is not None:
            weakref.finalize(self, _close_fd, self._fd)
        self._server_pid = server_pid
        self._server_fd = _pidfd(server_pid) if server_pid is not None else None
        if self._server_fd is not None:
            weakref.finalize(self, _close_fd, self._server_fd)

    def fork_server_gone(self) -> bool:
        """Whether the fork server that started it died (it can no longer tell how this worker exits)."""
        return self._server_pid is not None and _exited(self._server_fd, self._server_pid)

    def is_alive(self) -> bool:
        return not _exited(self._fd, self.pid)

    @property
    def exitcode(self) -> int | None:
        """The exit code (None while it runs, and where it exited after its fork server died: unknown)."""
        if self.is_alive():
            return None
        code = self._proc.exitcode
        return None if code == 255 and self.fork_server_gone() else code

    def describe_exit(self) -> str:
        code = self.exitcode
        if code is not None:
            return f"exited with code {code}"
        if self.is_alive():
            return "is running"
        return "exited (with an unknown exit code: the multiprocessing fork server that started it died before it)"

    def join(self, timeout: float | None = None) -> None:
        """Wait until the process exited, at most ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._fd is not None:
            try:
                select.select([self._fd], [], [], timeout)
            except (OSError, ValueError):
                pass
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)
        if not self.is_alive():             # the fork server reports the code a moment after the exit
            left = 1.0 if deadline is None else deadline - time.monotonic()
            self._proc.join(max(0.05, min(1.0, left)))

    def kill(self) -> None:
        """SIGKILL the process (by its pidfd where there is one: never another process that reused its pid)."""
        if not self.is_alive():
            return
        try:
            if self._fd is not None and hasattr(signal, "pidfd_send_signal"):
                signal.pidfd_send_signal(self._fd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass

    def terminate(self) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
            except OSError:
                pass

    def __repr__(self) -> str:
        return f"<WorkerProcess {self.name} pid {self.pid} {self.describe_exit()}>"


def _fork_server_pid() -> int | None:
    from multiprocessing import forkserver
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def spawn_workers(members: list[tuple[str, int]], rendezvous: dict, rpc_timeout: float,
                  start_method: str = "forkserver") -> tuple[list, list]:
    """Start one role worker process per ``(name, rank)``; each exits when its pipe (the second
    list) is closed or its parent dies. Workers come from the fork server, which preloads torch (a fork server
    that died is started anew here); each is a :class:`WorkerProcess`, alive while its process is."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        _ensure_fork_server()
    procs, conns = [], []
    for name, rank in members:
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=W.worker_main, args=(name, rank, rendezvous["world_size"], rendezvous["init_method"],
                                                    rpc_timeout, r, rendezvous.get("env", {})),
                        name=name, daemon=True)
        p.start()
        r.close()
        procs.append(WorkerProcess(p, _fork_server_pid() if start_method == "forkserver" else None))
        conns.append(w)
    return procs, conns


def exited_during_start_up(procs) -> str | None:
    """Why a start-up cannot succeed: worker processes that exited already (None while all run)."""
    dead = [f"{p.name} ({p.describe_exit()})" for p in procs if not p.is_alive()]
    if not dead:
        return None
    return (f"RPC process(es) {dead} exited during start-up; each printed why to this process's stderr (e.g. "
            f"each exits so when the script builds its loader outside `if __name__ == \"__main__\":`)")


class RpcSession:
    """One RPC group this process is in (see the module docstring); made by :func:`open_spawned` or
    :func:`open_joined`, ended by the :meth:`release` of its last job."""

    def __init__(self, rendezvous: dict, client: int, stop_timeout: float, tmp: str | None = None):
        self.rendezvous, self.id, self.client = rendezvous, rendezvous["session"], client
        self.n_workers = int(rendezvous["n_workers"])
        self.clients = int(rendezvous["world_size"]) - self.n_workers
        self.stop_timeout, self.tmp = stop_timeout, tmp
        self.procs: list = []                 # the workers this process started (none for a joined group)
        self.conns: list = []
        self.jobs: set[str] = set()
        self.unhealthy = False                # a member died or froze: stop without waiting long
        self.up = False
        self._jobs = itertools.count(1)
        self._quiet_since: int | None = None  # C++ log level before a stopped job turned warnings off

    @property
    def launched(self) -> bool:
        return "client_ranks" in self.rendezvous

    def client_rank(self, c: int) -> int:
        """RPC rank of client ``c``: client 0 is rank 0 and workers 1..n unless the rendezvous says otherwise."""
        if self.launched:
            return int(self.rendezvous["client_ranks"][c])
        return 0 if c == 0 else self.n_workers + c

    def describe(self) -> str:
        if self.tmp is not None:
            return f"the RPC group this process started ({self.n_workers} role worker processes, {self.clients} client(s))"
        if self.launched:
            return f"the launched job at {self.rendezvous.get('address', '?')} (as its client {self.client})"
        return f"a trainer group's RPC group (as client {self.client} of {self.clients})"

    # ------------------------------------------------------------------------------ start

    @classmethod
    def _spawn(cls, n_workers: int, clients: int, startup_timeout: float, rpc_timeout: float, stop_timeout: float,
               start_method: str, on_rendezvous: Callable[[dict], None] | None) -> "RpcSession":
        tmp = _session_folder(start_method)
        rv = {"session": uuid.uuid4().hex, "init_method": f"file://{os.path.join(tmp, 'store')}",
              "world_size": n_workers + clients, "n_workers": n_workers, "rpc_timeout": rpc_timeout,
              "env": dict(LOOPBACK_ENV)}
        s = cls(rv, 0, stop_timeout, tmp)
        try:
            os.environ.update(LOOPBACK_ENV)
            s.procs, s.conns = spawn_workers([(W.worker_name(i), i + 1) for i in range(n_workers)], rv, rpc_timeout,
                                             start_method)
            if on_rendezvous is not None:    # the other clients learn how to join (before we wait for them)
                on_rendezvous(dict(rv, ns=FIRST_JOB))
            start_rpc(W.client_name(0), 0, rv["world_size"], rv["init_method"], startup_timeout,
                      abort=lambda: exited_during_start_up(s.procs))
            s.up = True
        except BaseException:
            s._end(fast=True)
            raise
        return s

    @classmethod
    def _join(cls, rendezvous: dict, client: int, startup_timeout: float, stop_timeout: float,
              abort: Callable[[], str | None]) -> "RpcSession":
        s = cls(dict(rendezvous), client, stop_timeout)
        try:
            os.environ.update(rendezvous.get("env", {}))
            start_rpc(W.client_name(client), s.client_rank(client), rendezvous["world_size"],
                      rendezvous["init_method"], startup_timeout, abort)
            s.up = True
        except BaseException:
            s._end(fast=True)
            raise
        return s

    # ------------------------------------------------------------------------------ jobs

    def release(self, ns: str, drop: bool) -> None:
        """Job ``ns`` is closed in this process: forget it (``drop``: and its actors, in every process
        of the group, while other jobs go on); the last job ends the session."""
        global _CURRENT
        with _LOCK:
            self.jobs.discard(ns)
            last = not self.jobs
            if last and _CURRENT is self:
                _CURRENT = None
        L.forget_job(ns)
        if not last:
            self._drop(ns, everywhere=drop)
            return
        self._end(fast=self.unhealthy)

    def quiet(self) -> None:
        """C++ warnings off until the session ends (its job was stopped: its peers are going away)."""
        if self._quiet_since is None:
            self._quiet_since = set_cpp_log_level(CPP_ERRORS_ONLY, at_least=True)

    def _drop(self, ns: str, everywhere: bool) -> None:
        """Forget job ``ns``'s actors and call counters here, and with ``everywhere`` in the workers too."""
        import torch.distributed.rpc as rpc

        futs = []
        for i, p in enumerate(self.procs if everywhere else []):
            if p.is_alive():
                futs.append(rpc.rpc_async(W.worker_name(i), W._drop, args=(ns,), timeout=5))
        W._drop(ns)
        for f in futs:
            try:
                f.wait()
            except BaseException:            # noqa: BLE001 - a dead worker holds nothing any more
                pass

    def _end(self, fast: bool) -> None:
        """Stop this process's agent (locally), then the workers it started; bounded by ``stop_timeout``."""
        deadline = time.monotonic() + (2.0 if fast else self.stop_timeout)
        if self.up:
            self.up = False
            stop_rpc(self.stop_timeout)
        W.forget_actors()
        L.forget()
        for c in self.conns:                 # EOF on the pipe: every worker exits
            try:
                c.close()
            except OSError:
                pass
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(2.0)
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self._quiet_since is not None:
            set_cpp_log_level(self._quiet_since)
            self._quiet_since = None


def _locked(timeout: float) -> None:
    if not _LOCK.acquire(timeout=timeout):
        raise TransportStartupError(f"another rpc loader of this process was still starting after {timeout:g} s")


def _conflict(s: RpcSession, wanted: str) -> TransportClosed:
    return TransportClosed(f"this process is in {s.describe()}, and torch.distributed.rpc runs one group per process: "
                           f"{wanted} cannot share it. Close the other rpc loader(s) of this process first (or open "
                           f"both the same way: rpc loaders opened alike share one group)")


def open_spawned(n_workers: int, clients: int, startup_timeout: float, rpc_timeout: float, stop_timeout: float,
                 start_method: str, on_rendezvous: Callable[[dict], None] | None) -> tuple[RpcSession, str]:
    """A job whose roles this process starts: a new session with ``n_workers`` worker processes, or
    the one this process already started for ``clients`` clients; (session, the job's prefix)."""
    global _CURRENT
    _locked(startup_timeout)
    try:
        s = _CURRENT
        if s is None:
            s = RpcSession._spawn(n_workers, clients, startup_timeout, rpc_timeout, stop_timeout, start_method,
                                  on_rendezvous)
            ns, _CURRENT = FIRST_JOB, s
        elif s.tmp is None or s.clients != clients:
            raise _conflict(s, f"a loader starting its own roles for {clients} client(s)")
        else:
            ns = f"{next(s._jobs)}/"
            if on_rendezvous is not None:
                on_rendezvous(dict(s.rendezvous, ns=ns))
        s.jobs.add(ns)
        return s, ns
    finally:
        _LOCK.release()


def open_joined(rendezvous: dict, client: int, startup_timeout: float, stop_timeout: float,
                abort: Callable[[], str | None] = lambda: None) -> tuple[RpcSession, str]:
    """A job another process started (trainer rank 0, or the launcher): join its group as client
    ``client``, or share it if this process is in that group already; (session, the job's prefix)."""
    global _CURRENT
    ns = rendezvous.get("ns", "")
    _locked(startup_timeout)
    try:
        s = _CURRENT
        if s is None:
            s = _CURRENT = RpcSession._join(rendezvous, client, startup_timeout, stop_timeout, abort)
        elif s.id != rendezvous.get("session") or s.client != client:
            raise _conflict(s, "a loader joining another group" if s.id != rendezvous.get("session") else
                            f"a loader joining it as client {client}")
        if ns in s.jobs:
            raise ConfigError(f"this process is already client {client} of that job ({s.describe()}); a launched job "
                              f"serves one loader per trainer process")
        s.jobs.add(ns)
        return s, ns
    finally:
        _LOCK.release()


@atexit.register
def _end_at_exit() -> None:
    """A session still up when the interpreter exits ends first (no RPC thread may outlive Python)."""
    s = _CURRENT
    if s is not None:
        for ns in list(s.jobs):
            s.release(ns, drop=False)
