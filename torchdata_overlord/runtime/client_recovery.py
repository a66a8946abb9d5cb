"""A client's side of recovery: ask again after a role failed, replace a lost Planner, follow the leader's.

A request that fails because a role died or froze (or because the job moved to a new generation
meanwhile) is asked again once the role is replaced: a Data Constructor by the Planner
(``report_failure``), the Planner by the leader client (client 0), which starts a new one on a spare
(in a launched job it asks the launcher to: :func:`start_planner`) and tells the other clients through
its :class:`PlannerRegistry` (or that it could not: they then fail at once, as it does, not after their
recovery_timeout).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

from ..errors import OverlordError
from .fault_policy import FAILURES, RoleLost, unanswering
from .planner_actor import PlannerActor
from .recovery_store import PLANNER_KEY
from .refs import PLANNER, REGISTRY, LauncherRef, PlannerRef, RegistryRef
from .spares import serving, spare_order
from .step import JobReset
from .transport import ActorDied, CallTimeout, settle

__all__ = ["ClientRecovery", "PlannerRegistry", "JobStopped", "start_planner"]

RECOVERABLE = (JobReset, ActorDied, CallTimeout)


class JobStopped(OverlordError, RuntimeError):
    """The job's coordinator (the launcher) stopped every role, and says why (e.g. another trainer died)."""


class PlannerRegistry:
    """Hosted by the leader client: where the Planner is, so the other clients follow a replacement, or
    learn at once that none will come (the leader could not replace it, or closed its loader)."""

    def __init__(self, name: str, worker: str):
        self.current = {"name": name, "worker": worker}
        self.failed: str | None = None      # why no new Planner will come (until one does)
        self.lock = threading.Condition()

    def moved(self, name: str, worker: str) -> None:
        with self.lock:
            self.current = {"name": name, "worker": worker}
            self.failed = None
            self.lock.notify_all()

    def lost(self, reason: str, keep: bool = False) -> None:
        """The leader gives up on the current Planner (replacing it failed, or the leader closed): a client
        waiting for a new one, now or later, is told ``reason`` instead of waiting out its recovery_timeout
        (``keep``: unless it is told another reason already, e.g. why the replacement failed)."""
        with self.lock:
            if not (keep and self.failed is not None):
                self.failed = reason
            self.lock.notify_all()

    def planner_after(self, old: str, timeout: float) -> cf.Future:
        """The Planner once it is no longer ``old`` (None after ``timeout`` seconds; ``{"failed": why}`` once the
        leader gave up on it): answered later."""
        out: cf.Future = cf.Future()

        def wait():
            with self.lock:
                self.lock.wait_for(lambda: self.current["name"] != old or self.failed is not None, timeout=timeout)
                if self.current["name"] != old:
                    settle(out, dict(self.current))
                else:
                    settle(out, None if self.failed is None else {"failed": self.failed})

        threading.Thread(target=wait, name="overlord-registry-wait", daemon=True).start()
        return out


def planner_args(transport, cfg, spares: list) -> tuple:
    """A :class:`~.planner_actor.PlannerActor`'s arguments for ``cfg``'s job, replacements on ``spares``."""
    return (cfg.strategy, cfg.mesh, cfg.global_batch, cfg.seed, cfg.names, cfg.constructors, cfg.clients,
            cfg.timeout, transport.peers(), cfg.policy(spares))


def start_planner(transport, cfg, name: str, index: dict[str, int], dead: set[str]) -> str:
    """Start Planner ``name`` (to be restored from ``cfg``'s store) on the least-loaded live spare of
    ``index`` (spare worker name -> worker index), none of ``dead`` nor a spare the newest checkpoint
    says is dead; returns its worker."""
    spares = list(index)
    if not spares or cfg.checkpoint_dir is None:
        raise RoleLost("the Planner failed and cannot be replaced: give the job spare processes and a checkpoint "
                       "directory (OverlordLoader(..., spares=1, fault_tolerance=FaultTolerance(checkpoint_dir=...)); "
                       "a launched job: --spares-per-node and checkpoint_dir in its config)")
    newest = cfg.store().latest(PLANNER_KEY)
    roles = newest[1]["roles"] if newest is not None else {}
    dead = set(dead) | set(roles.get("dead_spares", []))
    for w in spare_order(spares, serving(roles) if roles else {}, dead):      # the least-loaded live spare
        try:
            transport.start_actor(name, PlannerActor, *planner_args(transport, cfg, [s for s in spares if s not in dead]),
                                  worker=index[w])
            return w
        except (ActorDied, CallTimeout):
            dead.add(w)
    raise RoleLost(f"the Planner failed and no spare process can host a new one (dead: {sorted(dead)})")


