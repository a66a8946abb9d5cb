"""Start a job's roles on the data nodes: ``python -m torchdata_overlord.launch --config job.py
--nodes N --node-rank R`` (``MASTER_ADDR``/``MASTER_PORT`` name node 0, as for ``torchrun``).

The config is a Python file whose ``job()`` returns the loader's keyword arguments: ``sources``,
``strategy`` (module level, it is pickled to the Planner's process), ``mesh``, ``global_batch``,
``seq_len`` and optionally ``seed``, ``buffer_size``, ``workers``, ``image_token_id``, ``pad_id``,
``ignore_index``, ``constructors`` (Data Constructors, default one per DP group), ``clients``
(trainer processes that will connect, default every rank of the mesh) and the fault-tolerance
settings ``checkpoint_dir``, ``snapshot_every``, ``shadows`` and ``call_timeout`` (seconds a role's call
may take before the role counts as failed, as ``FaultTolerance(call_timeout=...)``; ``--rpc-timeout``
overrides it; without either, 30 s with fault tolerance, FaultTolerance's, else 60 s). Trainers connect with
``OverlordLoader(..., runtime="rpc", address="MASTER_ADDR:MASTER_PORT", rank=r)`` and call the roles with
the job's call timeout, whatever their own ``timeout=`` (which bounds ``next()``).

Each node starts ``--workers-per-node`` role worker processes (default: enough for one role per
process over all nodes) and, with fault tolerance (a ``checkpoint_dir`` or ``shadows``),
``--spares-per-node`` idle spare processes (default 1): the roles are placed round robin on the role
workers (``RoleConfig.placement``), and a failed role is replaced on a spare, whatever node it was on
(the least-loaded live spare; ties go to the nodes in turn): a loader without a live shadow is
restored there from the checkpoint, a constructor rebuilt, and a failed Planner is restored there by
this launcher when trainer 0 asks it. A worker that dies is then the Planner's to replace, not the
end of the job. Without fault tolerance there are no spares and a dying worker ends the job (below).
Node 0 hosts the rendezvous store (under ``torchrun``, the agent's), checks
the configuration before anything starts (port in use, sources that cannot be opened, a role count
that does not fit the mesh), starts the roles once every member joined, and then watches: the job
ends normally once every trainer has left (each tells the launcher when its loader closes, on its own
time), and a trainer or a worker that dies, or Ctrl-C / SIGTERM, ends it with exit code 1 (every
node's workers exit, nothing hangs; the trainers still there fail with ``JobStopped`` saying why).
That holds on every node: a follower (node rank > 0) tells node 0, through the store, of a worker of
its own that died (with fault tolerance: that its roles are the Planner's to replace) and of its
Ctrl-C / SIGTERM, and node 0 pings the followers' workers, so one whose launcher was killed (SIGKILL,
the OOM killer; its workers exit with it) is named too, within ``--ping-every`` plus a few seconds;
a trainer whose step failed for good waits that long for the launcher's word. A worker that dies
while the job starts is named at once, by whichever node it was on. Node ranks > 0 wait at most
``--connect-timeout`` seconds for node 0, and node 0 at most ``--join-timeout`` for every member:
past it, one line says who was awaited and the exit code is 1.

Security: RPC peers exchange pickles, so anyone who can reach these ports can run code in every
role. The default binds TensorPipe to loopback (``--interface lo``) and refuses a non-loopback
``MASTER_ADDR``; a multi-node job names its private network's interface (``--interface eth1``),
where every node's workers listen, and node 0's store listens on ``MASTER_ADDR`` only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

from .errors import ConfigError, OverlordError
from .runtime import _rpc_worker as W
from .runtime import rpc_leave as L
from .runtime.rpc_agent import CPP_ERRORS_ONLY, TransportStartupError, set_cpp_log_level
from .runtime.rendezvous import LAYOUT_KEY, SCHEME, connect_store, host_store, is_loopback
from .runtime.job_config import RoleConfig, start_roles
from .runtime.refs import LAUNCHER

log = logging.getLogger("torchdata_overlord.launch")
# seconds node 0 waits for a follower to say why its workers stopped answering before it calls that
# follower's launcher gone (a live follower sees its worker's death at once and reports it in ~0.1 s)
REPORT_GRACE = 3.0
# seconds a follower that told node 0 why the job stops waits for node 0 to stop its workers before it ends them
STOP_WAIT = 15.0
JOB_KEYS = ("sources", "strategy", "mesh", "global_batch", "seq_len", "seed", "buffer_size", "workers",
            "image_token_id", "pad_id", "ignore_index", "constructors", "clients", "checkpoint_dir", "snapshot_every",
            "shadows", "call_timeout")
DEFAULT_CALL_TIMEOUT = 60.0        # a role call's timeout without fault tolerance (with it: FaultTolerance's)


def load_config(path: str) -> dict:
    """Import the config file as a module named after it (its directory first on ``sys.path``, which
    the workers inherit, so its module-level strategy unpickles there) and call its ``job()``."""
    p = Path(path).resolve()
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    sys.path.insert(0, str(p.parent))
    module = importlib.import_module(p.stem)
    if not callable(getattr(module, "job", None)):
        raise ConfigError(f"--config {path} must define job() returning the loader's keyword arguments")
    kwargs = dict(module.job())
    unknown = set(kwargs) - set(JOB_KEYS)
    if unknown:
        raise ConfigError(f"--config {path}: job() returned unknown keys {sorted(unknown)}; known: {list(JOB_KEYS)}")
    missing = {"sources", "strategy", "mesh", "global_batch", "seq_len"} - set(kwargs)
    if missing:
        raise ConfigError(f"--config {path}: job() must give {sorted(missing)}")
    return kwargs


def role_config(kwargs: dict, rpc_timeout: float | None) -> RoleConfig:
    """The roles' configuration; their call timeout is ``--rpc-timeout`` where given, else the config's
    ``call_timeout``, else FaultTolerance's default with fault tolerance (a frozen role is then found, and
    replaced, within a trainer's default ``next()`` timeout, as under ``runtime="rpc"``), else 60 s."""
    from .loader import FaultTolerance

    kw = dict(kwargs)
    clients = kw.pop("clients", None) or kw["mesh"].world_size
    call = kw.pop("call_timeout", None)
    if rpc_timeout is None:
        fault_tolerant = kw.get("checkpoint_dir") is not None or bool(kw.get("shadows"))
        rpc_timeout = call if call is not None else \
            FaultTolerance.call_timeout if fault_tolerant else DEFAULT_CALL_TIMEOUT
    return RoleConfig(kw.pop("sources"), kw.pop("strategy"), kw.pop("mesh"), kw.pop("global_batch"), kw.pop("seq_len"),
                      clients=clients, timeout=rpc_timeout, **kw)


