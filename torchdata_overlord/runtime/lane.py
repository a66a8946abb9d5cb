"""Same-host call lane: an actor call between two processes of one host over a Unix socket, not TensorPipe.

An actor call between two processes of this host took ~850 us over TensorPipe (its reactor and
callback threads hand a message over several times) and takes ~280 us over one Unix stream socket
per (caller, callee) pair with a reader thread on each side (measured here, 2 cores; the rest is the
thread hand-overs of the actor's own queue and of the caller's future). So once a peer is known to
share the host, a call to it (:func:`.rpc_calls.call_actor`) travels on its *lane*: the same message
(one pickle, its tensors in the sender's shared memory, :mod:`.wire`), the same ordering (each call
carries its ``(caller, seq)``, which the actor's process uses whichever way the call came, so calls
that went over RPC before the lane opened and calls on it keep their order), the same timeout, and
the peer's death seen as the socket's end (every call waiting on it fails as ``ActorDied``; a send
to a peer that reads nothing gives up after ``_SEND_TIMEOUT`` as a timeout). TensorPipe still
starts the group, carries calls between hosts, and every call made before the lane is up.

How a lane opens: the first call to a peer asks it over RPC (:func:`_address`) for its listening
socket, an *abstract* Unix socket (no file, nothing left behind; reachable only from the same host
and network namespace, and never over the network: the group's only TCP sockets stay TensorPipe's,
on loopback), and a random secret; meanwhile calls go over RPC. The caller connects and sends the
secret first: the peer serves only connections that know it (abstract socket names are listed in
``/proc/net/unix``; the secret travels only over the group's RPC). A peer that cannot be reached so
(another host, another network namespace, lanes off there) is remembered as such: RPC it is.

A call that arrives on a lane is handed to the actor's thread, except a *quick* one (a method in the
actor class's ``QUICK_METHODS``: a Data Constructor's ``put``, ``commit``, ``fail``, ``fetch``), which the
lane's reader thread runs itself when the actor is idle with nothing queued: one thread hand-over less
per call, in the same order (``_rpc_worker.dispatch``). The answers it makes so wait while more calls
of the same method are already there to read (a loader's puts to two constructors of one process), and
go back together: one write, and one wake-up of the caller's reader thread instead of one per call;
that thread completes the answers it finds together last first, so a caller waiting for them in order
wakes up once.

Frames, both ways: a 28-byte header (kind, call id, three lengths), a small pickle (the call's
address, or nothing for an answer), the message's pickle, and the tensor buffer's bytes when it is
not in shared memory (an arena that is full, or a message too large for it).

Off with ``OVERLORD_RPC_LANE=0`` in a process's environment: it then neither opens lanes nor serves
them (``OVERLORD_RPC_SHM=0`` is a separate switch: with it, a lane carries the buffer's bytes itself).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import pickle
import select
import socket
import struct
import threading

import torch

from . import shm
from .switches import env_on

__all__ = ["enabled", "set_enabled", "route", "reset", "stats", "Lane"]
log = logging.getLogger(__name__)

ENV = "OVERLORD_RPC_LANE"
_HEADER = struct.Struct("<QQIII")       # kind, call id, address pickle, message pickle, raw buffer bytes
_CALL, _ANSWER = 1, 2
_SECRET_BYTES = 16
_CONNECT_TIMEOUT = 10.0
_SEND_TIMEOUT = 30            # s a frame may wait for room in a peer that reads nothing (frozen); then the lane ends
_BATCH = 16                   # answers a lane's server keeps back at most while calls still wait to be read

_SWITCH: list[bool] = []                         # set_enabled's override of the environment
_ENV_ON: list[bool] = []                         # OVERLORD_RPC_LANE as last read
_LOCK = threading.Lock()
_ROUTES: dict[str, "Lane | bool | None"] = {}   # RPC worker name -> its lane; False: RPC; None: asked
_LISTENER: list["_Listener"] = []
_LANES: list["Lane"] = []                        # every lane this process opened (closed by reset)
_STATS = {"calls": 0, "served": 0, "answer_writes": 0, "opened": 0, "refused": 0, "broken": 0}


def enabled() -> bool:
    """Whether this process opens and serves lanes (``OVERLORD_RPC_LANE``, read once per group)."""
    if _SWITCH:
        return _SWITCH[0]
    if not _ENV_ON:
        _ENV_ON.append(env_on(ENV))
    return _ENV_ON[0]


def set_enabled(on: bool | None) -> None:
    """Override ``OVERLORD_RPC_LANE`` in this process (None: back to the environment), e.g. to compare
    calls over TensorPipe and over lanes in one group (``benchmarks/transport.py``); open lanes stay
    open, unused while it is off."""
    _SWITCH[:] = [] if on is None else [bool(on)]


def stats() -> dict:
    """Counters of this process: calls sent on lanes, calls served from them, the writes their answers made
    (several answers of calls that waited together go in one), lanes opened and refused."""
    with _LOCK:
        return dict(_STATS, routes={k: (v is not None and v is not False) for k, v in _ROUTES.items()})


# ------------------------------------------------------------------------------ frames

def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the peer closed the lane (EOF)")
        got += k
    return buf


def _parts(kind: int, cid: int, address, data: bytes, buffer) -> list:
    """A frame as the parts ``sendmsg`` takes; ``address`` is pickled with the buffer's shared-memory
    reference (None when its bytes follow the message)."""
    raw = b""
    if isinstance(buffer, torch.Tensor):
        raw, buffer = memoryview(buffer.numpy()), None
    meta = b"" if address is None and buffer is None else pickle.dumps((address, buffer), pickle.HIGHEST_PROTOCOL)
    return [_HEADER.pack(kind, cid, len(meta), len(data), len(raw)), meta, data, raw]


def _read_frame(sock: socket.socket):
    """(kind, call id, address, message pickle, buffer): the buffer a shared-memory reference, a uint8
    tensor over the bytes that followed, or None."""
    kind, cid, a_len, m_len, r_len = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    body = _recv_exact(sock, a_len + m_len + r_len) if a_len + m_len + r_len else bytearray()
    view = memoryview(body)
    address, buffer = pickle.loads(view[:a_len]) if a_len else (None, None)
    if r_len:
        buffer = torch.frombuffer(body, dtype=torch.uint8, offset=a_len + m_len, count=r_len)
    return kind, cid, address, bytes(view[a_len:a_len + m_len]), buffer


def _bounded(sock: socket.socket) -> socket.socket:
    """``sock`` blocking (no timeout on the reader's ``recv``), with sends bounded by ``_SEND_TIMEOUT``."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", _SEND_TIMEOUT, 0))
    return sock


def _shut(sock: socket.socket, close: bool = False) -> None:
    """End ``sock`` for both sides (a reader blocked in ``recv`` wakes up); ``close``: its fd too."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    if close:
        sock.close()


def _send(sock: socket.socket, lock: threading.Lock, parts: list) -> None:
    total = sum(len(p) for p in parts)
    with lock:
        sent = sock.sendmsg(parts)
        if sent < total:                 # a large buffer: the rest, in order
            sock.sendall(b"".join(bytes(p) for p in parts)[sent:])


# ------------------------------------------------------------------------------ serving calls

class _Listener:
    """This process's lane socket: serves the calls of peers that said its secret first."""

    def __init__(self):
        self.secret = os.urandom(_SECRET_BYTES)
        self.name = f"\0overlord-lane-{os.getpid()}-{os.urandom(8).hex()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.name)
        self.sock.listen(64)
        self.conns: list[socket.socket] = []
        self.closed = False
        self.thread = threading.Thread(target=self._accept, name="overlord-lane-accept", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with _LOCK:
                self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="overlord-lane-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        from ._rpc_worker import dispatch
        from .wire import discard

        lock = threading.Lock()
        me = threading.get_ident()
        outbox: list[tuple[list, object]] = []    # answers made on this thread while more calls wait to be read
        waiting = select.poll()
        waiting.register(conn, select.POLLIN)

        def send(answers: list[tuple[list, object]]) -> None:
            try:
                _send(conn, lock, [part for parts, _ in answers for part in parts])
            except OSError:              # the caller is gone or reads nothing: its answers and connection go
                for _, buffer in answers:
                    discard(buffer)
                _shut(conn)
                return
            with _LOCK:
                _STATS["answer_writes"] += 1

        def flush() -> None:
            answers = outbox[:]
            outbox.clear()
            send(answers)

        def answer(cid: int, packed: tuple) -> None:
            data, buffer = packed
            got = (_parts(_ANSWER, cid, None, data, buffer), buffer)
            if threading.get_ident() == me:
                outbox.append(got)       # sent once no call waits (with the others: one write, one wake-up)
            else:
                send([got])

        try:
            conn.settimeout(_CONNECT_TIMEOUT)
            if not hmac.compare_digest(bytes(_recv_exact(conn, _SECRET_BYTES)), self.secret) or self.closed:
                with _LOCK:
                    _STATS["refused"] += 1
                return
            _bounded(conn)
            batched = None               # the method of the calls whose answers wait in the outbox
            while True:
                _, cid, address, data, buffer = _read_frame(conn)
                key, caller, seq, method = address
                with _LOCK:
                    _STATS["served"] += 1
                if outbox and method != batched:
                    flush()              # answers wait only behind calls like theirs (a commit may build a step)
                batched = method
                dispatch(key, caller, seq, method, data, buffer, lambda packed, cid=cid: answer(cid, packed), here=True)
                if outbox and (len(outbox) >= _BATCH or not waiting.poll(0)):
                    flush()
        except (OSError, EOFError):
            pass                          # the caller left (or this group ended): nothing to answer
        except Exception as e:            # noqa: BLE001 - a frame that does not parse: drop this caller
            log.warning("lane: dropped a caller whose frame did not parse: %s: %s", type(e).__name__, e)
        finally:
            for _, buffer in outbox:     # answers kept back for a caller that left: their shared memory
                discard(buffer)
            with _LOCK:
                if conn in self.conns:
                    self.conns.remove(conn)
            conn.close()

    def close(self) -> None:
        self.closed = True
        with _LOCK:
            socks = [self.sock, *self.conns]
        for sock in socks:
            _shut(sock, close=True)


def _listener() -> "_Listener":
    with _LOCK:
        if not _LISTENER:
            _LISTENER.append(_Listener())
        return _LISTENER[0]


def _address() -> tuple[str, bytes] | None:
    """Run in a peer (over RPC): where its lane listens and the secret to say first; None when off."""
    if not enabled():
        return None
    got = _listener()
    return got.name, got.secret


# ------------------------------------------------------------------------------ calling out

class Lane:
    """This process's connection to one peer: a call goes out as one frame, its answer comes back on
    the lane's reader thread, which completes it (unpickled there, as an RPC callback thread would)."""

    def __init__(self, peer: str, name: str, secret: bytes):
        self.peer = peer
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(_CONNECT_TIMEOUT)
        try:
            self.sock.connect(name)
            self.sock.sendall(secret)
        except OSError:
            self.sock.close()
            raise
        _bounded(self.sock)
        self.send_lock, self.lock = threading.Lock(), threading.Lock()
        self.pending: dict[int, tuple] = {}
        self.ids = itertools.count()
        self.broken: BaseException | None = None
        self.thread = threading.Thread(target=self._read, name=f"overlord-lane-{peer}", daemon=True)
        self.thread.start()

    def call(self, key: str, caller: str, seq: int, method: str, payload: tuple, arrived, failed) -> bool:
        """Send call ``seq`` of ``caller`` to actor ``key``: ``arrived((data, buffer))`` gets its packed
        answer, or ``failed(exc)`` the lane's end. False, with nothing sent, when the lane broke already."""
        cid = next(self.ids)
        parts = _parts(_CALL, cid, (key, caller, seq, method), *payload)
        with self.lock:
            if self.broken is not None:
                return False
            self.pending[cid] = (arrived, failed)
        try:
            _send(self.sock, self.send_lock, parts)
        except (BlockingIOError, TimeoutError) as e:
            self._break(TimeoutError(f"timed out: {self.peer} read nothing of its lane for {_SEND_TIMEOUT} s ({e})"))
        except OSError as e:
            self._break(ConnectionResetError(f"connection reset: the lane to {self.peer} broke ({e})"))
        with _LOCK:
            _STATS["calls"] += 1
        return True

    def _read(self) -> None:
        """Complete calls as their answers come; answers already there to read are read first and completed
        together."""
        waiting = select.poll()
        waiting.register(self.sock, select.POLLIN)
        done: list[tuple] = []
        try:
            while True:
                _, cid, _, data, buffer = _read_frame(self.sock)
                with self.lock:
                    got = self.pending.pop(cid, None)
                if got is not None:
                    done.append((got[0], (data, buffer)))
                else:                           # the answer of a call that timed out: its memory back to the peer
                    shm.unread(buffer)
                if done and (len(done) >= _BATCH or not waiting.poll(0)):
                    self._complete(done)
                    done = []
        except (OSError, EOFError) as e:
            self._complete(done)
            self._break(EOFError(f"EOF: the lane to {self.peer} closed ({type(e).__name__}: {e})"))
        except Exception as e:            # noqa: BLE001 - an answer that does not parse: this lane is done
            self._complete(done)
            self._break(ConnectionResetError(f"connection reset: the lane to {self.peer} sent a frame that does "
                                             f"not parse ({type(e).__name__}: {e})"))

    def _complete(self, done: list[tuple]) -> None:
        """Last first: a caller waiting for these calls in the order it made them wakes once, with all done."""
        for arrived, packed in reversed(done):
            try:
                arrived(packed)
            except Exception:             # noqa: BLE001 - one caller's callback; the lane serves on
                log.exception("lane: completing a call from %s failed", self.peer)

    def _break(self, exc: BaseException) -> None:
        """Fail every call still waiting (``failed`` maps the text to ``ActorDied``); later calls go by RPC."""
        with self.lock:
            if self.broken is None:
                self.broken = exc
            waiting = list(self.pending.values())
            self.pending.clear()
        with _LOCK:
            if _ROUTES.get(self.peer) is self:
                _ROUTES[self.peer] = False
                _STATS["broken"] += 1
        _shut(self.sock)                  # a frame sent in part ends the peer's reading too
        for _, failed in waiting:
            failed(exc)

    def close(self) -> None:
        _shut(self.sock, close=True)


def route(peer: str) -> "Lane | None":
    """The open lane to RPC worker ``peer``, or None (use RPC); the first time asks the peer for its
    address over RPC without waiting, and opens the lane when it answers."""
    if not enabled():
        return None
    got = _ROUTES.get(peer, False)
    if got:
        return got if got.broken is None else None
    if peer in _ROUTES:
        return None
    import torch.distributed.rpc as rpc

    with _LOCK:
        if peer in _ROUTES:
            return None
        _ROUTES[peer] = None
        epoch = _EPOCH[0]
    try:
        fut = rpc.rpc_async(peer, _address, timeout=30)
    except BaseException:               # noqa: BLE001 - RPC it is
        _ROUTES[peer] = False
        return None

    def answered(f) -> None:
        lane = False
        try:
            where = f.value()
            if where is not None:
                lane = Lane(peer, *where)
        except BaseException as e:      # noqa: BLE001 - another host or namespace: RPC it is
            log.debug("no lane to %s: %s", peer, e)
        with _LOCK:
            if _EPOCH[0] == epoch and _ROUTES.get(peer, False) is None:
                _ROUTES[peer] = lane
                if lane:
                    _LANES.append(lane)
                    _STATS["opened"] += 1
                    return
        if lane:
            lane.close()                # this process left that group meanwhile

    fut.add_done_callback(answered)
    return None


_EPOCH = [0]                              # bumped by reset: an answer from an old group opens nothing


def reset() -> None:
    """This process left (or joins) an RPC group: close its lanes and its listener (worker names are
    reused by the next group); calls still waiting on a lane fail."""
    with _LOCK:
        _EPOCH[0] += 1
        lanes, listeners = list(_LANES), list(_LISTENER)
        _LANES.clear()
        _LISTENER.clear()
        _ROUTES.clear()
        _ENV_ON.clear()
    for lane in lanes:
        lane.close()
    for listener in listeners:
        listener.close()


def _after_fork_in_child() -> None:
    """A forked child has copies of the sockets but none of the threads: close its copies (a close, not
    a shutdown, so the parent's connections stay up) and forget them."""
    for lane in _LANES:
        lane.sock.close()
    for listener in _LISTENER:
        for s in [listener.sock, *listener.conns]:
            s.close()
    _LANES.clear()
    _LISTENER.clear()
    _ROUTES.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
