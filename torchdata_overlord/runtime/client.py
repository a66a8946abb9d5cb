"""The trainer's side of a job: ask the Data Constructors for each step, and keep what was consumed.

A client asks only its constructor(s) (``fetch``): the answer is the step's outputs for the wanted
ranks, the job's state after the step and, for the leader (client 0), the plan. The leader's request
carries its feedback and is the one that makes the Planner plan the step. Which constructor serves
a rank is learned from the answers (``routing``); until then a rank is asked of constructor
``dp % n``, which passes on what another constructor builds. A request that fails because a role
failed is asked again once the role is replaced (see :mod:`.client_recovery`).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from ..errors import ConfigError, OverlordError
from .client_recovery import ClientRecovery, JobStopped
from .client_stats import closed_stats, job_stats, serving, snapshot
from .feedback import FeedbackLog
from .job_config import RoleConfig
from .refs import PLANNER, ActorRef, ConstructorRef, PlannerRef, constructor_actor, loader_actor
from .step import JobReset, JobState
from .transport import Transport, check_timeout, settle

__all__ = ["Job", "StepResult"]
log = logging.getLogger("torchdata_overlord")


@dataclass
class StepResult:
    step: int
    plan: object | None        # the step's Plan (the leader's answers carry it)
    outputs: dict              # rank -> what that client receives (see DataConstructor.build)
    state: dict | None = None  # the job's state after this step


class _Request:
    """One step a client asked for, until it is answered (asked again after a failure)."""

    def __init__(self, step: int, wanted: list, consumed: int):
        self.step, self.wanted, self.consumed = step, wanted, consumed
        self.out: cf.Future = cf.Future()
        self.out.step, self.out.delayed = step, False   # delayed: a role's failure held this step up
        self.attempt, self.gen_seen = 0, -1
        self.first_failure: float | None = None


class Job(ClientRecovery):
    """One client of a job's roles, whatever runs them (:class:`~.local.LocalJob`, :class:`~.rpc_job.RpcJob`):
    ``submit``/``step`` the next step, ``state_dict``/``load_state_dict``, ``add_feedback``, ``stats``, ``close``."""

    PLANNER, LOADERS, FEEDBACK = JobState.PLANNER, JobState.LOADERS, JobState.FEEDBACK

    def __init__(self, cfg: RoleConfig, *, timeout: float, recovery_timeout: float, n_workers: int, spares: int):
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise ConfigError(f"spares must be an integer >= 0, got {spares!r}")
        self.cfg, self.mesh, self.names, self.timeout = cfg, cfg.mesh, cfg.names, float(timeout)
        self.n_workers, self.spares = n_workers, spares
        self.recovery_timeout = check_timeout(recovery_timeout)
        self.planner_name = PLANNER
        self.faults = {"failures": [], "recoveries": [], "reissued": 0}
        self._requests: dict[int, _Request] = {}        # step -> request not yet answered
        self._recovery_lock = threading.RLock()      # _recover asks the Planner, which may need recovering
        self._recovery = cf.ThreadPoolExecutor(1, thread_name_prefix="overlord-recovery")
        self._closed = False
        self._own_transport, self._launched = True, False
        self._gen: int | None = None
        self._next = 0
        self._feedback = FeedbackLog()      # the leader's feedback, until every client consumed its step
        self._constructors = [constructor_actor(c) for c in range(cfg.constructors)]
        self._routing: dict[int, int] = {}  # rank -> the constructor that served it last
        self.transport: Transport | None = None
        self.client = 0
        self.prefetch: int | None = None    # the trainer's prefetch (its feedback's lead), told to the Planner
        self.fetches = 0                    # constructor fetch calls this client made
        self._registry = None               # the leader tells the other clients where a new Planner is
        self._planners = 0                  # replacement Planners started
        self._stopped: str | None = None    # why the launcher stopped the job, once it did
        self._stop_notice = threading.Event()   # set with _stopped
        self._final_stats: dict | None = None
        self._running = False               # every role started
        self._close_by: float | None = None  # a deadline for close()'s waits on the roles (LocalJob sets one)
        self._silent: set[int] = set()      # workers whose process answered no ping (frozen or gone): see _find_silent

    def _connected(self) -> None:
        """Every role is started (or joined): listen for the coordinator stopping the job."""
        self.transport.on_stopped(self._on_stopped)
        self._running = True

    def _on_stopped(self, reason: str) -> None:
        """The launcher stopped the job (another trainer died, Ctrl-C...): every step asked for fails
        with JobStopped saying why, now and later."""
        self._stopped = reason
        self._stop_notice.set()
        for req in list(self._requests.copy().values()):
            settle(req.out, exc=JobStopped(reason))

    @property
    def planner(self) -> PlannerRef:
        return PlannerRef(self.transport, self.planner_name, self.timeout)

    @property
    def wait_timeout(self) -> float:
        """How long a step request may take: the Planner may be replacing a loader meanwhile (it
        waits up to twice the call timeout for a frozen one), so a few call timeouts."""
        return 4 * self.timeout

    @property
    def is_leader(self) -> bool:
        """Whether this client's feedback and loaded states drive the job (client 0)."""
        return self.client == 0

    @property
    def step_index(self) -> int:
        return self._next

    def _attach(self, state: Mapping | None, step: int) -> None:
        """(Re)start at ``step``: the steps asked for before are abandoned (they fail with JobReset, and
        are never reissued into the new start, where their consumed positions would release its steps)."""
        with self._recovery_lock:           # not while a recovery learns a generation
            old, self._requests = self._requests, {}
            for req in old.values():
                settle(req.out, exc=JobReset(f"step {req.step} was asked for before the job restarted at step {step}"))
            # a Planner lost before or during the attach (its process killed before the first step, or right
            # after a load_state_dict()) is replaced or learned, then asked again, as for any other call to it
            reply = self._ask_planner(lambda p: p.attach(self.client, state if self.is_leader else None, step,
                                                          self.prefetch))
            self._gen, self._next = reply["gen"], reply["step"]

    def add_feedback(self, step: int, values: Mapping[str, float]) -> None:
        """Feedback for the plan of ``step`` (not yet asked for), sent with the leader's request for it;
        other clients' feedback is not used (the trainer ranks are expected to agree on it)."""
        if self.is_leader:
            self._feedback.add(step, values, self._next)

    # -- requests -----------------------------------------------------------------------------
    def submit(self, ranks: Iterable[int] | None = None, consumed: int | None = None) -> cf.Future:
        """Ask for the next step for ``ranks`` (all when None); a future of its :class:`StepResult`.
        ``consumed``: steps this client has consumed (default: all before this one), so the roles can
        free what every client has used. The future's ``delayed`` is True when a failure held it up."""
        if self._stopped is not None:
            raise JobStopped(self._stopped)
        if self._gen is None:
            try:
                self._attach(None, self._next)
            except BaseException as e:      # noqa: BLE001 - a launched job's launcher may say why (JobStopped)
                final = self._final_error(e)
                if final is e:
                    raise
                raise final from e
        step = self._next
        self._next += 1
        wanted = list(range(self.mesh.world_size)) if ranks is None else [self.mesh._check_rank(int(r)) for r in ranks]
        req = _Request(step, wanted, step if consumed is None else int(consumed))
        self._requests[step] = req
        self._issue(req)
        return req.out

    def _constructor_of(self, rank: int) -> int:
        got = self._routing.get(rank, -1)
        return got if got >= 0 else self.mesh.coords(rank).get("dp", 0) % len(self._constructors)

    def _asked(self, ranks: list) -> dict[int, list]:
        """Constructor -> the ranks to ask it for: each rank's own constructor, except that the
        constructors of one worker process are asked once, through the first of them (it fetches the
        others' ranks in its process: one request per process, not per constructor)."""
        by_c: dict[int, list] = {}
        for r in ranks:
            by_c.setdefault(self._constructor_of(r), []).append(r)
        first: dict[object, int] = {}
        out: dict[int, list] = {}
        for c in sorted(by_c):
            try:
                where = self.transport.worker_of(self._constructors[c])
            except (KeyError, ValueError):
                where = ("constructor", c)
            out.setdefault(first.setdefault(where, c), []).extend(by_c[c])
        return out

    def _issue(self, req: _Request) -> None:
        req.attempt += 1
        attempt, gen = req.attempt, self._gen
        by_c = self._asked(req.wanted)
        parts = []
        try:
            for i, (c, rs) in enumerate(sorted(by_c.items())):
                lead = self.is_leader and i == 0
                ref = ConstructorRef(self.transport, self._constructors[c], self.timeout)
                parts.append(ref.fetch(gen, req.step, rs, self.client, req.consumed, lead,
                                       self._feedback.state() if lead else (), lead, timeout=self.wait_timeout))
            self.fetches += len(parts)
        except BaseException as e:          # noqa: BLE001
            self._failed(req, attempt, gen, e)
            return
        remaining, failed, lock = [len(parts)], [], threading.Lock()

        def finish():
            answers = [p.result(0) for p in parts]
            parts.clear()   # each part's callback (this closure) held the list of parts: a cycle the GC had to free
            outputs, plan = {}, None
            for a in answers:
                outputs.update(a["outputs"])
                self._routing.update(a["routing"])
                plan = plan or a["plan"]
                req.out.delayed = req.out.delayed or a["delayed"]
            if self.is_leader:              # a rewind replans from where every client is: keep the rest
                self._feedback.drop_through(min(a["released"] for a in answers) - 1)
            res = StepResult(req.step, plan, {r: outputs[r] for r in req.wanted}, answers[0]["state"])
            if attempt == req.attempt and settle(req.out, res):
                self._requests.pop(req.step, None)

        def on_part(p):
            # a failed part is acted on at once: the other constructors' parts may wait for the failed
            # one (the leader's fetch plans the step), so waiting for them all would wait out their timeout
            with lock:
                remaining[0] -= 1
                first_failure = p.exception() is not None and not failed
                if first_failure:
                    failed.append(p.exception())
                done = not remaining[0] and not failed
            if first_failure:
                parts.clear()
                self._failed(req, attempt, gen, failed[0])
            elif done:
                finish()

        for p in parts:
            p.add_done_callback(on_part)

    def step(self, ranks: Iterable[int] | None = None) -> StepResult:
        """Plan and build the next step for ``ranks`` (all ranks when None)."""
        return self.submit(ranks).result(self.timeout + self.recovery_timeout + 10)

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The job's state at the Planner's current position (no step in flight)."""
        return self._ask_planner(lambda p: p.state_dict())

    def start_state(self) -> dict:
        """The job's state at step 0, where a new loader of any trainer rank starts (not where the leader may
        have planned to by the time this rank asks)."""
        return self._ask_planner(lambda p: p.start_state())

    def load_state_dict(self, state: Mapping) -> None:
        """Restart at ``state`` (the leader resets every role; another client checks it starts at the
        same step as the leader)."""
        theirs, ours = set(state[self.LOADERS]), set(self.names)
        if theirs != ours:
            raise ConfigError(f"state has sources {sorted(theirs)}, this job has {sorted(ours)}")
        self._feedback = FeedbackLog(state.get(self.FEEDBACK, []))
        self._attach(dict(state), JobState.step(state))

    def unanswering(self, timeout: float) -> dict[str, BaseException]:
        """The Planner and constructors whose process answers no ping within ``timeout`` (frozen, or gone):
        actor -> the failure; what a trainer's timed-out ``next()`` says. Empty in one process."""
        from .fault_policy import unanswering
        lost = unanswering(self.transport.ping, [self.planner_name] + list(self._constructors), timeout)
        self._silent.update(w for w in map(self._worker_of, lost) if w is not None)
        return lost

    def _worker_of(self, actor: str) -> int | None:
        try:
            return self.transport.worker_of(actor)
        except (KeyError, ValueError):
            return None

    def _answers(self, actor: str) -> bool:
        """Whether ``actor``'s process answered the last ping (:meth:`_find_silent`); an unknown one counts as
        answering."""
        return self._worker_of(actor) not in self._silent

    def _find_silent(self) -> None:
        """Before :meth:`close` waits on the roles: ping the process of the Planner, every constructor and Source
        Loader, all at once (a live process answers at once, however busy its actors), and note those that do
        not answer within ``min(timeout, 5)`` s, or 1 s for one that answered no ping before (a timed-out
        ``next()`` pinged it): close then sends them nothing that would wait out a call timeout, and their workers
        are not waited for to exit (before, the close after a frozen Planner took 32 s with timeout=6, measured:
        over 2 minutes at the defaults)."""
        actors = [self.planner_name] + list(self._constructors) + [loader_actor(k) for k in self.cfg.parts.keys]
        known, futs = set(self._silent), {}
        for a in actors:
            w = self._worker_of(a)
            if w is None or w in futs:
                continue
            try:
                futs[w] = self.transport.ping(a, 1.0 if w in known else min(self.timeout, 5.0))
            except Exception:              # noqa: BLE001 - a transport that is stopping: nothing to wait for
                pass
        cf.wait(list(futs.values()), timeout=min(self.timeout, 5.0) + 1)
        silent = set()
        for w, f in futs.items():
            try:
                f.result(timeout=0)
            except Exception:              # noqa: BLE001 - CallTimeout (frozen), ActorDied (gone), or no answer yet
                silent.add(w)
        self._silent = silent
        if silent:
            self.transport.mark_unhealthy()      # its workers get 2 s to exit when the group ends, not stop_timeout

    def stats(self) -> dict:
        """Per-source loader stats, Planner and constructor queue depths, recoveries, each role's process
        and memory, and this client's failures and reissued requests. Roles keep their names after a
        recovery (``"roles"``: role -> its current pid; ``"role_recovery"``: role -> the actor serving it,
        its pid and how many times a replacement took it over). A role that does not answer within the
        call timeout (busy with a long fill, or failed) is listed in ``"unanswered"`` and its entry is
        ``{"error": ...}``: diagnostics never stop the training loop. After :meth:`close`: the roles'
        stats as the close began (they are gone), this client's final ones, and ``"closed": True``."""
        return closed_stats(self) if self._closed else job_stats(self)

    def close(self, interrupted: bool = False) -> None:
        """Leave the job, first keeping what :meth:`stats` says (bounded). A client of a launched job
        tells the launcher and leaves, another client of a trainer group just leaves; client 0 of a
        job it started first waits (up to the timeout) for the other clients to close it, then closes
        the roles (bounded, errors ignored) and stops the workers (unless another job shares them). A role whose
        process answers no ping (frozen or gone: :meth:`_find_silent`) is sent nothing and not waited for.
        ``interrupted``: closing on a Ctrl-C (see :meth:`.local.LocalJob.close`; the worker processes of
        an rpc job are stopped the same way either way)."""
        if self._closed:
            return
        if self.transport is not None and self._running and self._stopped is None:
            self._find_silent()
        self._final_stats = snapshot(self)
        self._closed = True
        self._recovery.shutdown(wait=False, cancel_futures=True)
        if self._registry is not None:      # a client waiting for a new Planner from this leader gets none
            self._registry.lost("client 0 (the leader, which replaces a lost Planner) closed its loader", keep=True)
        try:
            if self.transport is not None and self._stopped is None and self.is_leader and self._gen is not None:
                self._leader_leaves()
            if self.transport is not None and self._stopped is None:
                self.transport.leave(self.timeout)
            if self.transport is not None and self.client == 0 and not self._launched:
                self._close_roles()
        finally:
            if self._own_transport and self.transport is not None:
                self.transport.stop()
            for t in list(getattr(self._recovery, "_threads", ())):
                t.join(self._close_wait(self.timeout))    # a recovery under way ends: its calls now fail at once

    def _close_wait(self, bound: float) -> float:
        """How long one wait of :meth:`close` may take: ``bound``, cut to what is left before the close's
        deadline where it has one (0: do not wait)."""
        if self._close_by is None:
            return bound
        return max(0.0, min(bound, self._close_by - time.monotonic()))

    def _leader_leaves(self) -> None:
        """Tell the constructors no step this leader has not asked for will be planned: another client waiting
        for one learns it at once, instead of after its timeout (and a launched job's other trainers leave)."""
        reason = ("client 0 (the leader, whose requests plan the steps) closed its loader: no step after those it "
                  "asked for will be planned; every trainer rank must run the same number of steps")
        t = self._close_wait(min(self.timeout, 5.0))
        if t <= 0:
            return
        futs = []
        for name in filter(self._answers, self._constructors):     # (a frozen one would take all of ``t``)
            try:
                futs.append(ConstructorRef(self.transport, name, t).leader_left(self._gen, reason))
            except Exception:              # noqa: BLE001 - best effort: a lost constructor's clients learn otherwise
                pass
        cf.wait(futs, timeout=t + 1)

    def _close_roles(self) -> None:
        missing = self.transport.wait_for_clients(self.timeout)
        if missing:
            log.warning("closing the roles while client(s) %s have not left after %g s", missing, self.timeout)
        try:
            if not self._answers(self.planner_name):
                raise OverlordError("the Planner's process answers no ping")     # asking it would wait a call timeout
            actors = list(serving(self)[0].values())
            replaced = self.planner.stats().result(self.timeout)["recoveries"]
            if replaced or self.faults["recoveries"]:
                self.transport.mark_unhealthy()      # a replaced role may be frozen: no graceful wait
        except Exception:            # noqa: BLE001 - the Planner may be gone: close what we know
            actors = [self.planner_name] + [loader_actor(n) for n in self.names] + list(self._constructors)
        started = getattr(self.transport, "started", None)
        if not self._running and started is not None:
            # the roles did not all start: a call to one never started would wait for it a whole call timeout
            actors = [a for a in actors if a in started]
        actors = [a for a in actors if self._answers(a)]     # a frozen process's roles: its worker is killed
        futs = []
        for a in actors:
            try:
                futs.append(ActorRef(self.transport, a, self.timeout).close())
            except Exception:        # noqa: BLE001 - the actor may never have started
                pass
        cf.wait(futs, timeout=self.timeout + 5)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
