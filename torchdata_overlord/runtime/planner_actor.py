"""The Planner actor: plans each step once the leader client asks for it, and routes its samples.

One step ``s`` (paper Fig. 5, the lazy workflow), when a constructor passes on the leader's request
(``advance``): the Planner takes every Source Loader's buffer metadata (only ``BufferMeta`` travels;
the previous step's deliveries answered it, see :mod:`.ahead`), plans (:func:`~.step.plan_step`),
orders every loader to ``deliver`` the step (the samples go loader -> constructor, never through the
Planner), then ``commit``\\ s the plan and the job's state after the step to every Data Constructor,
which build and answer the clients; the commits' answers are heard while the next step is planned.
Only the leader's request plans, so the leader's feedback always reaches the plan it is meant for
and the stream never depends on which client is fastest.

A *generation* counts resets (``attach`` with a state, or a rewind after a failure): a call from an
older generation fails with :class:`~.step.JobReset` instead of mixing two streams. What keeps the
stream going when roles fail is in :mod:`.recovery`.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import copy
import logging
from typing import Callable, Mapping

from ..errors import ConfigError
from ..plane.place_tree import ClientPlaceTree
from ..plane.plan import Plan
from ..roles.loader_parts import Parts
from ..roles.planner import Planner
from .fault_policy import FAILURES, FaultPolicy, RoleLost
from .feedback import FeedbackLog
from .ahead import MetadataAhead
from .recovery import Recovery
from .refs import PLANNER
from .releases import Releases
from .reshard import Resharding
from .role import RoleActor, fail_all
from .step import JobClosed, JobReset, JobState, plan_step, route
from .transport import settle

__all__ = ["PlannerActor"]

log = logging.getLogger("torchdata_overlord")


class PlannerActor(RoleActor):
    """The central Planner (see the module docstring); ``clients`` trainer processes consume the stream."""

    LEADER = 0

    def __init__(self, strategy: Callable, mesh: ClientPlaceTree, global_batch: int, seed: int, sources: list[str],
                 constructors: int, clients: int, timeout: float, peers, policy: FaultPolicy | None = None,
                 parts: Mapping[str, int] | None = None, autoscaler=None):
        self.planner = Planner(strategy, mesh, global_batch, seed=seed)
        self.mesh, self.sources, self.n = mesh, list(sources), int(constructors)
        policy = policy or FaultPolicy()
        # the Source Loaders: one per source, or a source's data-parallel parts (merged back here)
        self.parts = Parts(self.sources, parts, {s: args[1] for s, args in policy.loader_args.items()})
        self.owners: dict = {}                         # source -> which part holds each sample of this step
        self.autoscaler = autoscaler                   # mixture-driven scaling (scaling.AutoScaler), or None
        self.reshards: list[dict] = []                 # reshards switched or aborted (see .reshard)
        self.clients, self.timeout, self.peers = int(clients), float(timeout), peers
        self.name = PLANNER
        self.gen = 0
        self.feedback = FeedbackLog()                  # the leader's feedback for steps not planned yet
        self.prefetch: int | None = None               # the leader's prefetch: its feedback targets consumed + prefetch
        self.versions: dict[int, dict] = {}            # steps planned -> the job's state then (for rewinds)
        self.releases = Releases(self)                 # what every client consumed; steps to forget
        self.failed: tuple[int, BaseException] | None = None
        self.leader_starts: list[tuple[int, int]] = []  # (generation, start step) of each leader attach
        self.attaches: dict[int, int] = collections.defaultdict(int)
        self.attach_waiting: list[tuple[int, int, int, cf.Future]] = []
        self.aborted: str | None = None                # why the leader could not start the job (see abort)
        self.planned_steps = 0
        self.recovery = Recovery(self, policy)
        self.ahead = MetadataAhead(self.recovery)
        self.resharding = Resharding(self)             # the reshards under way

    @property
    def step(self) -> int:
        """The next step to plan."""
        return self.planner.step

    # -- clients ------------------------------------------------------------------------------
    def attach(self, client: int, state: dict | None, step: int, prefetch: int | None = None) -> dict | cf.Future:
        """Start (or restart) a client at consumed ``step``. The leader's ``state`` (None: keep the
        current one) resets every role; the others must start where the leader did. The leader's
        ``prefetch`` goes into the checkpoints: a resume from the store needs it to tell which feedback the
        trainer had given by a step (see :mod:`.store_state`)."""
        if self.aborted is not None and client != self.LEADER:
            raise JobClosed(self.aborted)
        self.attaches[client] += 1
        if client == self.LEADER:
            if prefetch is not None:
                self.prefetch = int(prefetch)
            if state is not None:
                self.new_generation(state)
            else:
                self.checkpoint_start()          # (once, if the roles' start did not)
            self.leader_starts.append((self.gen, self.step))
            for item in list(self.attach_waiting):
                if item[1] <= len(self.leader_starts):
                    self.attach_waiting.remove(item)
                    self._answer_attach(*item)
            return {"gen": self.gen, "step": self.step}
        fut: cf.Future = cf.Future()
        item = (client, self.attaches[client], step, fut)
        if item[1] <= len(self.leader_starts):
            self._answer_attach(*item)
        else:
            self.attach_waiting.append(item)
        return fut

    def abort(self, reason: str) -> None:
        """The leader could not start the job (a role failed its start-up): every client waiting to attach, and
        every later one, is answered with ``reason`` at once instead of waiting for an attach that never comes."""
        self.aborted = str(reason)
        fail_all([item[3] for item in self.attach_waiting], JobClosed(self.aborted))
        self.attach_waiting = []

    def _answer_attach(self, client: int, count: int, step: int, fut: cf.Future) -> None:
        gen, start = self.leader_starts[count - 1]
        if step != start:
            settle(fut, exc=ConfigError(f"client {client} starts at step {step} but the leader (client 0, the rank "
                                        f"that starts the roles) starts at step {start}; every trainer rank must "
                                        f"load the same checkpoint"))
        else:
            settle(fut, {"gen": gen, "step": start})

    def checkpoint_start(self) -> None:
        """The job's state before its first step, kept and (with a checkpoint store) checkpointed, once: when the
        roles are up, else at the leader's first attach. A Planner lost before the leader's first request is then
        restored from it like any other (the leader's attach resets it to the leader's own state), instead of
        having nothing to restore."""
        if not self.versions:
            self.versions[self.step] = self.state_dict()
            self.recovery.checkpoints.reset(self.step, self.versions[self.step])

    def start_state(self) -> dict:
        """The job's state at step 0, while this line of history keeps it (the leader started there and no
        client has consumed past it yet); else the state now. A trainer rank's loader starts from it whenever it
        is made: a rank slower to make its loader than the leader to plan ahead must not start where the
        Planner stands by then."""
        kept = self.versions.get(0)
        return copy.deepcopy(kept) if kept is not None else self.state_dict()

    def generation(self) -> dict:
        """The current generation and where replaced roles live (a client re-asks with these)."""
        r = self.recovery
        return {"gen": self.gen, "where": dict(r.spares.where), "constructors": list(r.constructor_names)}

    def advance(self, gen: int, step: int, feedback: list) -> None:
        """Plan every step up to ``step`` (the leader asked for it through a constructor). ``feedback``
        is the leader's list for the steps not planned yet (sent again after a failure: never counted twice)."""
        if gen != self.gen:
            raise JobReset(f"step {step} was asked for in generation {gen}; the job is at generation {self.gen} "
                           f"(a client loaded a state, or a role was replaced): ask again")
        self.feedback.replace_from(self.step, feedback)
        while self.step <= step and self.failed is None and self.gen == gen:
            self._plan_one()
        if self.gen != gen:
            raise JobReset(f"a role was replaced at step {step}: the job moved to generation {self.gen}; ask again")
        if self.failed is not None and step >= self.failed[0]:
            raise self.failed[1]

    # -- one step ---------------------------------------------------------------------------------
    def _plan_one(self) -> None:
        r = self.recovery
        r.shadows.adopt()
        step, gen, seen = self.step, self.gen, len(r.events)
        try:
            metas = self.ahead.metadata(gen, step)
            if self.gen != gen:
                return
            metas, self.owners = self.parts.merge_meta(metas)

            def exhausted() -> list[str]:
                done = {self.parts.source_of(k) for k, ex in r.each_loader(lambda ref, s: ref.exhausted(), step).items()
                        if ex}
                return [s for s in self.sources if s in done]

            applied = [[step, v] for v in self.feedback.due(step)]
            plan = plan_step(self.planner, [metas[n] for n in self.sources], self.feedback, exhausted)
            self._dispatch(step, plan, seen, applied)
        except BaseException as e:         # noqa: BLE001 - every client asking for this step or later gets it
            self.fail_from(step, e)

    def fail_from(self, step: int, e: BaseException) -> None:
        """``step`` and every later one fail with ``e`` (the constructors answer their clients so)."""
        if self.failed is not None and self.failed[0] <= step:
            return
        self.failed = (step, e)
        for name in self.recovery.constructor_names:
            try:
                self.recovery.constructor_ref(name).fail(self.gen, step, e)
            except Exception:              # noqa: BLE001 - a lost constructor's clients learn from their own call
                pass

    def _dispatch(self, step: int, plan: Plan, seen: int, applied: list) -> None:
        """Send the step's samples to the constructors and commit it; ``applied``: the feedback its plan used."""
        r, gen = self.recovery, self.gen
        routes = route(plan, self.n, self.sources)
        while True:                         # a constructor replaced meanwhile: send again to the new one
            names = list(r.constructor_names)
            try:
                self.releases.hear()
                if self.gen != gen:
                    return
                args = self._deliveries(gen, step, routes, names)
                delivered = r.each_loader(lambda ref, s: ref.deliver(*args[s], timeout=2 * self.timeout), step)
                if self.gen != gen:
                    return
                r.loader_state = {s: d.state for s, d in delivered.items()}
                self.ahead.keep(gen, step + 1, delivered)
                state = JobState.make(self.planner.state_dict(), self.parts.merge_states(r.loader_state), self.feedback)
                self.versions[step + 1] = state
                r.checkpoints.checkpoint(step + 1, state, routes.sampled, applied)
                info = {"constructors": names, "where": dict(r.spares.where), "delayed": len(r.events) > seen}
                self.releases.committed(gen, step, {c: r.constructor_ref(names[c]).commit(
                    gen, step, plan, routes.buckets[c], state, info) for c in range(self.n)})
                break
            except FAILURES as e:
                actor = getattr(e, "actor", None)
                if actor not in names:
                    raise
                r.replace_constructor(names.index(actor), step, e)
                return                      # rewound: the clients ask again in the new generation
        self.planned_steps += 1
        for key in r.keys:
            r.shadows.follow(key, step + 1)
        self.resharding.after_step(step, routes.sampled)
        if self.autoscaler is not None:
            counts = {s: len(idx) for s, idx in routes.sampled.items()}
            for s, (k, workers) in self.autoscaler.observe(step, counts, self.resharding.counts()).items():
                self.resharding.start(s, k, workers, step)

    def _deliveries(self, gen: int, step: int, routes, names: list[str]) -> dict[str, tuple]:
        """Each loader's ``deliver`` arguments: the step's samples it holds, and where each goes."""
        r, out = self.recovery, {}
        for s in self.sources:
            owners = self.owners.get(s)
            sampled = self.parts.split(s, routes.sampled[s], owners)
            to = {names[c]: self.parts.split(s, idx, owners) for c, idx in routes.to[s].items()}
            for key, idx in sampled.items():
                out[key] = (gen, step, idx, {c: per[key] for c, per in to.items() if per[key]}, dict(r.spares.where))
        return out

    # -- generations ----------------------------------------------------------------------------------
    def new_generation(self, state: Mapping) -> None:
        """Every role back to ``state`` (a new generation): a loaded checkpoint, or a rewind."""
        r = self.recovery
        r.check_current()                   # (before the generation moves: a fenced Planner's would be the live one)
        if set(state[JobState.LOADERS]) != set(self.sources):
            raise ConfigError(f"state has sources {sorted(state[JobState.LOADERS])}, this job has {sorted(self.sources)}")
        self.resharding.abort_all("a new generation (a loaded state, or a rewind)", self.step - 1)
        self.planner.load_state_dict(state[JobState.PLANNER])
        self.gen += 1
        self.feedback = FeedbackLog(state.get(JobState.FEEDBACK, []))
        self.releases.reset(self.step)
        self.failed = None
        # the new line of history is written first: a loader replaced during the reset restores from it
        sources = {s: dict(state[JobState.LOADERS][s]) for s in self.sources}
        r.loader_state = self.parts.split_states(sources)
        v = self.step
        self.versions = {v: JobState.make(self.planner.state_dict(), sources, self.feedback)}
        r.checkpoints.reset(v, self.versions[v])
        r.each_loader(lambda ref, s: ref.new_generation(self.gen, r.loader_state[s]), v, rejoin=True)
        where = dict(r.spares.where, **({self.name: r.home} if r.home else {}))    # a replacement Planner's home
        r.each_constructor(lambda ref: ref.new_generation(self.gen, self.name, where), v)
        for key in r.keys:
            r.shadows.follow(key, v)

    def rewind(self, to: int) -> None:
        """Back to the state after step ``to - 1`` (kept since every client consumed it)."""
        state = self.versions.get(to)
        if state is None:
            raise RoleLost(f"cannot rewind to step {to}: its state is no longer kept (have {sorted(self.versions)})")
        self.new_generation(copy.deepcopy(state))

    # -- recovery (see recovery.py) -----------------------------------------------------------------
    def report_failure(self, actor: str, step: int) -> dict:
        """A client saw ``actor`` fail: replace it if it still serves (idempotent), answer the generation."""
        self.recovery.report_failure(actor, step)
        return self.generation()

    def recover(self, home: str | None, name: str) -> dict:
        """This new Planner (actor ``name`` on spare ``home``) restores the job from the store."""
        self.name = name
        self.recovery.recover(home)
        return self.generation()

    # -- state and stats ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The job's state at the current planned position."""
        r = self.recovery
        states = r.each_loader(lambda ref, s: ref.get_state(), self.step)
        r.loader_state = dict(states)
        return JobState.make(self.planner.state_dict(), self.parts.merge_states(states), copy.deepcopy(self.feedback))

    def roles(self) -> dict:
        return self.recovery.roles()

    def stats(self) -> dict:
        return {"generation": self.gen, "next_step": self.step, "released_below": self.releases.released,
                "steps_planned": self.planned_steps, "consumed": dict(self.releases.consumed),
                "pending_feedback": len(self.feedback), "recoveries": list(self.recovery.events),
                "roles": self.roles(), "reshards": list(self.reshards),
                "resharding": self.resharding.stats(),
                "autoscaler": None if self.autoscaler is None else self.autoscaler.stats()}

    def close(self) -> None:
        """Answer every waiting attach (the leader is leaving: nothing more will be planned); give up
        the reshards under way (their new actors closed)."""
        fail_all([item[3] for item in self.attach_waiting],
                 JobClosed("the job was closed by client 0 (the leader): no more steps are planned"))
        self.attach_waiting = []
        self.resharding.close()