class ClientRecovery:
    """Mixed into :class:`~.client.Job`: what a client does when a request fails."""

    def _failed(self, req, attempt: int, gen: int, err: BaseException) -> None:
        if attempt != req.attempt or req.out.done():
            return                          # an older attempt; a newer one is on its way
        if not isinstance(err, RECOVERABLE):
            if self._launched and isinstance(err, RoleLost):
                try:                        # off the RPC thread that delivered it: it may wait for the launcher
                    self._recovery.submit(lambda: settle(req.out, exc=self._final_error(err)))
                    return
                except RuntimeError:        # closed
                    pass
            settle(req.out, exc=err)
            return
        self.faults["failures"].append({"step": req.step, "error": f"{type(err).__name__}: {str(err)[:200]}",
                                        "actor": getattr(err, "actor", None)})
        if req.first_failure is None:
            req.first_failure = time.monotonic()
        try:
            self._recovery.submit(self._recover_and_reissue, req, attempt, gen, err)
        except RuntimeError:                # closed
            settle(req.out, exc=err)

    def _recover_and_reissue(self, req, attempt: int, gen: int, err: BaseException) -> None:
        if attempt != req.attempt or req.out.done() or self._closed:
            return
        try:
            with self._recovery_lock:
                if self._gen == gen:         # nobody recovered from this failure yet
                    self._recover(err, req.step)
            if time.monotonic() - req.first_failure > self.recovery_timeout:
                raise RoleLost(f"step {req.step} could not be delivered within recovery_timeout="
                               f"{self.recovery_timeout:g} s after a failure ({err})")
        except BaseException as e:          # noqa: BLE001 - the trainer's next() raises it
            settle(req.out, exc=self._final_error(e))
            return
        self.faults["reissued"] += 1
        req.out.delayed = True
        for other in sorted(self._requests.values(), key=lambda r: r.step):   # everything of the old generation
            if other.out.done() or (other is not req and other.gen_seen >= self._gen):
                continue
            other.gen_seen = self._gen
            self._issue(other)

    def _final_error(self, err: BaseException) -> BaseException:
        """What the trainer's next() raises for a failure nothing here recovers from. In a launched job a
        role worker that died on any node ends the job unless it is fault tolerant, and the launcher tells
        every trainer why (JobStopped naming the worker and its node): ``err`` (e.g. RoleLost: no spare
        can host the lost loader) is that death's consequence, and often arrives first. So a launched
        job's trainer waits (at most the ``stop_notice_s`` the launcher gives in its layout) for that
        notice, unless the launcher itself is gone (then a JobStopped saying so)."""
        stopped = self._launcher_died(err)
        if stopped is not None:
            return stopped
        if self._launched and isinstance(err, (RoleLost,) + RECOVERABLE):
            wait = float(getattr(self.transport, "rendezvous", {}).get("stop_notice_s", 0.0))
            if self._stop_notice.wait(wait) and self._stopped is not None:
                return JobStopped(self._stopped)
        return err

    def _launcher_died(self, err: BaseException) -> "JobStopped | None":
        """In a launched job whose launcher process is gone (SIGKILL, the OOM killer; its role processes exit
        with it, and a recovery fails on whatever it asks first: the launcher, the Planner, the leader's
        registry): a JobStopped saying so and what to do, instead of ``err`` (None when the launcher answers,
        or this is no launched job). The job counts as stopped from then on."""
        ledger = getattr(self.transport, "ledger", None) if self._launched else None
        if ledger is None or not isinstance(err, (RoleLost,) + RECOVERABLE):
            return None
        from .rpc_calls import ping_worker
        gone = unanswering(lambda actor, t: ping_worker(ledger, actor, t), ["launcher"], 2).get("launcher")
        if not isinstance(gone, ActorDied):
            return None                     # it answers (the failure is another's), or is slow: say what failed
        address, why = getattr(self.transport, "rendezvous", {}).get("address", "?"), str(gone).splitlines()[0][:120]
        self._stopped = (f"the launched job at {address} stopped: its launcher process died (unreachable: {why}), and "
                         f"its role processes exit with it. Start the launcher again, then resume this trainer from "
                         f"its loader's state_dict() (load_state_dict) or, with a checkpoint_dir, from the fault-"
                         f"tolerance store (load_checkpoint_store)")
        return JobStopped(self._stopped)

    def _recover(self, err: BaseException, step: int) -> None:
        """Replace what failed (the Planner: the leader; a constructor: the Planner), then learn the
        new generation and where the roles are."""
        t0, planner = time.monotonic(), self.planner_name
        actor = getattr(err, "actor", None)
        how = "new generation"
        if actor == self.planner_name:
            self._planner_lost(err)
            how = "replaced the Planner" if self.is_leader else "learned the leader's new Planner"
        elif actor is not None and actor.startswith("constructor") and not isinstance(err, JobReset):
            # the constructor may have waited for a frozen Planner (its advance), or share its process: asked
            # first, a frozen Planner would hold report_failure for all of recovery_timeout before it is replaced
            frozen = unanswering(self.transport.ping, [planner], self.timeout).get(planner)
            if frozen is not None:
                with self._recovery_lock:
                    if self.planner_name == planner:
                        self._planner_lost(frozen)
            self._ask_planner(lambda p: p.report_failure(actor, step, timeout=self.recovery_timeout),
                              self.recovery_timeout)
            how = "constructor replaced by the Planner"
            if self.planner_name != planner:
                how = "replaced the Planner" if self.is_leader else "learned the leader's new Planner"
        info = self._ask_planner(lambda p: p.generation())       # may find the Planner lost, and follow it
        if self.planner_name != planner and how == "new generation":
            how = "replaced the Planner" if self.is_leader else "learned the leader's new Planner"
        self.transport.learn(info["where"])
        self._gen, self._constructors = info["gen"], list(info["constructors"])
        self.faults["recoveries"].append({"step": step, "actor": actor, "how": how,
                                          "seconds": round(time.monotonic() - t0, 4)})

    def _ask_planner(self, call, timeout: float | None = None):
        """``call(PlannerRef)``'s answer, surviving a lost Planner (replaced or learned, then asked again)."""
        name = self.planner_name
        try:
            return call(self.planner).result((timeout or self.timeout) + 5)
        except FAILURES as e:
            if getattr(e, "actor", None) != name:
                raise
            with self._recovery_lock:
                if self.planner_name == name:
                    self._planner_lost(e)
            return call(self.planner).result((timeout or self.timeout) + 5)

    def _planner_lost(self, err: BaseException) -> None:
        if self.is_leader:
            self._replace_planner(err)
        else:
            self._await_new_planner(err)

    def _await_new_planner(self, err: BaseException) -> None:
        """Another client: wait (bounded) until the leader has a new Planner, then use it."""
        got = RegistryRef(self.transport, self.recovery_timeout + 5).planner_after(
            self.planner_name, self.recovery_timeout).result(self.recovery_timeout + 10)
        if got is None:
            raise RoleLost(f"client {self.client} lost the Planner ({err}) and the leader (client 0) started no new one "
                           f"within recovery_timeout={self.recovery_timeout:g} s") from err
        if "failed" in got:
            raise RoleLost(f"client {self.client} lost the Planner ({err}), and the leader (client 0) will start no new "
                           f"one: {got['failed']}") from err
        self.transport.learn({got["name"]: got["worker"]})
        self.planner_name = got["name"]

    def _spare_names(self) -> list[str]:
        """Where replacements start: the spare workers, after the role workers."""
        return [self.transport.worker_name(self.n_workers + i) for i in range(self.spares)]

    def _replace_planner(self, err: BaseException) -> None:
        """A new Planner on a spare (a launched job's launcher starts it: it has the job's strategy and
        sources), restored from the store; the other clients learn it from the registry."""
        try:
            self._start_new_planner(err)
        except BaseException as e:
            # the other clients wait for the new Planner in the registry: tell them none comes (before, they
            # waited out recovery_timeout, while this client's close waited a call timeout for them to leave)
            if self._registry is not None:
                self._registry.lost(f"{type(e).__name__}: {e}")
            raise

    def _start_new_planner(self, err: BaseException) -> None:
        self._planners += 1
        name = f"{PLANNER}#{self._planners}"
        dead = {self.transport.worker_name(self.transport.worker_of(self.planner_name))}
        try:
            if self._launched:
                w = LauncherRef(self.transport, self.recovery_timeout).start_planner(name, dead).result(
                    self.recovery_timeout + 5)
                self.transport.learn({name: w})
            else:
                spares = self._spare_names()
                w = start_planner(self.transport, self.cfg, name, {s: self.n_workers + i for i, s in enumerate(spares)},
                                  dead)
        except RoleLost as e:
            raise RoleLost(f"{e} ({err})") from err
        # restoring may wait out frozen roles' call timeouts: the call has the recovery's time, not one call's
        info = PlannerRef(self.transport, name, self.timeout).recover(w, name, timeout=self.recovery_timeout).result(
            self.recovery_timeout + 5)
        self.planner_name = name
        self.transport.learn(info["where"])
        if self._registry is not None:
            self._registry.moved(name, w)

    def _host_registry(self, clients: int | None = None) -> None:
        """The leader, in a job with other clients (``clients``: the job's, where this client's config
        does not say, as in a launched job's), serves where the Planner is (it may replace it)."""
        if self.client == 0 and (clients or self.cfg.clients) > 1:
            self._registry = PlannerRegistry(self.planner_name,
                                             self.transport.worker_name(self.transport.worker_of(PLANNER)))
            self.transport.host(REGISTRY, self._registry)
