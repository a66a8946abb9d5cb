"""Meeting point of a launched job: one c10d TCPStore at ``MASTER_ADDR:MASTER_PORT``.

Node 0's launcher hosts the store (or, under ``torchrun``, uses the agent's store) and writes the
job's *layout* there: the RPC world (ranks of the role workers and the clients), where each role
lives, and the configuration fingerprint clients must match. Every member of the RPC group joins it
through the ``overlordtcp://`` rendezvous registered here, as a store *client* (the store is never
re-created by rank 0, and keys live under a prefix, so a trainer's own ``torch.distributed`` keys
in a shared agent store are left alone).

The store node 0 hosts listens on ``MASTER_ADDR`` only (a socket bound there and handed to the
c10d store, which would otherwise listen on every interface). RPC peers exchange pickles: a launched
job's ports belong on a private network (see README, Security).
"""

from __future__ import annotations

import errno
import json
import socket
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from ..errors import ConfigError

__all__ = ["LAYOUT_KEY", "parse_address", "listen_socket", "connect_store", "host_store", "join_launched",
           "is_loopback"]

LAYOUT_KEY = "overlord/layout"
SCHEME = "overlordtcp"


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"address must be 'host:port' (the launcher's MASTER_ADDR:MASTER_PORT), got {address!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return all(info[4][0].startswith("127.") or info[4][0] == "::1" for info in infos)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``'s IPv4 address and ``port`` (not listening yet), or a clear error:
    the port is in use, or ``host`` is not an address of this machine."""
    try:
        addr = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise ConfigError(f"MASTER_ADDR={host} does not resolve to an IPv4 address: {e}") from None
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"MASTER_PORT {port} is in use on this machine (another job or launcher?); "
                              f"choose a free port with MASTER_PORT=<port>") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"MASTER_ADDR={host} ({addr}) is not an address of this machine: node 0 hosts the "
                              f"store there; give its address on the network you chose") from None
        raise ConfigError(f"cannot bind MASTER_ADDR:MASTER_PORT = {host}:{port}: {e}") from None
    return s


def _unreachable(host: str, port: int, timeout: float, why: str) -> ConfigError:
    return ConfigError(f"cannot reach the data plane's store at {host}:{port} within {timeout:g} s: is node 0 of "
                       f"`python -m torchdata_overlord.launch` running with MASTER_ADDR={host} MASTER_PORT={port}? "
                       f"({why})")


def connect_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A client of the store at ``host:port``, or a clear error once ``timeout`` seconds passed.

    The port is probed with plain connections until something listens (c10d's own retries overshoot
    the timeout by half and print native stack frames); the store then gets the time left."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise _unreachable(host, port, timeout, f"{type(e).__name__}: {e}") from None
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))   # retry until the launcher is up
    try:
        return dist.TCPStore(host, port, is_master=False,
                             timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except (RuntimeError, OSError) as e:
        raise _unreachable(host, port, timeout, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None


def host_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """Node 0's store, listening on ``host``'s address only (``MASTER_ADDR``, e.g. 127.0.0.1)."""
    sock = listen_socket(host, port)
    try:
        store = dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()                            # the store owns (and closes) the socket now
    return store


def _store_client_handler(url: str, timeout: timedelta = timedelta(seconds=300), **kwargs):
    r = urlparse(url)
    q = dict(pair.split("=", 1) for pair in r.query.split("&") if pair)
    store = dist.TCPStore(r.hostname, r.port, is_master=False, timeout=timeout)
    yield dist.PrefixStore("overlord-rpc", store), int(q["rank"]), int(q["world_size"])
    raise RuntimeError("overlordtcp:// rendezvous cannot re-rendezvous")


def register() -> None:
    """Make ``overlordtcp://host:port`` usable as an RPC ``init_method`` (idempotent)."""
    import importlib
    rdzv = importlib.import_module("torch.distributed.rendezvous")   # the module (the package exports a function)
    if SCHEME not in rdzv._rendezvous_handlers:
        rdzv.register_rendezvous_handler(SCHEME, _store_client_handler)


def join_launched(address: str, cfg, client: int, startup_timeout: float, stop_timeout: float):
    """Join a launched job as client ``client``: read its layout, check it matches ``cfg``, join RPC.
    Returns the transport and the layout (its ``role_workers`` and ``spares``)."""
    from .rpc_transport import RpcTransport

    host, port = parse_address(address)
    deadline = time.monotonic() + startup_timeout
    store = connect_store(host, port, startup_timeout)
    store.set_timeout(timedelta(seconds=max(1.0, deadline - time.monotonic())))
    try:
        layout = json.loads(store.get(LAYOUT_KEY))
    except RuntimeError as e:
        raise ConfigError(f"the store at {address} has no data-plane layout after {startup_timeout:g} s: is it a "
                          f"torchdata_overlord launcher's? ({str(e).splitlines()[0][:200]})") from None
    theirs, ours = layout["fingerprint"], cfg.fingerprint()
    diffs = [f"{k}: job has {theirs.get(k)!r}, this client {v!r}" for k, v in ours.items()
             if k != "clients" and theirs.get(k) != v]
    if diffs:
        raise ConfigError(f"this client's configuration differs from the launched job at {address}: " + "; ".join(diffs))
    trainers = theirs["clients"]
    if isinstance(client, bool) or not isinstance(client, int) or not 0 <= client < trainers:
        raise ConfigError(f"client (the trainer rank) must be in [0, {trainers}) for the job at {address}, "
                          f"got {client!r}")
    transport = RpcTransport.join(layout["rendezvous"], client, startup_timeout=max(1.0, deadline - time.monotonic()),
                                  stop_timeout=stop_timeout)
    transport.place(layout["placement"])
    return transport, layout