def parse_args(argv):
    env = os.environ
    ap = argparse.ArgumentParser(prog="python -m torchdata_overlord.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="Python file whose job() returns the loader's arguments")
    ap.add_argument("--nodes", type=int, default=int(env.get("GROUP_WORLD_SIZE", 1)),
                    help="data nodes in the job (default: torchrun's GROUP_WORLD_SIZE, else 1)")
    ap.add_argument("--node-rank", type=int, default=int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
                    help="this node's rank (default: torchrun's GROUP_RANK, else NODE_RANK, else 0)")
    ap.add_argument("--workers-per-node", type=int, default=None, help="role worker processes on each node")
    ap.add_argument("--spares-per-node", type=int, default=None,
                    help="idle spare processes on each node, where failed roles are replaced (default: 1 with fault "
                         "tolerance, a checkpoint_dir or shadows in the config; 0 without)")
    ap.add_argument("--interface", default=None,
                    help="network interface TensorPipe listens on (default: lo, loopback only, for one node)")
    ap.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for node 0's store")
    ap.add_argument("--join-timeout", type=float, default=600.0,
                    help="seconds node 0 waits for every worker and trainer to join")
    ap.add_argument("--rpc-timeout", type=float, default=None,
                    help="seconds every role call may take (default: the config's call_timeout, else 30 with fault "
                         "tolerance, as FaultTolerance's, else 60)")
    ap.add_argument("--ping-every", type=float, default=2.0, help="seconds between trainer liveness checks")
    a = ap.parse_args(argv)
    a.master_addr = env.get("MASTER_ADDR", "127.0.0.1")
    a.master_port = int(env.get("MASTER_PORT", 29600))
    return a


class Launcher:
    """One node's share of a launched job (see the module docstring)."""

    def __init__(self, args):
        self.a = args
        if args.nodes < 1 or not 0 <= args.node_rank < args.nodes:
            raise ConfigError(f"--node-rank {args.node_rank} must be in [0, --nodes={args.nodes})")
        if args.interface is None and (args.nodes > 1 or not is_loopback(args.master_addr)):
            raise ConfigError(f"MASTER_ADDR={args.master_addr} with {args.nodes} node(s) needs a network: pass "
                              f"--interface <nic of your private network> (RPC peers exchange pickles; never expose "
                              f"these ports beyond a private network)")
        args.interface = args.interface or "lo"
        self.cfg = role_config(load_config(args.config), args.rpc_timeout)
        roles = len(self.cfg.roles)
        per = args.workers_per_node or -(-roles // args.nodes)
        if per < 1:
            raise ConfigError(f"--workers-per-node must be >= 1, got {per}")
        spares = args.spares_per_node
        if spares is None:
            spares = 1 if self.fault_tolerant else 0
        if spares < 0:
            raise ConfigError(f"--spares-per-node must be >= 0, got {spares}")
        self.n_workers = per * args.nodes              # the role workers: 0..n_workers-1, node r's from r * per
        self.per_node, self.spares_per_node = per, spares
        self.procs, self.conns = [], []
        self.dead_seen: set[str] = set()
        self.remote_dead: set[str] = set()      # node 0: other nodes' workers they reported dead (fault tolerance)
        self.store = None
        self.session = ""                       # the layout's session: the store keys of this job (see key())
        self.stopping = threading.Event()

    @property
    def address(self) -> str:
        return f"{self.a.master_addr}:{self.a.master_port}"

    @property
    def fault_tolerant(self) -> bool:
        """The roles checkpoint or keep shadows: a worker's death is recovered, not the end of the job."""
        return self.cfg.checkpoint_dir is not None or self.cfg.shadows

    def node_of(self, index: int) -> int:
        """The node of worker ``index`` (a role worker or a spare)."""
        if index < self.n_workers:
            return index // self.per_node
        return (index - self.n_workers) // self.spares_per_node

    @property
    def stop_notice_s(self) -> float:
        """At most how long after a worker's death on any node (or a follower's launcher's) node 0 tells the
        trainers that the job stops: a ping round, a follower's report grace, a margin. A trainer whose step
        failed for good waits that long for the notice, so it raises JobStopped saying why, not the failure
        the death caused it (e.g. RoleLost: no spare can host a loader)."""
        return self.a.ping_every + max(1.0, self.a.ping_every) + REPORT_GRACE + 2.0

    def spare_indices(self, node: int | None = None) -> list[int]:
        """Worker indices of the spares (after every role worker; node ``r``'s from ``n_workers + r *
        spares_per_node``): one node's, or every node's in turn (node 0's first, node 1's first, ...,
        then the second of each), the order the least-loaded choice breaks ties in."""
        n, s = self.n_workers, self.spares_per_node
        if node is not None:
            return [n + node * s + j for j in range(s)]
        return [n + r * s + j for j in range(s) for r in range(self.a.nodes)]

    def layout(self) -> dict:
        a, n, c = self.a, self.n_workers + self.spares_per_node * self.a.nodes, self.cfg.clients
        env = {"TP_SOCKET_IFNAME": a.interface, "GLOO_SOCKET_IFNAME": a.interface}
        rendezvous = {"session": uuid.uuid4().hex, "ns": "", "address": self.address,
                      "init_method": f"{SCHEME}://{self.address}", "world_size": n + c + 1,
                      "n_workers": n, "client_ranks": [n + i for i in range(c + 1)],
                      "rpc_timeout": self.cfg.timeout, "env": env if a.interface == "lo" else {},
                      "stop_notice_s": self.stop_notice_s}
        return {"rendezvous": rendezvous, "placement": self.cfg.placement(self.n_workers),
                "fingerprint": self.cfg.fingerprint(), "nodes": a.nodes, "workers_per_node": self.per_node,
                "spares_per_node": self.spares_per_node, "role_workers": self.n_workers,
                "spares": [W.worker_name(i) for i in self.spare_indices()]}

    def start(self) -> dict:
        a = self.a
        under_torchrun = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if a.node_rank == 0:
            self.store = connect_store(a.master_addr, a.master_port, a.connect_timeout) if under_torchrun else \
                host_store(a.master_addr, a.master_port, a.join_timeout)
            layout = self.layout()
            self.store.set(LAYOUT_KEY, json.dumps(layout))
        else:
            self.store = connect_store(a.master_addr, a.master_port, a.connect_timeout)
            layout = json.loads(self.store.get(LAYOUT_KEY))
            theirs = (layout["nodes"], layout["workers_per_node"], layout.get("spares_per_node", 0))
            if theirs != (a.nodes, self.per_node, self.spares_per_node):
                raise ConfigError(f"node {a.node_rank}: node 0 runs {theirs[0]} nodes x {theirs[1]} workers and "
                                  f"{theirs[2]} spares, this node was given {a.nodes} x {self.per_node} and "
                                  f"{self.spares_per_node}; start every node with the same --nodes, "
                                  f"--workers-per-node and --spares-per-node")
        from .runtime.rpc_transport import spawn_workers
        rv = layout["rendezvous"]
        self.session = rv["session"]
        first = a.node_rank * self.per_node
        mine = list(range(first, first + self.per_node)) + self.spare_indices(a.node_rank)
        own = {"TP_SOCKET_IFNAME": a.interface, "GLOO_SOCKET_IFNAME": a.interface}   # this node's network
        os.environ.update(own)
        self.procs, self.conns = spawn_workers([(W.worker_name(i), i) for i in mine], dict(rv, env=own),
                                               self.cfg.timeout)
        log.info("node %d: started workers %s (pids %s), spares %s", a.node_rank, mine, [p.pid for p in self.procs],
                 self.spare_indices(a.node_rank))
        return layout

    # -- what the nodes tell each other, in node 0's store ------------------------------------------
    def key(self, what: str, node: int | None = None) -> str:
        """A store key of this job (its layout's session: a store torchrun keeps across restarts holds
        no stale one): node ``node``'s ``what``, or the job's."""
        where = "" if node is None else f"node-{node}/"
        return f"overlord/{self.session}/{where}{what}"

    def tell(self, what: str, value: str) -> None:
        """Set a key node 0 reads (a follower's report); a store that is gone (node 0 ended) is logged."""
        try:
            self.store.set(self.key(what, self.a.node_rank), value)
        except (RuntimeError, OSError) as e:
            log.warning("node %d: could not tell node 0 (%s): %s", self.a.node_rank, value,
                        str(e).splitlines()[0][:200] if str(e) else type(e).__name__)

    def told(self, what: str, node: int | None = None, gone: str | None = None) -> str | None:
        """What node ``node`` (None: node 0, for the job) set under ``what``: None while it did not, ``gone``
        when the store is (node 0 ended)."""
        k = self.key(what, node)
        try:
            return self.store.get(k).decode() if self.store.check([k]) else None
        except (RuntimeError, OSError):
            return gone

    def followers_stop(self) -> str | None:
        """Why a follower node ends the job (a worker of it died without fault tolerance, its launcher was
        interrupted), as it reported to the store; None while none did."""
        for r in range(1, self.a.nodes):
            why = self.told("stop", r)
            if why is not None:
                return why
        return None

    # -- node 0: the roles and the watch ---------------------------------------------------------
    def run_leader(self, layout: dict) -> int:
        from .runtime.rpc_session import exited_during_start_up
        from .runtime.rpc_transport import RpcTransport

        rv, clients = layout["rendezvous"], self.cfg.clients

        def abort() -> str | None:
            if self.stopping.is_set():
                return "interrupted (Ctrl-C or SIGTERM)"
            return exited_during_start_up(self.procs) or self.followers_stop()

        waited_for = (f"the job waits for {self.n_workers} role worker(s), {self.spares_per_node * self.a.nodes} "
                      f"spare(s) and {clients} trainer(s), which connect with "
                      f"OverlordLoader(..., runtime='rpc', address='{self.address}', rank=r)")
        try:
            transport = RpcTransport.join(rv, clients, startup_timeout=self.a.join_timeout, stop_timeout=5.0,
                                          abort=abort)
        except TransportStartupError as e:
            why = abort()
            if why is None and e.__cause__ is not None:
                # torch's start-up failed before the deadline: a member died mid-way (a follower's worker reports
                # it a moment later; a follower's launcher killed with its workers reports nothing)
                time.sleep(1.0)
                why = abort()
            if why is not None:
                raise TransportStartupError(f"the job did not start: {why}") from e
            if e.__cause__ is not None:
                raise TransportStartupError(f"the job's RPC group failed to start ({str(e).splitlines()[0][:300]}): a "
                                            f"member died or left during start-up; {waited_for}") from e
            raise TransportStartupError(f"not every member joined within --join-timeout={self.a.join_timeout:g} s: "
                                        f"{waited_for}") from e
        self.store.set(self.key("started"), "1")     # the followers' workers are in the group: node 0 stops them
        try:
            spares = [W.worker_name(i) for i in self.spare_indices()]
            transport.host(LAUNCHER, PlannerStarter(transport, self.cfg, spares))    # trainer 0 asks it
            try:
                start_roles(transport, self.cfg, self.n_workers, spares, warm_timeout=self.a.join_timeout)
            except OverlordError as e:       # e.g. a loader "did not fill its first buffer": its worker died
                reason = f"the roles did not start: {self.died_during_start_up() or e}"
            else:
                print(f"torchdata_overlord.launch: roles started on {self.n_workers} workers ({len(spares)} spares); "
                      f"trainers connect with address='{self.address}'", flush=True)
                reason = self.watch(transport.ns, clients)
            self.store.set(self.key("stopping"), reason or "")    # the followers: their workers exit as told
            if reason is None:
                log.info("every trainer left: stopping the roles")
            else:
                print(f"torchdata_overlord.launch: {reason}; stopping every role", file=sys.stderr, flush=True)
                self.tell_trainers(transport.ns, clients, f"the launched job at {self.address} stopped: {reason}")
            self.stop_workers(0 if reason is None else 1)
        finally:
            transport.stop()
        return 0 if reason is None else 1

    def tell_trainers(self, ns: str, clients: int, why: str) -> None:
        """Every trainer still in the job learns why it ends (its next() raises JobStopped), before
        the roles stop under it."""
        import torch.distributed.rpc as rpc

        futs = [rpc.rpc_async(W.client_name(c), L._job_stopped, args=(ns, why), timeout=2)
                for c in sorted(set(range(clients)) - L.left_clients(ns))]
        for f in futs:
            try:
                f.wait()
            except BaseException:            # noqa: BLE001 - that trainer is the one gone
                pass

    def stop_workers(self, code: int) -> None:
        """Every worker, on every node, exits with ``code`` (their launchers then exit too)."""
        import torch.distributed.rpc as rpc

        futs = []
        for i in range(self.n_workers + self.spares_per_node * self.a.nodes):
            try:
                futs.append(rpc.rpc_async(W.worker_name(i), W._exit_now, args=(code,), timeout=2))
            except BaseException:            # noqa: BLE001 - already gone
                pass
        for f in futs:
            try:
                f.wait()
            except BaseException:            # noqa: BLE001 - already gone
                pass

    def watch(self, ns: str, clients: int) -> str | None:
        """None once every trainer client left; else why the job must stop (interrupted, a worker or a
        trainer gone without leaving, a follower node that reported a reason or whose launcher is gone).

        Node 0 sees its own workers' processes; a follower reports its own (and its Ctrl-C / SIGTERM) through
        the store, read here every 0.1 s. A follower killed with its launcher (SIGKILL, the OOM killer: its
        workers exit with it) reports nothing: its workers, pinged with the trainers every ``--ping-every``
        seconds, stop answering, and a follower that did not report why within :data:`REPORT_GRACE` seconds
        is named as gone."""
        import torch.distributed.rpc as rpc

        everyone = set(range(clients))
        next_ping = time.monotonic() + self.a.ping_every
        timeout = max(1.0, self.a.ping_every)
        while L.wait_left(ns, everyone, 0.1):
            if self.stopping.is_set():
                return "the launcher was interrupted (Ctrl-C or SIGTERM)"
            dead = [p.name for p in self.procs if not p.is_alive()]
            self.note_fork_server()
            if dead and not self.fault_tolerant:
                return f"role worker process(es) {dead} on node 0 died"
            self.note_dead(dead)
            why = self.followers_stop()
            if why is not None:
                return why
            if time.monotonic() >= next_ping:
                next_ping = time.monotonic() + self.a.ping_every
                futs = {c: rpc.rpc_async(W.client_name(c), os.getpid, timeout=timeout)
                        for c in sorted(everyone - L.left_clients(ns))}
                workers = {w: rpc.rpc_async(w, W._pid, timeout=timeout) for w in self.remote_workers()}
                for c, f in futs.items():
                    try:
                        f.wait()
                    except BaseException as e:       # noqa: BLE001
                        if c not in L.left_clients(ns):   # a trainer that left just now is not dead
                            return f"trainer client {c} died without leaving (unreachable: {str(e).splitlines()[0][:120]})"
                unanswered = {}
                for w, f in workers.items():
                    try:
                        f.wait()
                    except BaseException as e:       # noqa: BLE001
                        unanswered[w] = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
                why = self.unreported(unanswered)
                if why is not None:
                    return why
        return None

    def died_during_start_up(self) -> str | None:
        """Why the roles could not start when a worker died meanwhile, on this node or another (a follower
        reports its own within :data:`REPORT_GRACE` seconds), instead of the error that death caused (a
        call to it failed, or a loader "did not fill its first buffer within the start-up timeout")."""
        deadline = time.monotonic() + REPORT_GRACE
        while True:
            dead = [f"{p.name} (pid {p.pid}, {p.describe_exit()})" for p in self.procs if not p.is_alive()]
            if dead:
                return f"role worker process(es) {dead} on node 0 died"
            why = self.followers_stop()
            if why is not None or time.monotonic() >= deadline:
                return why
            time.sleep(0.1)

    def remote_workers(self) -> list[str]:
        """The other nodes' workers (role workers and spares) node 0 pings, less those reported dead."""
        mine = set(range(self.per_node)) | set(self.spare_indices(0))
        every = range(self.n_workers + self.spares_per_node * self.a.nodes)
        return [W.worker_name(i) for i in every if i not in mine and W.worker_name(i) not in self.remote_dead]

    def unreported(self, unanswered: dict[str, str]) -> str | None:
        """Why the job stops, given the other nodes' workers that did not answer a ping (name -> error):
        what their node reports within :data:`REPORT_GRACE` seconds (a worker that died ends the job,
        or, with fault tolerance, is the Planner's to replace), else that node's launcher is gone."""
        deadline = time.monotonic() + REPORT_GRACE
        while unanswered:
            why = self.followers_stop()
            if why is not None:
                return why
            for w in list(unanswered):
                if self.told(f"dead/{w}", self.node_of(W.worker_index(w))) is not None:
                    self.remote_dead.add(w)          # a follower's note: fault tolerance replaces its roles
                    del unanswered[w]
            if unanswered and time.monotonic() >= deadline:
                nodes = sorted({self.node_of(W.worker_index(w)) for w in unanswered})
                return (f"the launcher of node(s) {nodes} is gone (killed, e.g. SIGKILL or the OOM killer, or its "
                        f"host is unreachable): its worker process(es) {sorted(unanswered)} stopped answering "
                        f"({next(iter(unanswered.values()))}) and it reported nothing within {REPORT_GRACE:g} s")
            time.sleep(0.1)
        return None

    def note_fork_server(self) -> None:
        """Say once that this node's multiprocessing fork server died (SIGKILL, the OOM killer: it holds torch).
        It only starts processes: the role workers it started serve on, each watched by its own pid."""
        if not getattr(self, "fork_server_said", False) and any(p.fork_server_gone() for p in self.procs):
            self.fork_server_said = True
            log.warning("node %d: the multiprocessing fork server that started the role workers died; they serve on "
                        "(watched by their own pids), but their exit codes can no longer be read", self.a.node_rank)

    def note_dead(self, dead: list[str]) -> None:
        """With fault tolerance a dead worker is the Planner's to replace: say so, once per worker."""
        new = [d for d in dead if d not in self.dead_seen]
        if new:
            self.dead_seen.update(new)
            log.warning("node %d: role worker process(es) %s died; their roles are replaced on spares",
                        self.a.node_rank, new)

    # -- other nodes: wait for the workers ---------------------------------------------------------
    def run_follower(self) -> int:
        """Watch this node's workers until node 0 stops them (their exit codes are this launcher's). What
        ends the job here, a worker that died (without fault tolerance) or Ctrl-C / SIGTERM, is told to node 0
        through the store: node 0 tells the trainers why and stops every node's workers. This node then waits
        for that (at most :data:`STOP_WAIT` seconds) before it ends its own, so that the trainers learn why
        before the roles go; during start-up (no RPC group yet to stop them by) it ends them at once. With
        fault tolerance a dead worker is noted to node 0 instead (its roles are replaced on spares)."""
        r = self.a.node_rank
        why = None
        while why is None and any(p.is_alive() for p in self.procs):
            time.sleep(0.05)
            self.note_fork_server()
            dead = [p for p in self.procs if not p.is_alive()]
            if dead and self.told("stopping", gone="") is not None:
                continue                     # node 0 ends the job (or ended): it stops the workers, here and everywhere
            if self.stopping.is_set():
                why = f"node {r}'s launcher was interrupted (Ctrl-C or SIGTERM)"
            elif dead and not self.fault_tolerant:
                why = (f"role worker process(es) {[f'{p.name} (pid {p.pid}, {p.describe_exit()})' for p in dead]} "
                       f"on node {r} died")
            elif dead:
                for p in dead:
                    if p.name not in self.dead_seen:
                        self.tell(f"dead/{p.name}", p.describe_exit())
                self.note_dead([p.name for p in dead])
        if why is not None:
            started = self.told("started") is not None
            if not started:
                why += " during start-up"
            log.error("node %d: %s; telling node 0, which ends the job", r, why)
            self.tell("stop", why)
            if started:                      # node 0 stops this node's workers (exit code 1), after the trainers
                deadline = time.monotonic() + STOP_WAIT
                for p in self.procs:
                    p.join(max(0.0, deadline - time.monotonic()))
            return 1
        codes = [p.exitcode for p in self.procs]
        if self.fault_tolerant:         # killed workers were replaced; the others exit as node 0 says
            codes = [c for c in codes if c is not None and c >= 0]
        return 0 if codes and all(c == 0 for c in codes) else 1

    def close(self) -> None:
        for c in self.conns:                 # EOF on the pipe: each worker exits
            try:
                c.close()
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2)


class PlannerStarter:
    """Hosted by node 0's launcher (actor ``launcher``): starts a replacement Planner on a spare when
    trainer 0 asks (a trainer of a launched job has neither the strategy nor the sources to start one)."""

    def __init__(self, transport, cfg: RoleConfig, spares: list[str]):
        self.transport, self.cfg, self.spares = transport, cfg, spares

    def start_planner(self, name: str, dead: list[str]) -> str:
        """Start Planner ``name`` on the least-loaded live spare, none of ``dead``; its worker."""
        from .runtime.client_recovery import start_planner
        return start_planner(self.transport, self.cfg, name, {w: W.worker_index(w) for w in self.spares}, set(dead))


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    set_cpp_log_level(CPP_ERRORS_ONLY, at_least=True)    # TensorPipe would warn of every trainer that leaves
    args = parse_args(argv)
    try:
        launcher = Launcher(args)
    except Exception as e:                   # noqa: BLE001 - a config file may raise anything: report, start nothing
        print(f"torchdata_overlord.launch: configuration error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2

    def on_signal(signum, frame):
        launcher.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        try:
            layout = launcher.start()
        except (ConfigError, OverlordError) as e:
            print(f"torchdata_overlord.launch: configuration error: {e}", file=sys.stderr, flush=True)
            return 2
        try:
            return launcher.run_leader(layout) if args.node_rank == 0 else launcher.run_follower()
        except OverlordError as e:           # e.g. nobody joined in time: one line, not a traceback
            print(f"torchdata_overlord.launch: {e}; stopping every role", file=sys.stderr, flush=True)
            return 1
    finally:
        launcher.close()


def _remove_mp_tempdir() -> None:
    """multiprocessing's temporary folder of this process (the fork server's socket is in it): its exit
    handler removes it, and ``os._exit`` skips that handler (each launch left a ``/tmp/pymp-*`` behind)."""
    from multiprocessing import process

    folder = process.current_process()._config.get("tempdir")
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:                    # noqa: BLE001 - unexpected: say it, then leave like the others
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    _remove_mp_tempdir()
    # at once: an RPC start-up that gave up may still wait inside torch in a thread, and tearing the
    # interpreter down under it aborts the process natively ("terminate called...", exit 134)
    os._exit(code)
