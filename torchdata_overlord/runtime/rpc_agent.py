"""This process's torch.distributed.rpc agent: start it (bounded), stop it (locally), and what torch
2.14.1 needs for that to work more than once per process and without noise.

* A process can be in several RPC groups one after another, never two at once (torch keeps one
  agent per process). Joining a new group needs :func:`fresh_rpc_state` and :func:`init_rpc`'s
  care for distributed autograd (set up once per process, for one rank), and no group may ever be
  left through the graceful barrier: ``agent.join`` numbers its rounds with a C++ static
  (``barrierId`` in agent_utils.cpp) that fresh members do not share, so the next group's barrier
  would wait forever. Every member leaves with a local shutdown instead (:func:`stop_rpc`).
* TensorPipe warns (C++ ``LOG(WARNING)``) for each pipe that closes under a running agent, and only
  the graceful barrier tells it a close is expected: a local shutdown, or a peer leaving, prints a
  line per pipe. :func:`set_cpp_log_level` turns C++ warnings off (errors still print): always in
  the role workers and the launcher, which report lost peers themselves; in a trainer only while
  its own agent stops (:func:`stop_rpc`).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import threading
import time
import warnings
from typing import Callable

import torch
import torch.distributed.rpc as rpc

from ..errors import OverlordError
from . import lane, shm

__all__ = ["TransportStartupError", "start_rpc", "stop_rpc", "init_rpc", "fresh_rpc_state", "set_cpp_log_level",
           "self_name"]
log = logging.getLogger(__name__)

#: the one Gloo deprecation warning every ``init_rpc`` prints (torch 2.14.1)
GLOO_WARNING = r"You are using a Backend .* as a ProcessGroup"
#: interface environment for TensorPipe and Gloo: loopback only
LOOPBACK_ENV = {"TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
#: c10's log threshold that keeps errors and drops warnings (0 info, 1 warning, 2 error)
CPP_ERRORS_ONLY = 2


class TransportStartupError(OverlordError, RuntimeError):
    """The RPC workers did not come up (a worker died or ``startup_timeout`` passed)."""


def set_cpp_log_level(level: int, at_least: bool = False) -> int | None:
    """Set c10's C++ log threshold (``FLAGS_caffe2_log_level``); the previous one, None where it cannot
    be found. With ``at_least`` (quieting), only raise it, and never where the user chose a level
    (``TORCH_CPP_LOG_LEVEL``, e.g. to debug RPC)."""
    if at_least and os.environ.get("TORCH_CPP_LOG_LEVEL"):
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        flag = ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None
    previous = flag.value
    flag.value = max(previous, int(level)) if at_least else int(level)
    return previous


def backend_options(init_method: str, rpc_timeout: float) -> rpc.TensorPipeRpcBackendOptions:
    # uv (TCP) transport and the basic channel only: no shared-memory or multiplexed-uv listeners.
    # Same-host tensors skip the socket through our own shared memory (.shm), not TensorPipe's "shm"
    # transport: its reactor polls (~40% of a core per idle process, measured on 2 cores)
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=rpc_timeout,
                                           num_worker_threads=16, _transports=["uv"], _channels=["basic"])


def fresh_rpc_state() -> None:
    """Reset torch's per-process RPC bookkeeping before joining a new group. torch numbers the store
    prefix of each ``init_rpc`` and each start-up all-gather per process, assuming every member
    re-initialises in lockstep; a new group's workers are fresh processes (at 0), so a process that
    was in an earlier group would otherwise wait for keys nobody writes."""
    import torch.distributed.rpc.api as api

    with rpc._init_counter_lock:
        rpc._init_counter = 0
    with api._all_gather_dict_lock:
        api._all_gather_sequence_id.clear()
        api._all_gather_sequence_id_to_states.clear()


def _autograd_set_up_once(real: Callable[[int], None]) -> Callable[[int], None]:
    """``init_rpc`` sets distributed autograd up for this process's rank, and the C++ container can
    be set up once: a process that was client 1 of one group and is client 0 of the next would fail
    ("Container is already initialized with worker_id ..."). The library never uses distributed
    autograd (its messages carry no autograd context), so the first set-up stands."""
    def init(worker_id: int) -> None:
        try:
            real(worker_id)
        except RuntimeError as e:
            if "already initialized" not in str(e):
                raise
    return init


_SELF: list[str] = []          # this process's worker name while its agent runs (see self_name)


def self_name() -> str:
    """This process's RPC worker name. Asked on every call, so kept: ``rpc.get_worker_info()`` lets
    the GIL go, and taking it back behind the busy threads of a worker costs up to a switch interval."""
    return _SELF[0] if _SELF else rpc.get_worker_info().name


def init_rpc(name: str, rank: int, world_size: int, init_method: str, rpc_timeout: float) -> None:
    import torch.distributed.autograd as dist_autograd

    fresh_rpc_state()
    shm.reset()
    lane.reset()
    _SELF.clear()
    real = dist_autograd._init
    dist_autograd._init = _autograd_set_up_once(real)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=GLOO_WARNING, category=UserWarning)
            rpc.init_rpc(name, rank=rank, world_size=world_size,
                         rpc_backend_options=backend_options(init_method, rpc_timeout))
        _SELF.append(name)
    finally:
        dist_autograd._init = real


_INITS: list[threading.Thread] = []            # init threads of start-ups that gave up (still in torch)


@atexit.register
def _join_gave_up(timeout: float = 15.0) -> None:
    """At exit, let start-ups that gave up end first: an interpreter finalizing while one is still in
    ``init_rpc`` aborts the process ("terminate called without an active exception")."""
    deadline = time.monotonic() + timeout
    for t in list(_INITS):
        t.join(max(0.0, deadline - time.monotonic()))


def start_rpc(name: str, rank: int, world_size: int, init_method: str, startup_timeout: float,
              abort: Callable[[], str | None] = lambda: None) -> None:
    """``init_rpc`` in a thread, bounded by ``startup_timeout``; ``abort()`` says why to give up early
    (a worker died, Ctrl-C), or None. The agent's own waits (its store, the start-up all-gather, and
    calls that give no timeout: the library's all do) take ``startup_timeout`` too, so a start-up
    that gave up ends in its thread about a second later."""
    from .rendezvous import register

    stuck = [t for t in _INITS if t.is_alive()]
    for t in stuck:                      # a start-up that gave up ends on its own store timeout
        t.join(5.0)
    _INITS[:] = [t for t in stuck if t.is_alive()]
    if _INITS:
        raise TransportStartupError("an earlier RPC start-up in this process has not ended yet (it ends within its "
                                    "startup_timeout); try again later")
    register()
    errors: list = []
    lock, state = threading.Lock(), {"up": False, "gave_up": False}

    def init():
        try:
            init_rpc(name, rank, world_size, init_method, max(1.0, startup_timeout))
        except BaseException as e:       # noqa: BLE001
            errors.append(e)
            stop_rpc(5.0)                # one that failed half-way leaves its agent set: the next would be refused
            return
        with lock:
            state["up"] = not state["gave_up"]
        if not state["up"]:              # assembled after all, but nobody waits for it any more
            stop_rpc(5.0)

    def give_up(why: str) -> None:
        with lock:
            if state["up"]:
                return                   # it made it meanwhile
            state["gave_up"] = True
        _INITS.append(t)
        raise TransportStartupError(why)

    t = threading.Thread(target=init, name="overlord-rpc-init", daemon=True)
    t.start()
    deadline = time.monotonic() + startup_timeout
    while t.is_alive() and not state["up"]:
        why = abort()
        if why:
            give_up(why)
        elif time.monotonic() > deadline:
            give_up(f"the RPC group of {world_size} processes did not assemble within "
                    f"startup_timeout={startup_timeout:g} s (a member never joined)")
        t.join(0.05)
    if errors:
        raise TransportStartupError(f"init_rpc failed for {name}: {errors[0]}") from errors[0]


def stop_rpc(timeout: float) -> None:
    """Shut this process's agent down locally (no barrier), C++ warnings off meanwhile, at most
    ``timeout`` seconds; the other members carry on (or leave on their own)."""
    _SELF.clear()

    def shut():
        try:
            rpc.shutdown(graceful=False)
        except BaseException as e:        # noqa: BLE001 - nothing left to stop
            log.debug("rpc.shutdown: %s", e)

    previous = set_cpp_log_level(CPP_ERRORS_ONLY, at_least=True)
    try:
        t = threading.Thread(target=shut, name="overlord-rpc-shutdown", daemon=True)
        t.start()
        t.join(timeout)
    finally:
        if previous is not None:
            set_cpp_log_level(previous)
    shm.reset()                          # this group's arena and peers (its calls are answered or failed)
    lane.reset()                         # and its lanes: a call still waiting on one fails
    if t.is_alive():
        log.error("rpc.shutdown did not finish within %g s; RPC threads may still run", timeout)
