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

* Each allocation starts with a 64-byte header of eight words, each with one writer. Word 0 of a
  *message* region says *live* (set by the sender) until the receiver's views are gone: they are
  views of one numpy array per message, and a weak reference's callback on that array (:func:`when_gone`) writes *free*.
* The sender reuses a region only once all eight words say *free* (lowest addresses first, so the
  pages touched stay about the bytes in flight). When no region is free, or a message is larger than a
  quarter of the arena, the message goes through the socket: a receiver that holds views for a
  long time (a trainer keeping batches) costs arena space, never correctness.
* A region whose receiver never frees it (the peer died, or the call failed after the request was
  sent) stays *live* in the arena until the group ends (the sender cannot know the receiver will
  never read it); the arena is dropped when this process leaves its RPC group (:func:`reset`) and a
  new one made for the next group.

*Held* records (zero copy at send time): :func:`hold` moves a record's tensors into a region of their
own ahead of time (a Source Loader does it as it transforms the rows of its next refill), and its
tensors become views of that region; word 0 is then the sender's, freed once those views are gone.
:func:`.wire.pack` sends such a tensor as a place in the arena instead of copying it: per message and
region it claims one of words 1-7 (a *slot*, freed by that receiver's views as above), so the region
outlives whichever side lets go last. A region with all its slots taken sends its tensors by copy.

Turned off with ``OVERLORD_RPC_SHM=0`` in a process's environment (a process with it off neither
sends through shared memory nor accepts a peer's arena); ``OVERLORD_RPC_SHM_MIB`` sizes the arena
(virtual size; default 256 MiB, only the pages used are ever allocated).
"""

from __future__ import annotations

import atexit
import bisect
import mmap
import os
import threading
import weakref

import numpy as np

from .switches import env_on

__all__ = ["enabled", "set_enabled", "reset", "alloc", "hold", "current", "sharing", "free", "receive", "unread",
           "peer_ready", "ShmRef", "stats"]

ENV, SIZE_ENV = "OVERLORD_RPC_SHM", "OVERLORD_RPC_SHM_MIB"
_MAGIC = b"OVLDSHM1"
_NAME = "memfd:overlord-wire"         # how /proc shows an arena's fd
_HEAD = HEADER = 64             # the arena's header (magic, token) and each allocation's header
_WORDS = _HEAD // 8             # an allocation's header words: 0 (its owner), then the slots of a held region
_ALIGN = 64
_LIVE, _FREE = 1, 0
_LIVE_HEAD = _LIVE.to_bytes(8, "little") + bytes(_HEAD - 8)
_FEW = 64                       # up to this many regions, alloc frees the free ones every time (they are cheap
_SWEEP_BYTES = 4 << 20          # to look at); with more (held records), once every 4 MiB allocated or when full

#: what a message carries in place of its buffer: ("shm", pid, fd, token, offset, nbytes, held); offset -1
#: when every tensor of it is held (no buffer); ``held``: per held region it refers to, (first byte, end,
#: slot word): the region's bytes and the header word its receiver's views of them free
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
        self.starts: list[int] = []         # every region not yet seen free, sorted, and where each ends
        self.ends: list[int] = []
        self.gaps: list[list[int]] = []     # [start, end) between them at the last sweep, less what went since
        self.swept = 0                      # bytes allocated since free regions were last dropped from them
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def _sweep(self) -> None:
        """Forget the regions whose eight header words all say free, and list the gaps between the others,
        lowest first (the caller holds the lock)."""
        words, starts, ends, gaps, at = self.words, [], [], [], _HEAD
        for s, e in zip(self.starts, self.ends):
            w = s >> 3
            if any(words[w:w + _WORDS]):
                if s - at > _HEAD:
                    gaps.append([at, s])
                starts.append(s)
                ends.append(e)
                at = e
        self.starts, self.ends, self.gaps, self.swept = starts, ends, gaps, 0

    def _fit(self, need: int) -> int | None:
        """Where a region of ``need`` bytes goes: the first gap it fits (lowest addresses first, so the pages
        touched stay about the bytes in use), else after the last region; None when full (the caller holds
        the lock)."""
        for i, gap in enumerate(self.gaps):
            if gap[1] - gap[0] >= need:
                start = gap[0]
                gap[0] += need
                if gap[1] - gap[0] <= _HEAD:
                    del self.gaps[i]
                return start
        tail = self.ends[-1] if self.ends else _HEAD
        return tail if self.size - tail >= need else None

    def alloc(self, nbytes: int) -> tuple[int, np.ndarray] | None:
        need = _HEAD + -(-nbytes // _ALIGN) * _ALIGN
        if need > (self.size - _HEAD) // 4:
            return None
        with self.lock:
            if len(self.starts) <= _FEW or self.swept >= _SWEEP_BYTES:
                self._sweep()
            start = self._fit(need)
            if start is None and self.swept:
                self._sweep()
                start = self._fit(need)
            if start is None:
                return None
            i = bisect.bisect(self.starts, start)
            self.starts.insert(i, start)
            self.ends.insert(i, start + need)
            self.swept += need
            self.mm[start:start + _HEAD] = _LIVE_HEAD          # live, no slot taken (the bytes were data before)
        view = np.frombuffer(self.mm, np.uint8, count=nbytes, offset=start + _HEAD)
        return start, view

    def free(self, start: int) -> None:
        self.words[start >> 3] = _FREE

    def claim(self, start: int) -> int | None:
        """A free slot word of held region ``start``, now live (a receiver frees it); None when all are taken."""
        words, w = self.words, start >> 3
        with self.lock:
            for k in range(w + 1, w + _WORDS):
                if words[k] == _FREE:
                    words[k] = _LIVE
                    return k
        return None

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
_STATS = {"sent": 0, "sent_bytes": 0, "fallback_full": 0, "received": 0, "freed": 0, "held": 0, "hold_full": 0,
          "held_messages": 0, "sent_held": 0}


def stats() -> dict:
    """Counters of this process (messages sent/received through shared memory, falls back to the socket)."""
    return dict(_STATS, peers={k: v for k, v in _PEERS.items()}, attached=len(_ATTACHED),
                live=len(_ARENA[0].starts) if _ARENA else 0)


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


# a forked child's copies of this process's views must not free what this process still reads (when_gone)
os.register_at_fork(after_in_child=lambda: (_ARENA.clear(), _ATTACHED.clear(), _PEERS.clear(), _WATCHED.clear()))


def _arena() -> _Arena:
    with _LOCK:
        if not _ARENA:
            _ARENA.append(_Arena(_arena_bytes()))
        return _ARENA[0]


def _region(nbytes: int, full: str) -> tuple[_Arena, int, np.ndarray] | None:
    """(this process's arena, the start of a region of ``nbytes`` in it, a uint8 array over its bytes); None
    when the arena is full, counted under ``full``."""
    a = _arena()
    got = a.alloc(nbytes)
    if got is None:
        _STATS[full] += 1
        return None
    return a, *got


def alloc(nbytes: int) -> tuple[ShmRef, np.ndarray] | None:
    """A region of ``nbytes`` in this process's arena and its reference for a peer; None when full."""
    got = _region(nbytes, "fallback_full")
    if got is None:
        return None
    a, start, view = got
    _STATS["sent"] += 1
    _STATS["sent_bytes"] += nbytes
    return ("shm", a.pid, a.fd, a.token, start, nbytes, ()), view


def hold(nbytes: int) -> tuple[_Arena, int, np.ndarray] | None:
    """A region of ``nbytes`` for a held record (see the module's notes): (the arena, the region's start,
    a uint8 array over its bytes, whose views keep the region until the last of them, and every slot a
    message claimed, is gone). None when the arena is full (or this process does not use shared memory)."""
    got = _region(nbytes, "hold_full") if enabled() else None
    if got is not None:
        when_gone(got[2], got[0].free, got[1])
        _STATS["held"] += 1
    return got


def count_held(regions: int) -> None:
    """Count a message that sends the tensors of ``regions`` held regions by place."""
    _STATS["held_messages"] += 1
    _STATS["sent_held"] += regions


def current() -> "_Arena | None":
    """This process's arena, if it made one in this group."""
    return _ARENA[0] if _ARENA else None


def sharing() -> bool:
    """Whether a peer of this group said it maps this process's arena (shares the host)."""
    return any(_PEERS.values())


def free(ref: ShmRef) -> None:
    """Give back what a message that was never sent (the RPC could not be made) holds: its region, its slots."""
    with _LOCK:
        a = _ARENA[0] if _ARENA else None
    if a is not None and ref[1] == a.pid and ref[2] == a.fd and ref[3] == a.token:
        if ref[4] >= 0:
            a.free(ref[4])
        for _, _, w in ref[6]:
            a.words[w] = _FREE


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


_WATCHED: dict[int, tuple] = {}                 # id of a weak reference -> (it, what to call once its object is gone)


def when_gone(obj, fn, *args) -> None:
    """Call ``fn(*args)`` once ``obj`` is gone, on whichever thread drops it (a weak reference with a callback:
    a tenth of ``weakref.finalize``'s cost, which a message pays per region it receives)."""
    ref = weakref.ref(obj, _gone)
    _WATCHED[id(ref)] = (ref, fn, args)


def _gone(ref) -> None:
    got = _WATCHED.pop(id(ref), None)
    if got is not None:
        got[1](*got[2])


@atexit.register
def _exiting() -> None:
    """At a normal exit, what this process still holds of its peers' arenas goes back to them (as
    ``weakref.finalize`` does at exit): a trainer's last batches, whose constructor goes on."""
    while _WATCHED:
        _, fn, args = _WATCHED.popitem()[1]
        try:
            fn(*args)
        except Exception:                       # noqa: BLE001 - exiting: nothing left to tell
            pass


def _release(states: np.ndarray, word: int) -> None:
    states[word] = _FREE
    _STATS["freed"] += 1


def receive(ref: ShmRef) -> tuple[np.ndarray | None, list[np.ndarray]]:
    """What message ``ref`` names: its buffer, as a uint8 array whose views (and tensors made of them)
    free the region once the last of them is gone (None without one), and a uint8 array over each held
    region of the sender's it refers to, whose views free that region's slot so."""
    _, pid, fd, token, start, nbytes, held = ref
    peer = _attach(int(pid), int(fd), str(token))
    buf = None
    if start >= 0:
        buf = np.frombuffer(peer.mm, np.uint8, count=int(nbytes), offset=int(start) + _HEAD)
        when_gone(buf, _release, peer.states, int(start) // 8)
    regions = []
    for first, end, slot in held:
        regions.append(np.frombuffer(peer.mm, np.uint8, count=int(end) - int(first), offset=int(first)))
        when_gone(regions[-1], _release, peer.states, int(slot))
    _STATS["received"] += 1
    return buf, regions


def unread(buffer) -> None:
    """A message this process received but will never read (a late answer, a call to a closed job): what its
    buffer refers to goes back to its sender now, not when the group ends (nothing to do for a buffer that is
    no :data:`ShmRef`). An arena that does not map is skipped."""
    if not isinstance(buffer, tuple):
        return
    try:
        receive(buffer)
    except (OSError, ValueError):
        pass


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
