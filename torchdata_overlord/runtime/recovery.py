"""Keeping the stream going when roles fail (paper section 6.1): failover, shadows, spares, restore, checkpoints.

Held by the Planner actor, which it reaches only through its generation, step, ``released``
position, :meth:`~.planner_actor.PlannerActor.rewind` and :meth:`~.planner_actor.PlannerActor.new_generation`:

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
  the store with :meth:`Recovery.recover`, then rewinds the same way.

A failure nothing can replace (no shadow, no spare) ends the stream with :class:`RoleLost`, which
names the role and the step: never a silent skip.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..errors import ConfigError, OverlordError
from .constructor_actor import ConstructorActor
from .loader_actor import LoaderActor
from .refs import ConstructorRef, LoaderRef, constructor_actor, loader_actor, shadow_actor
from .spares import serving, spare_order
from .step import JobState
from .transport import ActorDied, CallTimeout

__all__ = ["Recovery", "FaultPolicy", "RoleLost", "FAILURES", "PLANNER_KEY"]

log = logging.getLogger("torchdata_overlord")
PLANNER_KEY = "planner"                 # the Planner's checkpoints in the store
FAILURES = (ActorDied, CallTimeout)


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
    constructor_args: tuple = ()                        # ConstructorActor args after ``index``, before ``peers``
    build_thread: bool = True                           # constructors build on a thread of their own (rpc)

    def __post_init__(self) -> None:
        if isinstance(self.snapshot_every, bool) or not isinstance(self.snapshot_every, int) or self.snapshot_every < 1:
            raise ConfigError(f"snapshot_every must be an integer >= 1 (steps between loader snapshots), got "
                              f"{self.snapshot_every!r}")


class Recovery:
    """Who serves each role now (replacements get new names: a frozen predecessor may wake up), and
    how a failed one is replaced."""

    def __init__(self, job, policy: FaultPolicy):
        self.job, self.policy, self.store = job, policy, policy.store
        self.peers, self.timeout, self.sources = job.peers, job.timeout, job.sources
        self.active = {s: loader_actor(s) for s in self.sources}
        self.shadow: dict[str, str | None] = {s: (shadow_actor(s) if policy.shadows else None) for s in self.sources}
        self.constructor_names = [constructor_actor(c) for c in range(job.n)]
        self.where: dict[str, str] = {}                # replacements' placement, for the clients and loaders
        self.loader_state: dict[str, dict] = {}        # each source's state after the last completed step
        self.renames = 0
        self.replaced: dict[str, int] = collections.defaultdict(int)   # role ("loader:web") -> replacements
        self.home: str | None = None                   # the Planner's worker when it is a replacement on a spare
        self.dead_spares: set[str] = set()
        self.starting: dict[str, tuple] = {}          # source -> (shadow name, worker, future) being started
        self.shadow_died: set[tuple[str, str]] = set()  # (source, shadow) whose follow() found it dead
        self.shadowless: set[str] = set()              # sources warned about: no spare can host their shadow
        self.events: list[dict] = []                   # failures handled: what, role, step, seconds, how

    def loader_ref(self, name: str) -> LoaderRef:
        return LoaderRef(self.peers, name, self.timeout)

    def constructor_ref(self, name: str) -> ConstructorRef:
        return ConstructorRef(self.peers, name, self.timeout)

    # -- calling every loader / constructor, replacing those that fail -------------------------------
    def each_loader(self, call: Callable[[LoaderRef, str], cf.Future], step: int, rejoin: bool = False,
                    issued: Mapping[str, cf.Future] | None = None) -> dict:
        """``call(ref, source)`` on every source's active loader (``issued``: sources whose call was
        made already); a loader that fails is replaced and called again (``rejoin``: not called again,
        the replacement starts at the wanted state). A failed constructor behind a loader's delivery
        is re-raised for the caller."""
        issued = issued or {}
        todo = {s: issued[s] if s in issued else call(self.loader_ref(self.active[s]), s) for s in self.sources}
        out = {}
        while todo:
            cf.wait(list(todo.values()), timeout=2 * self.timeout + 5)
            again = {}
            for s, f in todo.items():
                try:
                    out[s] = f.result(timeout=1)
                except FAILURES as e:
                    actor = getattr(e, "actor", None)
                    if actor is not None and actor.startswith("constructor"):
                        raise
                    self.failover(s, step, e)
                    if not rejoin:
                        again[s] = call(self.loader_ref(self.active[s]), s)
            todo = again
        return out

    def each_constructor(self, call: Callable[[ConstructorRef], cf.Future], step: int) -> dict:
        """``call(ref)`` on every constructor; one that failed is replaced on a spare and called again."""
        futs = {c: call(self.constructor_ref(name)) for c, name in enumerate(self.constructor_names)}
        cf.wait(list(futs.values()), timeout=self.timeout + 5)
        out = {}
        for c, f in futs.items():
            try:
                out[c] = f.result(timeout=1)
            except FAILURES as e:
                t0, old = time.perf_counter(), self.constructor_names[c]
                self._start_constructor(c, step, e)
                out[c] = call(self.constructor_ref(self.constructor_names[c])).result(self.timeout + 5)
                self._event("constructor", old, step, t0, "replaced on a spare", e)
        return out

    # -- spares ---------------------------------------------------------------------------------------
    def _spawn_on_spare(self, name: str, factory, args: tuple, avoid: tuple = ()) -> str:
        """Start ``name`` on the least-loaded live spare process not in ``avoid`` (see
        :mod:`~torchdata_overlord.runtime.spares`); a spare that cannot start it is dead. Returns it."""
        order = spare_order(self.policy.spares, serving(self.checkpointed_roles()), self.dead_spares, avoid)
        for w in order:
            try:
                self.peers.spawn(name, factory, args, w)
            except FAILURES:
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

    # -- Source Loaders -------------------------------------------------------------------------------
    def failover(self, source: str, step: int, err: BaseException) -> None:
        """Replace ``source``'s loader: promote its shadow, else restore one on a spare process."""
        t0 = time.perf_counter()
        old, state = self.active[source], self.loader_state.get(source)
        how = None
        shadow = self.shadow.get(source)
        if shadow is not None and state is not None:
            try:
                self.loader_ref(shadow).promote(self.job.gen, state).result(self.timeout + 5)
                self.active[source], self.shadow[source], how = shadow, None, "promoted its shadow"
            except FAILURES:
                self.shadow[source] = None
        if how is None:
            name = self._new_name(loader_actor(source))
            try:
                self._start_loader(name, source)
                # ``state`` is the one after the last completed step (``step`` steps planned): during a
                # delivery the Planner's own counter has already moved on to the next step
                restored = self._restore_loader(name, source, step, state)
            except (FAILURES + (RoleLost,)) as e:
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
                self.loader_ref(name).restore(self.job.gen, snapshot, consumed).result(self.timeout * 4)
                return f"snapshot of step {snap_version} + {len(consumed)} replayed steps"
        if state is None:
            raise RoleLost(f"no checkpoint of source {source!r} at step {version}")
        self.loader_ref(name).promote(self.job.gen, state).result(self.timeout + 5)
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
        order = spare_order(self.policy.spares, serving(self.checkpointed_roles()), self.dead_spares,
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

    def adopt_shadows(self) -> None:
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
                if isinstance(fut.exception(), FAILURES):
                    self.dead_spares.add(worker)
                log.warning("source %r: its new shadow did not start (%s); trying again", source, fut.exception())
                continue
            self.where[name] = worker
            self.shadow[source] = name
            self.replaced[shadow_actor(source)] += 1
            self.follow(source, self.job.step)
        for source in self.sources:
            self._ensure_shadow(source)

    def follow(self, source: str, version: int) -> None:
        """Tell ``source``'s shadow the primary's state at ``version`` (fire and forget: a dead shadow
        is noticed here and replaced at the next step; a frozen one on promote)."""
        shadow = self.shadow.get(source)
        if shadow is not None and source in self.loader_state:
            def died(f: cf.Future) -> None:
                if isinstance(f.exception(), ActorDied):
                    self.shadow_died.add((source, shadow))

            self.loader_ref(shadow).follow(version, self.loader_state[source]).add_done_callback(died)

    # -- Data Constructors ----------------------------------------------------------------------------
    def _start_constructor(self, c: int, step: int, err: BaseException) -> str:
        name = self._new_name(constructor_actor(c))
        try:
            self._spawn_on_spare(name, ConstructorActor, (c, *self.policy.constructor_args, self.peers, self.timeout,
                                                          self.store, self.policy.build_thread))
        except (FAILURES + (RoleLost,)) as e:
            raise RoleLost(f"constructor {c} failed at step {step} ({err}) and could not be replaced: {e}") from e
        self.constructor_names[c] = name
        self.replaced[constructor_actor(c)] += 1
        return name

    def replace_constructor(self, c: int, step: int, err: BaseException) -> None:
        """A new constructor on a spare, then a rewind to where every client is."""
        t0, old = time.perf_counter(), self.constructor_names[c]
        name = self._start_constructor(c, step, err)
        # its predecessor checkpointed where the clients were; the Planner's own position is newer or equal
        resume = self.constructor_ref(name).resume_point().result(self.timeout)
        self.job.rewind(self.job.released)
        self._event("constructor", old, step, t0, f"replaced on a spare, rewound to step {self.job.released} (its "
                    f"checkpoint said {resume})", err)

    def report_failure(self, actor: str, step: int) -> None:
        """A client saw ``actor`` fail: replace it if it still serves and does not answer (idempotent)."""
        if actor in self.constructor_names:
            try:                             # a slow answer is not a failure: ask it first
                self.constructor_ref(actor).stats().result(self.timeout + 1)
            except FAILURES as e:
                self.replace_constructor(self.constructor_names.index(actor), step, e)

    # -- a replacement Planner ------------------------------------------------------------------------
    def recover(self, home: str | None) -> None:
        """Restore the (new) Planner (started on spare ``home``) from the store and rewind every role
        to the position every client had consumed."""
        job = self.job
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
        self.renames, job.gen = int(roles["renames"]), int(newest[1]["gen"])
        self.dead_spares = set(roles.get("dead_spares", []))
        self.replaced.update(roles.get("replaced", {}))
        self.replaced[PLANNER_KEY] += 1
        self.home = home
        self.peers.learn(dict(self.where))
        loaders = {}
        for s in self.sources:
            snap = self._differential(s, version)
            if snap is None:
                raise RoleLost(f"source {s!r}: no snapshot at or before step {version} to restore from")
            try:
                loaders[s] = self.loader_ref(self.active[s]).restore(job.gen, snap[1], snap[2]).result(self.timeout * 4)
            except FAILURES as e:         # it failed too: a new one on a spare
                t1, old, name = time.perf_counter(), self.active[s], self._new_name(loader_actor(s))
                self._start_loader(name, s)
                loaders[s] = self.loader_ref(name).restore(job.gen, snap[1], snap[2]).result(self.timeout * 4)
                self.active[s] = name
                self.replaced[loader_actor(s)] += 1
                self._event("loader", old, version, t1, "restored on a spare process with the Planner", e)
        job.new_generation({JobState.PLANNER: ck["planner"], JobState.LOADERS: loaders, JobState.FEEDBACK: ck["feedback"]})
        self._event("planner", PLANNER_KEY, version, t0, f"restored from the checkpoint of step {version}", None)

    # -- checkpoints ----------------------------------------------------------------------------------
    def checkpointed_roles(self) -> dict:
        """Who serves where (checkpointed: a replacement Planner continues from it)."""
        return {"active": dict(self.active), "shadow": dict(self.shadow), "constructors": list(self.constructor_names),
                "where": dict(self.where), "renames": self.renames, "dead_spares": sorted(self.dead_spares),
                "replaced": dict(self.replaced), "home": self.home,
                "starting": {name: worker for name, worker, _ in self.starting.values()}}

    def checkpoint(self, version: int, state: dict, consumed: Mapping[str, list]) -> None:
        if self.store is None:
            return
        self.store.put(PLANNER_KEY, version, {"planner": state[JobState.PLANNER], "feedback": state[JobState.FEEDBACK],
                                              "consumed": {s: list(consumed.get(s, [])) for s in self.sources},
                                              "released": self.job.released, "gen": self.job.gen,
                                              "roles": self.checkpointed_roles()})
        # keep the two newest snapshots of each loader (a corrupt newest falls back to the one before)
        # and every Planner checkpoint since the older one: the consumption log a replay needs
        oldest = self.job.released
        for s in self.sources:
            self.store.gc(f"loader/{s}", keep=2)
            oldest = min([oldest] + self.store.steps(f"loader/{s}")[:1])
        self.store.gc(PLANNER_KEY, keep=1, keep_from=oldest)

    def checkpoint_reset(self, version: int, state: dict) -> None:
        """A new line of history starts at ``version``: drop what came after it, snapshot everyone."""
        if self.store is None:
            return
        self.store.discard(PLANNER_KEY, version + 1)
        for s in self.sources:
            self.store.discard(f"loader/{s}", version + 1)
            self.store.put(f"loader/{s}", version, state[JobState.LOADERS][s])
        self.checkpoint(version, state, {})

    def _event(self, kind: str, role: str, step: int, t0: float, how: str, err: BaseException | None) -> None:
        ev = {"kind": kind, "role": role, "step": int(step), "seconds": round(time.perf_counter() - t0, 4),
              "how": how, "error": None if err is None else f"{type(err).__name__}: {str(err)[:200]}"}
        self.events.append(ev)
        log.warning("recovered %s %s at step %d in %.3f s: %s", kind, role, step, ev["seconds"], how)

    def roles(self) -> dict:
        """Every serving role -> where it lives (replacements), the shadows, and how many times each
        role (``"planner"``, ``"loader:<source>"``, ...) was taken over by a replacement."""
        return {"loaders": dict(self.active), "shadows": dict(self.shadow), "constructors": list(self.constructor_names),
                "where": dict(self.where), "replaced": dict(self.replaced)}
