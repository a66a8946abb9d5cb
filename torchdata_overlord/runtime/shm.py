"""Same-host message buffers in shared memory: the tensors of an RPC message cross without a socket.

A message's tensors travel as one ``uint8`` buffer (:mod:`.wire`). Between two processes of one
host, :func:`.wire.pack` writes that buffer straight into the sender's *arena* (a shared-memory file
of this process) and the RPC carries only a small reference ``(pid, fd, token, offset, nbytes)``;
the receiver maps the arena (once per sender) and rebuilds the tensors as views of it: one copy
(the pack, which the socket path makes too), no socket transfer, no copy out.

Why this and not TensorPipe's own ``shm`` transport: that transport's reactor polls, and each
process of a group burned ~40% of a core while idle (measured here, 2 cores); its ``cma`` channel
copies with ``process_vm_readv`` after a round of socket messages. Both are left off (see
:func:`.rpc_agent.backend_options`).

The arena is a ``memfd`` (no name, nothing in ``/dev/shm``): a peer opens it through
``/proc/<pid>/fd/<fd>``, which only a process of the same host (and pid namespace) with the rights
to inspect the sender can do. Its memory is the kernel's until the last process mapping it exits or
unmaps it: nothing is left behind by a normal close or by a killed process (no name to unlink, no
tracker). Which peers share the host is not assumed: the first time this process would send a
buffer to a peer, it asks that peer (:func:`_probe`, an RPC) to open its arena and check a random
token in it; until the peer said yes, and for good when it said no (another host, another
container's ``/proc``, no rights, shm disabled there), messages go through the socket as before.

Lifetime of a region (no use-after-free, no blocking):

* Each allocation starts with a 64-byte header whose first 8 bytes say *live* (set by the sender).
  The receiver's tensors are views of one numpy array per message; a ``weakref.finalize`` on that
  array writes *free* into the header once the last view (and every tensor made from one) is gone.
* The sender reuses a region only once its header says *free* (lowest addresses first, so the pages
  touched stay about the bytes in flight). When no region is free, or a message is larger than a
  quarter of the arena, the message goes through the socket: a receiver that holds views for a
  long time (a trainer keeping batches) costs arena space, never correctness.
* A region whose receiver never frees it (the peer died, or the call failed after the request was
  sent) stays *live* in the arena until the group ends (the sender cannot know the receiver will
  never read it); the arena is dropped when this process leaves its RPC group (:func:`reset`) and a
  new one made for the next group.

Turned off with ``OVERLORD_RPC_SHM=0`` in a process's environment (a process with it off neither
sends through shared memory nor accepts a peer's arena); ``OVERLORD_RPC_SHM_MIB`` sizes the arena
(virtual size; default 256 MiB, only the pages used are ever allocated).
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import numpy as np

from .switches import env_on

__all__ = ["enabled", "set_enabled", "reset", "alloc", "free", "receive", "peer_ready", "ShmRef", "stats"]

ENV, SIZE_ENV = "OVERLORD_RPC_SHM", "OVERLORD_RPC_SHM_MIB"
_MAGIC = b"OVLDSHM1"
_NAME = "memfd:overlord-wire"         # how /proc shows an arena's fd
_HEAD = 64                      # the arena's header (magic, token) and each allocation's header
_ALIGN = 64
_LIVE, _FREE = 1, 0

#: what a message carries in place of its buffer: ("shm", pid, fd, token, offset, nbytes)
ShmRef = tuple


_SWITCH: list[bool] = []                       # set_enabled's override of the environment
_ENV_ON: list[bool] = []                       # OVERLORD_RPC_SHM as last read


def enabled() -> bool:
    """Whether this process sends and accepts buffers through shared memory (``OVERLORD_RPC_SHM``)."""
    if _SWITCH:
        return _SWITCH[0]
    if not _ENV_ON:                             # read once per group (reset() reads it again)
        _ENV_ON.append(env_on(ENV))
    return _ENV_ON[0]


def set_enabled(on: bool | None) -> None:
    """Override ``OVERLORD_RPC_SHM`` in this process (None: back to the environment); e.g. to compare
    both paths in one group (``benchmarks/transport.py``)."""
    _SWITCH[:] = [] if on is None else [bool(on)]


def _arena_bytes() -> int:
    try:
        mib = int(os.environ.get(SIZE_ENV, "256"))
    except ValueError:
        mib = 256
    return max(4, mib) << 20


class _Arena:
    """This process's outgoing shared memory: a memfd mapped here, allocated first fit from the start."""

    def __init__(self, size: int):
        self.size = size
        self.fd = os.memfd_create(_NAME[len("memfd:"):], os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.token = os.urandom(8).hex()
        self.mm[:_HEAD] = (_MAGIC + self.token.encode()).ljust(_HEAD, b"\0")
        # an allocation's header word, by offset // 8 (a memoryview: its items read as ints, numpy's cost more)
        self.words = memoryview(self.mm).cast("q")
        self.live: list[tuple[int, int]] = []               # (start, end) of every region not yet freed, sorted
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def alloc(self, nbytes: int) -> tuple[int, np.ndarray] | None:
        need = _HEAD + -(-nbytes // _ALIGN) * _ALIGN
        if need > (self.size - _HEAD) // 4:
            return None
        with self.lock:
            words = self.words
            self.live = [r for r in self.live if words[r[0] >> 3] != _FREE]
            start = _HEAD
            for i, (s, e) in enumerate(self.live):
                if s - start >= need:
                    break
                start = e
            else:
                i = len(self.live)
                if self.size - start < need:
                    return None
            self.live.insert(i, (start, start + need))
            words[start >> 3] = _LIVE
        view = np.frombuffer(self.mm, np.uint8, count=nbytes, offset=start + _HEAD)
        return start, view

    def free(self, start: int) -> None:
        self.words[start >> 3] = _FREE

    def close(self) -> None:
        """Forget the arena here (receivers keep their own mappings; the memory goes with the last one)."""
        try:
            os.close(self.fd)
        except OSError:
            pass


class _Attached:
    """A peer's arena mapped here."""

    def __init__(self, pid: int, fd: int, token: str):
        path = f"/proc/{pid}/fd/{fd}"
        if not os.readlink(path).startswith(f"/{_NAME}"):     # never open another kind of file (a device)
            raise OSError(f"process {pid}'s fd {fd} is not an arena")
        f = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            size = os.fstat(f).st_size
            self.mm = mmap.mmap(f, size)
        finally:
            os.close(f)
        if self.mm[:_HEAD] != (_MAGIC + token.encode()).ljust(_HEAD, b"\0"):
            raise OSError(f"process {pid}'s fd {fd} is not the arena it announced")
        self.states = np.frombuffer(self.mm, np.int64)
        self.pid = pid


_LOCK = threading.Lock()
_ARENA: list[_Arena] = []                       # this process's arena while it is in a group (made on demand)
_ATTACHED: dict[tuple, _Attached] = {}          # (pid, fd, token) -> a peer's arena mapped here
_PEERS: dict[str, bool | None] = {}             # RPC worker name -> shares the host (None: asked, no answer yet)
_STATS = {"sent": 0, "sent_bytes": 0, "fallback_full": 0, "received": 0, "freed": 0}


def stats() -> dict:
    """Counters of this process (messages sent/received through shared memory, falls back to the socket)."""
    return dict(_STATS, peers={k: v for k, v in _PEERS.items()}, attached=len(_ATTACHED),
                live=len(_ARENA[0].live) if _ARENA else 0)


def reset() -> None:
    """This process left (or joins) an RPC group: drop its arena, its peers' and what it knew of them
    (worker names are reused by the next group). Views still held keep their memory mapped until
    they are gone."""
    with _LOCK:
        arenas = list(_ARENA)
        _ARENA.clear()
        _ATTACHED.clear()
        _PEERS.clear()
        _ENV_ON.clear()
    for a in arenas:
        a.close()


os.register_at_fork(after_in_child=lambda: (_ARENA.clear(), _ATTACHED.clear(), _PEERS.clear()))


def _arena() -> _Arena:
    with _LOCK:
        if not _ARENA:
            _ARENA.append(_Arena(_arena_bytes()))
        return _ARENA[0]


def alloc(nbytes: int) -> tuple[ShmRef, np.ndarray] | None:
    """A region of ``nbytes`` in this process's arena and its reference for a peer; None when full."""
    a = _arena()
    got = a.alloc(nbytes)
    if got is None:
        _STATS["fallback_full"] += 1
        return None
    start, view = got
    _STATS["sent"] += 1
    _STATS["sent_bytes"] += nbytes
    return ("shm", a.pid, a.fd, a.token, start, nbytes), view


def free(ref: ShmRef) -> None:
    """Give back a region that was never sent (the RPC could not be made)."""
    with _LOCK:
        a = _ARENA[0] if _ARENA else None
    if a is not None and ref[1] == a.pid and ref[2] == a.fd and ref[3] == a.token:
        a.free(ref[4])


def _attach(pid: int, fd: int, token: str) -> _Attached:
    key = (pid, fd, token)
    got = _ATTACHED.get(key)
    if got is not None:
        return got
    with _LOCK:
        got = _ATTACHED.get(key)
        if got is None:
            for k in [k for k in _ATTACHED if not os.path.exists(f"/proc/{k[0]}")]:
                del _ATTACHED[k]        # a sender that exited: its mapping goes with the views still held
            got = _ATTACHED[key] = _Attached(pid, fd, token)
        return got


def _release(states: np.ndarray, word: int) -> None:
    states[word] = _FREE
    _STATS["freed"] += 1


def receive(ref: ShmRef) -> np.ndarray:
    """The message buffer ``ref`` names, as a uint8 array whose views (and tensors made of them) free
    the region once the last of them is gone."""
    _, pid, fd, token, start, nbytes = ref
    peer = _attach(int(pid), int(fd), str(token))
    buf = np.frombuffer(peer.mm, np.uint8, count=int(nbytes), offset=int(start) + _HEAD)
    weakref.finalize(buf, _release, peer.states, int(start) // 8)
    _STATS["received"] += 1
    return buf


def _probe(pid: int, fd: int, token: str) -> bool:
    """Run in a peer (over RPC): can this process map the caller's arena?"""
    if not enabled():
        return False
    try:
        _attach(pid, fd, token)
        return True
    except (OSError, ValueError):
        return False


def peer_ready(peer: str) -> bool:
    """Whether buffers for RPC worker ``peer`` may go through shared memory now; the first time asks
    the peer (without waiting: meanwhile, and if it says no, the socket)."""
    if not enabled():
        return False
    known = _PEERS.get(peer, False)
    if known or peer in _PEERS:
        return bool(known)
    import torch.distributed.rpc as rpc

    with _LOCK:
        if peer in _PEERS:
            return bool(_PEERS[peer])
        _PEERS[peer] = None
    try:
        a = _arena()
        fut = rpc.rpc_async(peer, _probe, args=(a.pid, a.fd, a.token), timeout=30)
    except BaseException:               # noqa: BLE001 - the socket it is
        _PEERS[peer] = False
        return False

    def answered(f, arena=a):
        try:
            ok = bool(f.value())
        except BaseException:           # noqa: BLE001
            ok = False
        with _LOCK:
            if _ARENA and _ARENA[0] is arena and _PEERS.get(peer, False) is None:
                _PEERS[peer] = ok

    fut.add_done_callback(answered)
    return False
