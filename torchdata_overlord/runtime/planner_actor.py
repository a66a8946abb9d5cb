"""The Planner actor: drives each step for the leader client and keeps the stream going when roles fail.

The protocol of a step is described in :mod:`~torchdata_overlord.runtime.actors`. This module adds
the paper's section 6.1 (non-interrupted fault tolerance):

* every planned step is checkpointed to the store (``planner`` at version = steps planned): the
  Planner's state, the trainer feedback not yet planned, what the step took from each source (the
  loaders' consumption log) and the position every client has consumed (``released``);
* a Source Loader whose call fails (dead peer, or no answer within the timeout: frozen) is replaced
  at once by its *shadow* (promoted to the primary's state after the last completed step), or, with
  no live shadow, by a new loader on a spare process restored from its last snapshot plus a replay
  of the consumption log; then a new shadow is started from the spare pool;
* a Data Constructor that fails is replaced on a spare and the job is *rewound* to the position every
  client has consumed: the roles reset to the state after that step, the generation moves on, and
  the clients ask again for what they have not received; plans are a pure function of the state,
  so the stream is the same;
* a replacement Planner (started by the leader client when this one fails) restores itself from
  the store with :meth:`PlannerActor.recover`, then rewinds the same way.

A failure nothing can replace (no shadow, no spare) ends the stream with :class:`RoleLost`, which
names the role and the step: never a silent skip.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ..errors import BufferShortageError, ConfigError, OverlordError
from ..plane.place_tree import ClientPlaceTree
from ..plane.plan import Plan
from ..roles.constructor import bucket_inputs, receives_nothing
from ..roles.planner import Planner
from .actors import (ConstructorActor, JobClosed, JobReset, LoaderActor, _fail_all, _Role, constructor_actor, gather,
                     loader_actor, shadow_actor)
from .local import LocalJob, SourceExhausted
from .spares import serving, spare_order
from .transport import ActorDied, CallTimeout, settle

__all__ = ["PlannerActor", "FaultPolicy", "RoleLost"]

log = logging.getLogger("torchdata_overlord")
PLANNER_KEY = "planner"
_FAILURES = (ActorDied, CallTimeout)


class RoleLost(OverlordError, RuntimeError):
    """A role failed and nothing could replace it (no live shadow, no spare process)."""


@dataclass
class FaultPolicy:
    """How the Planner keeps the stream going: the checkpoint store (None: no checkpoints, no
    restore after a Planner failure), loader snapshot interval, shadows, and the spare workers
    where replacements start (RPC worker names; in one process any name works)."""

    store: object = None
    snapshot_every: int = 10
    shadows: bool = False
    spares: list = field(default_factory=list)
    loader_args: dict = field(default_factory=dict)     # source -> LoaderActor args before ``peers``
    constructor_args: tuple = ()                        # ConstructorActor args after ``index``

    def __post_init__(self) -> None:
        if isinstance(self.snapshot_every, bool) or not isinstance(self.snapshot_every, int) or self.snapshot_every < 1:
            raise ConfigError(f"snapshot_every must be an integer >= 1 (steps between loader snapshots), got "
                              f"{self.snapshot_every!r}")


class PlannerActor(_Role):
    """The central Planner, driving each step for the leader client (see the module docstring)."""

    LEADER = 0

    def __init__(self, strategy: Callable, mesh: ClientPlaceTree, global_batch: int, seed: int, sources: list[str],
                 constructors: int, clients: int, timeout: float, peers, policy: FaultPolicy | None = None):
        self.planner = Planner(strategy, mesh, global_batch, seed=seed)
        self.mesh, self.sources, self.n = mesh, list(sources), int(constructors)
        self.clients, self.timeout, self.peers = int(clients), float(timeout), peers
        self.policy = policy or FaultPolicy()
        self.store = self.policy.store
        self.gen = 0
        self.feedback: list[list] = []                 # [step, values] not planned yet
        self.history: dict[int, dict] = {}             # step -> reply (routing, state, plan)
        self.versions: dict[int, dict] = {}            # steps planned -> the job's state then (for rewinds)
        self.waiting: dict[int, list] = collections.defaultdict(list)
        self.consumed: dict[int, int] = {}             # client -> steps it consumed
        self.released = 0
        self.failed: tuple[int, BaseException] | None = None
        self.leader_starts: list[tuple[int, int]] = []  # (generation, start step) of each leader attach
        self.attaches: dict[int, int] = collections.defaultdict(int)
        self.attach_waiting: list[tuple[int, int, int, cf.Future]] = []
        self.planned_steps = 0
        # who serves: replacements get new names (a frozen predecessor may wake up)
        self.active = {s: loader_actor(s) for s in self.sources}
        self.shadow: dict[str, str | None] = {s: (shadow_actor(s) if self.policy.shadows else None)
                                              for s in self.sources}
        self.constructor_names = [constructor_actor(c) for c in range(self.n)]
        self.where: dict[str, str] = {}                # replacements' placement, for the clients and loaders
        self.loader_state: dict[str, dict] = {}        # each source's state after the last completed step
        self.renames = 0
        self.replaced: dict[str, int] = collections.defaultdict(int)   # role ("loader:web") -> replacements
        self.home: str | None = None                   # this Planner's worker when it is a replacement on a spare
        self.dead_spares: set[str] = set()
        self.starting: dict[str, tuple] = {}          # source -> (shadow name, worker, future) being started
        self.shadow_died: set[tuple[str, str]] = set()  # (source, shadow) whose follow() found it dead
        self.shadowless: set[str] = set()              # sources warned about: no spare can host their shadow
        self.events: list[dict] = []                   # failures handled: what, role, step, seconds, how

    def _call(self, actor: str, method: str, *args, timeout: float | None = None) -> cf.Future:
        return self.peers.call(actor, method, *args, timeout=timeout or self.timeout)

    def _on_constructors(self, method: str, *args) -> dict:
        """Call every constructor; one that failed is replaced on a spare and called again."""
        futs = {c: self._call(name, method, *args) for c, name in enumerate(self.constructor_names)}
        cf.wait(list(futs.values()), timeout=self.timeout + 5)
        out = {}
        for c, f in futs.items():
            try:
                out[c] = f.result(timeout=1)
            except _FAILURES as e:
                t0, old = time.perf_counter(), self.constructor_names[c]
                self._start_constructor(c, self.planner.step, e)
                out[c] = self._call(self.constructor_names[c], method, *args).result(self.timeout + 5)
                self._event("constructor", old, self.planner.step, t0, "replaced on a spare", e)
        return out

    # -- clients ------------------------------------------------------------------------------
    def attach(self, client: int, state: dict | None, step: int) -> dict | cf.Future:
        """Start (or restart) a client at consumed ``step``. The leader's ``state`` (None: keep the
        current one) resets every role; the others must start where the leader did."""
        self.attaches[client] += 1
        if client == self.LEADER:
            if state is not None:
                self._reset(state)
            elif not self.versions:
                self.versions[self.planner.step] = self._current_state()
                self._checkpoint_reset(self.planner.step, self.versions[self.planner.step])
            self.leader_starts.append((self.gen, self.planner.step))
            for item in list(self.attach_waiting):
                if item[1] <= len(self.leader_starts):
                    self.attach_waiting.remove(item)
                    self._answer_attach(*item)
            return {"gen": self.gen, "step": self.planner.step}
        fut: cf.Future = cf.Future()
        item = (client, self.attaches[client], step, fut)
        if item[1] <= len(self.leader_starts):
            self._answer_attach(*item)
        else:
            self.attach_waiting.append(item)
        return fut

    def _answer_attach(self, client: int, count: int, step: int, fut: cf.Future) -> None:
        gen, start = self.leader_starts[count - 1]
        if step != start:
            settle(fut, exc=ConfigError(f"client {client} starts at step {step} but the leader (client 0, the rank "
                                        f"that starts the roles) starts at step {start}; every trainer rank must "
                                        f"load the same checkpoint"))
        else:
            settle(fut, {"gen": gen, "step": start})

    def _current_state(self) -> dict:
        states = gather({s: self._call(self.active[s], "get_state") for s in self.sources}, self.timeout)
        self.loader_state = dict(states)
        return {LocalJob.PLANNER: self.planner.state_dict(), LocalJob.LOADERS: states,
                LocalJob.FEEDBACK: copy.deepcopy(self.feedback)}

    def _reset(self, state: Mapping) -> None:
        """Every role back to ``state`` (a new generation): a loaded checkpoint, or a rewind."""
        if set(state[LocalJob.LOADERS]) != set(self.sources):
            raise ConfigError(f"state has sources {sorted(state[LocalJob.LOADERS])}, this job has {sorted(self.sources)}")
        self.planner.load_state_dict(state[LocalJob.PLANNER])
        self.gen += 1
        self.feedback = [[int(s), dict(v)] for s, v in state.get(LocalJob.FEEDBACK, [])]
        _fail_all([fut for futs in self.waiting.values() for fut, _ in futs],
                  JobReset(f"the job was reset to generation {self.gen}; ask again"))
        self.history, self.waiting, self.consumed = {}, collections.defaultdict(list), {}
        self.released, self.failed = self.planner.step, None
        # the new line of history is written first: a loader replaced during the reset restores from it
        self.loader_state = {s: dict(state[LocalJob.LOADERS][s]) for s in self.sources}
        v = self.planner.step
        self.versions = {v: {LocalJob.PLANNER: self.planner.state_dict(), LocalJob.LOADERS: dict(self.loader_state),
                             LocalJob.FEEDBACK: copy.deepcopy(self.feedback)}}
        self._checkpoint_reset(v, self.versions[v])
        self._each_loader("reset", {s: (self.loader_state[s], self.gen) for s in self.sources}, v)
        self._on_constructors("reset", self.gen)
        for s in self.sources:
            self._follow(s, v)

    def add_feedback(self, step: int, values: Mapping[str, float]) -> None:
        if step < self.planner.step:
            raise ConfigError(f"feedback for step {step} comes too late: step {self.planner.step} is next to plan")
        self.feedback.append([int(step), {str(k): float(v) for k, v in values.items()}])

    def generation(self) -> dict:
        """The current generation and where replaced roles live (a client re-asks with these)."""
        return {"gen": self.gen, "where": dict(self.where), "constructors": list(self.constructor_names)}

    def ensure(self, client: int, gen: int, step: int, consumed: int, with_plan: bool = False) -> dict | cf.Future:
        """The reply for ``step`` (routing per rank, state after the step, the plan if asked), once
        the leader asked for it; the leader's request plans every step up to it."""
        if gen != self.gen:
            raise JobReset(f"client {client} asks for step {step} of generation {gen}; the job is at generation "
                           f"{self.gen} (a client loaded a state, or a role was replaced): ask again")
        self.consumed[client] = max(self.consumed.get(client, 0), int(consumed))
        self._release()
        if client == self.LEADER:
            while self.planner.step <= step and self.failed is None and self.gen == gen:
                self._plan_one()
            if self.gen != gen:            # a rewind happened while planning
                raise JobReset(f"a role was replaced at step {step}: the job moved to generation {self.gen}; ask again")
        if step in self.history:
            return self._reply(step, with_plan)
        if self.failed is not None and step >= self.failed[0]:
            raise self.failed[1]
        if step < self.released:
            raise ConfigError(f"step {step} was released: every client had consumed it")
        fut: cf.Future = cf.Future()
        self.waiting[step].append((fut, with_plan))
        return fut

    def _reply(self, step: int, with_plan: bool) -> dict:
        h = self.history[step]
        return {"step": step, "routing": h["routing"], "empty": h["empty"], "state": h["state"],
                "constructors": list(self.constructor_names), "where": dict(self.where),
                "delayed": h.get("delayed", False),
                "plan": h["plan"] if with_plan else None}

    def _release(self) -> None:
        below = min(self.consumed.get(c, self.released) for c in range(self.clients))
        if below <= self.released:
            return
        self.released = below
        for s in [s for s in self.history if s < below]:
            del self.history[s]
        for v in [v for v in self.versions if v < below]:
            del self.versions[v]
        for name in self.constructor_names:     # answered in order before any later plan of this constructor
            self._call(name, "release", self.gen, below)

    # -- one step ---------------------------------------------------------------------------------
    def _plan_one(self) -> None:
        self._adopt_shadows()
        step, gen, seen = self.planner.step, self.gen, len(self.events)
        try:
            metas = self._each_loader("metadata", None, step)
            if self.gen != gen:
                return
            due = [v for s, v in self.feedback if s == step]
            try:
                plan = self.planner.plan([metas[n] for n in self.sources], feedback=due)
            except BufferShortageError as e:
                done = [n for n, ex in self._each_loader("exhausted", None, step).items() if ex]
                if done:
                    raise SourceExhausted(f"step {step}: source(s) {done} finished their configured epochs; the "
                                          f"stream ends here ({e})") from e
                raise
            self.feedback = [f for f in self.feedback if f[0] > step]
            self._dispatch(step, plan)
        except BaseException as e:         # noqa: BLE001 - every client asking for this step or later gets it
            self.failed = (step, e)
            for s in [s for s in self.waiting if s >= step]:
                for fut, _ in self.waiting.pop(s):
                    settle(fut, exc=e)
            return
        if step in self.history:
            self.history[step]["delayed"] = len(self.events) > seen     # a role was replaced meanwhile
        for fut, with_plan in self.waiting.pop(step, []):
            settle(fut, self._reply(step, with_plan))

    def _dispatch(self, step: int, plan: Plan) -> None:
        n, gen = self.n, self.gen
        buckets = {c: [b for b in range(len(plan.buckets)) if b % n == c] for c in range(n)}
        routes: dict[str, dict[int, list]] = {s: {} for s in self.sources}
        expected: dict[int, list] = {}
        for c, bs in buckets.items():
            need: dict[str, set] = {}
            for b in bs:
                for src, idx in bucket_inputs(plan, b).items():
                    need.setdefault(src, set()).update(idx)
            expected[c] = sorted(need)
            for src, idx in need.items():
                routes[src][c] = sorted(idx)
        recs = plan.records
        sampled = {name: np.asarray(recs.index[recs.source_id == sid]).tolist() for sid, name in enumerate(recs.sources)}
        while True:                         # a constructor replaced meanwhile: send again to the new one
            names = list(self.constructor_names)
            try:
                plans = {c: self._call(names[c], "plan", gen, step, plan, buckets[c], expected[c]) for c in range(n)}
                args = {s: (gen, step, sampled.get(s, []), {names[c]: idx for c, idx in routes[s].items()},
                            dict(self.where)) for s in self.sources}
                states = self._each_loader("deliver", args, step, timeout=2 * self.timeout)
                gather(plans, self.timeout)
                break
            except _FAILURES as e:
                actor = getattr(e, "actor", None)
                if actor not in names:
                    raise
                self._replace_constructor(names.index(actor), step, e)
                return                      # rewound: the clients ask again in the new generation
        if self.gen != gen:
            return
        routing, empty = [], {}
        for r in range(self.mesh.world_size):        # ranks that receive nothing are answered here
            nothing, value = receives_nothing(plan, r)
            routing.append(-1 if nothing else plan.bucket_of(r) % n)
            if nothing:
                empty[r] = value
        self.loader_state = dict(states)
        state = {LocalJob.PLANNER: self.planner.state_dict(), LocalJob.LOADERS: states,
                 LocalJob.FEEDBACK: copy.deepcopy(self.feedback)}
        self.history[step] = {"routing": routing, "empty": empty, "state": state, "plan": plan}
        self.versions[step + 1] = state
        self.planned_steps += 1
        self._checkpoint(step + 1, state, sampled)
        for s in self.sources:
            self._follow(s, step + 1)

    # -- loaders, with failover ------------------------------------------------------------------
    def _each_loader(self, method: str, args: Mapping[str, tuple] | None, step: int,
                     timeout: float | None = None) -> dict:
        """Call ``method`` on every source's active loader; a loader that fails is replaced and asked
        again (a failed constructor behind a loader's delivery is re-raised for the caller)."""
        todo = {s: self._call(self.active[s], method, *((args or {}).get(s, ())), timeout=timeout)
                for s in self.sources}
        out = {}
        while todo:
            cf.wait(list(todo.values()), timeout=(timeout or self.timeout) + 5)
            again = {}
            for s, f in todo.items():
                try:
                    out[s] = f.result(timeout=1)
                except _FAILURES as e:
                    actor = getattr(e, "actor", None)
                    if actor is not None and actor.startswith("constructor"):
                        raise
                    self._failover(s, step, e)
                    call_args = (args or {}).get(s, ())
                    if method == "reset":                    # the replacement joins at the new state
                        continue
                    again[s] = self._call(self.active[s], method, *call_args, timeout=timeout)
            todo = again
        return out

    def _spawn_on_spare(self, name: str, factory, args: tuple, avoid: tuple = ()) -> str:
        """Start ``name`` on the least-loaded live spare process not in ``avoid`` (see
        :mod:`~torchdata_overlord.runtime.spares`); a spare that cannot start it is dead. Returns it."""
        order = spare_order(self.policy.spares, serving(self._roles()), self.dead_spares, avoid)
        for w in order:
            try:
                self.peers.spawn(name, factory, args, w)
            except _FAILURES:
                self.dead_spares.add(w)      # killed, or died with an earlier replacement
                continue
            self.where[name] = w
            return w
        raise RoleLost(f"no live spare process can host {name!r} (spares {self.policy.spares}, dead "
                       f"{sorted(self.dead_spares)}, not beside {sorted(a for a in avoid if a)}); start the job with "
                       f"more spares")

    def _new_name(self, base: str) -> str:
        self.renames += 1
        return f"{base}#{self.renames}"

    def _failover(self, source: str, step: int, err: BaseException) -> None:
        """Replace ``source``'s loader: promote its shadow, else restore one on a spare process."""
        t0 = time.perf_counter()
        old, state = self.active[source], self.loader_state.get(source)
        how = None
        shadow = self.shadow.get(source)
        if shadow is not None and state is not None:
            try:
                self._call(shadow, "promote", self.gen, state).result(self.timeout + 5)
                self.active[source], self.shadow[source], how = shadow, None, "promoted its shadow"
            except _FAILURES:
                self.shadow[source] = None
        if how is None:
            name = self._new_name(loader_actor(source))
            try:
                self._start_loader(name, source)
                # ``state`` is the one after the last completed step (``step`` steps planned): during a
                # delivery the Planner's own counter has already moved on to the next step
                restored = self._restore_loader(name, source, step, state)
            except (_FAILURES + (RoleLost,)) as e:
                raise RoleLost(f"source {source!r}: its loader {old!r} failed at step {step} ({err}) and could not be "
                               f"replaced: {e}") from e
            self.active[source], how = name, f"restored on a spare process ({restored})"
        self.replaced[loader_actor(source)] += 1
        self._event("loader", old, step, t0, how, err)
        self._ensure_shadow(source)

    def _start_loader(self, name: str, source: str) -> None:
        """A new primary for ``source`` on a spare, never on its shadow's process."""
        shadow = self.shadow.get(source)
        avoid = (self.where.get(shadow) if shadow else None, self.starting.get(source, (None, None, None))[1])
        self._spawn_on_spare(name, LoaderActor, self._loader_args(source), avoid)

    def _loader_args(self, source: str) -> tuple:
        return (*self.policy.loader_args[source], self.peers, self.store, self.policy.snapshot_every)

    def _restore_loader(self, name: str, source: str, version: int, state: dict | None) -> str:
        """Bring loader ``name`` to ``source``'s state at ``version`` (steps planned): from its last
        snapshot plus the consumption log in the store, else from the state kept in memory."""
        if self.store is not None:
            got = self._differential(source, version)
            if got is not None:
                snap_version, snapshot, consumed = got
                self._call(name, "restore", self.gen, snapshot, consumed).result(self.timeout * 4)
                return f"snapshot of step {snap_version} + {len(consumed)} replayed steps"
        if state is None:
            raise RoleLost(f"no checkpoint of source {source!r} at step {version}")
        self._call(name, "promote", self.gen, state).result(self.timeout + 5)
        return "state kept by the Planner"

    def _differential(self, source: str, version: int) -> tuple[int, dict, list] | None:
        """(snapshot version, snapshot, per-step consumption since) from the store, or None."""
        snap = self.store.latest(f"loader/{source}", at_most=version)
        if snap is None:
            return None
        consumed = []
        for v in range(snap[0] + 1, version + 1):
            try:
                ck = self.store.get(PLANNER_KEY, v)
            except (FileNotFoundError, OverlordError) as e:
                raise RoleLost(f"source {source!r}: the consumption log of step {v - 1} is missing or corrupt "
                               f"({e}); cannot replay from the snapshot of step {snap[0]}") from e
            consumed.append(ck["consumed"].get(source, []))
        return snap[0], snap[1], consumed

    def _ensure_shadow(self, source: str) -> None:
        """Start a new shadow for ``source`` on the least-loaded live spare that does not host its
        primary, without waiting (it is adopted once it exists)."""
        if not self.policy.shadows or self.shadow.get(source) is not None or source in self.starting:
            return
        order = spare_order(self.policy.spares, serving(self._roles()), self.dead_spares,
                            [self.where.get(self.active[source])])
        if not order:
            if source not in self.shadowless:
                self.shadowless.add(source)
                log.warning("source %r runs without a shadow: no live spare process except its primary's (a "
                            "failure restores it from the checkpoint instead)", source)
            return
        name = self._new_name(shadow_actor(source))
        self.starting[source] = (name, order[0], self.peers.spawn_async(name, LoaderActor, self._loader_args(source),
                                                                        order[0]))

    def _adopt_shadows(self) -> None:
        """Keep a shadow for every source: forget shadows found dead, adopt those started earlier that
        now exist, start new ones where a source has none (after any recovery)."""
        for source, name in list(self.shadow_died):
            self.shadow_died.discard((source, name))
            if self.shadow.get(source) == name:
                log.warning("source %r: its shadow %r died; starting a new one", source, name)
                self.shadow[source] = None
        for source, (name, worker, fut) in list(self.starting.items()):
            if not fut.done():
                continue
            del self.starting[source]
            if fut.exception() is not None:
                if isinstance(fut.exception(), _FAILURES):
                    self.dead_spares.add(worker)
                log.warning("source %r: its new shadow did not start (%s); trying again", source, fut.exception())
                continue
            self.where[name] = worker
            self.shadow[source] = name
            self.replaced[shadow_actor(source)] += 1
            self._follow(source, self.planner.step)
        for source in self.sources:
            self._ensure_shadow(source)

    def _follow(self, source: str, version: int) -> None:
        shadow = self.shadow.get(source)
        if shadow is not None and source in self.loader_state:
            # fire and forget: a dead shadow is noticed here and replaced at the next step; a frozen one on promote
            def died(f: cf.Future) -> None:
                if isinstance(f.exception(), ActorDied):
                    self.shadow_died.add((source, shadow))

            self._call(shadow, "follow", version, self.loader_state[source]).add_done_callback(died)

    # -- constructors -----------------------------------------------------------------------------
    def _start_constructor(self, c: int, step: int, err: BaseException) -> str:
        name = self._new_name(constructor_actor(c))
        try:
            self._spawn_on_spare(name, ConstructorActor, (c, *self.policy.constructor_args, self.store))
        except (_FAILURES + (RoleLost,)) as e:
            raise RoleLost(f"constructor {c} failed at step {step} ({err}) and could not be replaced: {e}") from e
        self.constructor_names[c] = name
        self.replaced[constructor_actor(c)] += 1
        return name

    def _replace_constructor(self, c: int, step: int, err: BaseException) -> None:
        """A new constructor on a spare, then a rewind to where every client is."""
        t0, old = time.perf_counter(), self.constructor_names[c]
        name = self._start_constructor(c, step, err)
        # its predecessor checkpointed where the clients were; the Planner's own position is newer or equal
        resume = self._call(name, "resume_point").result(self.timeout)
        self._rewind(self.released)
        self._event("constructor", old, step, t0, f"replaced on a spare, rewound to step {self.released} (its "
                    f"checkpoint said {resume})", err)

    def _rewind(self, to: int) -> None:
        state = self.versions.get(to)
        if state is None:
            raise RoleLost(f"cannot rewind to step {to}: its state is no longer kept (have {sorted(self.versions)})")
        self._reset(copy.deepcopy(state))

    def report_failure(self, actor: str, step: int) -> dict:
        """A client saw ``actor`` fail: replace it if it still serves (idempotent), answer the generation."""
        if actor in self.constructor_names:
            try:                             # a slow answer is not a failure: ask it first
                self._call(actor, "stats").result(self.timeout + 1)
            except _FAILURES as e:
                self._replace_constructor(self.constructor_names.index(actor), step, e)
        return self.generation()

    # -- a replacement Planner --------------------------------------------------------------------
    def recover(self, home: str | None = None) -> dict:
        """Restore this (new) Planner (started on spare ``home``) from the store and rewind every role
        to the position every client had consumed; returns the generation and where the roles are."""
        if self.store is None:
            raise RoleLost("the Planner failed and there is no checkpoint store to restore it from; give the job a "
                           "checkpoint_dir")
        t0 = time.perf_counter()
        newest = self.store.latest(PLANNER_KEY)
        if newest is None:
            raise RoleLost("the Planner failed before its first checkpoint; nothing to restore")
        # back to where every client was (the newest checkpoint's released position), or before
        got = self.store.latest(PLANNER_KEY, at_most=min(int(newest[1]["released"]), newest[0]))
        if got is None:
            raise RoleLost(f"no valid Planner checkpoint at or before step {newest[1]['released']}")
        version, ck = got
        roles = newest[1]["roles"]
        self.active, self.shadow = dict(roles["active"]), dict(roles["shadow"])
        self.constructor_names, self.where = list(roles["constructors"]), dict(roles["where"])
        self.renames, self.gen = int(roles["renames"]), int(newest[1]["gen"])
        self.dead_spares = set(roles.get("dead_spares", []))
        self.replaced.update(roles.get("replaced", {}))
        self.replaced[PLANNER_KEY] += 1
        self.home = home
        self.peers.learn(dict(self.where))
        self.planner.load_state_dict(ck["planner"])
        loaders = {}
        for s in self.sources:
            snap = self._differential(s, version)
            if snap is None:
                raise RoleLost(f"source {s!r}: no snapshot at or before step {version} to restore from")
            try:
                loaders[s] = self._call(self.active[s], "restore", self.gen, snap[1], snap[2]).result(self.timeout * 4)
            except _FAILURES as e:         # it failed too: a new one on a spare
                t1, old, name = time.perf_counter(), self.active[s], self._new_name(loader_actor(s))
                self._start_loader(name, s)
                loaders[s] = self._call(name, "restore", self.gen, snap[1], snap[2]).result(self.timeout * 4)
                self.active[s] = name
                self.replaced[loader_actor(s)] += 1
                self._event("loader", old, version, t1, "restored on a spare process with the Planner", e)
        state = {LocalJob.PLANNER: ck["planner"], LocalJob.LOADERS: loaders, LocalJob.FEEDBACK: ck["feedback"]}
        self._reset(state)
        self._event("planner", PLANNER_KEY, version, t0, f"restored from the checkpoint of step {version}", None)
        return self.generation()

    # -- checkpoints ------------------------------------------------------------------------------
    def _roles(self) -> dict:
        """Who serves where (checkpointed: a replacement Planner continues from it)."""
        return {"active": dict(self.active), "shadow": dict(self.shadow), "constructors": list(self.constructor_names),
                "where": dict(self.where), "renames": self.renames, "dead_spares": sorted(self.dead_spares),
                "replaced": dict(self.replaced), "home": self.home,
                "starting": {name: worker for name, worker, _ in self.starting.values()}}

    def _checkpoint(self, version: int, state: dict, consumed: Mapping[str, list]) -> None:
        if self.store is None:
            return
        self.store.put(PLANNER_KEY, version, {"planner": state[LocalJob.PLANNER], "feedback": state[LocalJob.FEEDBACK],
                                              "consumed": {s: list(consumed.get(s, [])) for s in self.sources},
                                              "released": self.released, "gen": self.gen, "roles": self._roles()})
        # keep the two newest snapshots of each loader (a corrupt newest falls back to the one before)
        # and every Planner checkpoint since the older one: the consumption log a replay needs
        oldest = self.released
        for s in self.sources:
            self.store.gc(f"loader/{s}", keep=2)
            oldest = min([oldest] + self.store.steps(f"loader/{s}")[:1])
        self.store.gc(PLANNER_KEY, keep=1, keep_from=oldest)

    def _checkpoint_reset(self, version: int, state: dict) -> None:
        """A new line of history starts at ``version``: drop what came after it, snapshot everyone."""
        if self.store is None:
            return
        self.store.discard(PLANNER_KEY, version + 1)
        for s in self.sources:
            self.store.discard(f"loader/{s}", version + 1)
            self.store.put(f"loader/{s}", version, state[LocalJob.LOADERS][s])
        self._checkpoint(version, state, {})

    # -- state and stats ------------------------------------------------------------------------
    def _event(self, kind: str, role: str, step: int, t0: float, how: str, err: BaseException | None) -> None:
        ev = {"kind": kind, "role": role, "step": int(step), "seconds": round(time.perf_counter() - t0, 4),
              "how": how, "error": None if err is None else f"{type(err).__name__}: {str(err)[:200]}"}
        self.events.append(ev)
        log.warning("recovered %s %s at step %d in %.3f s: %s", kind, role, step, ev["seconds"], how)

    def state_dict(self) -> dict:
        """The job's state at the current planned position (LocalJob's format)."""
        return self._current_state()

    def roles(self) -> dict:
        """Every serving role -> where it lives (replacements), the shadows, and how many times each
        role (``"planner"``, ``"loader:<source>"``, ...) was taken over by a replacement."""
        return {"loaders": dict(self.active), "shadows": dict(self.shadow), "constructors": list(self.constructor_names),
                "where": dict(self.where), "replaced": dict(self.replaced)}

    def stats(self) -> dict:
        return {"generation": self.gen, "next_step": self.planner.step, "released_below": self.released,
                "steps_held": len(self.history), "waiting_requests": sum(len(v) for v in self.waiting.values()),
                "consumed": dict(self.consumed), "pending_feedback": len(self.feedback),
                "recoveries": list(self.events), "roles": self.roles()}

    def close(self) -> None:
        """Answer every waiting request (the leader is leaving: nothing more will be planned)."""
        exc = JobClosed("the job was closed by client 0 (the leader): no more steps are planned")
        _fail_all([fut for futs in self.waiting.values() for fut, _ in futs], exc)
        _fail_all([item[3] for item in self.attach_waiting], exc)
        self.waiting, self.attach_waiting = collections.defaultdict(list), []
