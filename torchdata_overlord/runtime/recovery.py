"""Keeping the stream going when roles fail (paper section 6.1): who serves each role, and replacing
the ones that fail. Its parts: :mod:`.shadows` (idle twins of the loaders), :mod:`.recovery_store`
(the checkpoints and the differential restore), :mod:`.spares` (where a replacement starts) and
:mod:`.fault_policy` (the policy, and :class:`~.fault_policy.RoleLost`).

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
  the store with :meth:`Recovery.recover`, then rewinds the same way; the roles whose process answers
  no ping (frozen with the old Planner) are replaced at once, the others restored, all together (a lost
  loader by its live shadow, restored the same way, before any spare is taken). It first *fences* its
  predecessor: its incarnation goes into the store (``planner-fence``), and a Planner that finds a later
  one there (it was frozen, not dead, and woke up) writes nothing more and replaces no role
  (:meth:`Recovery.check_current`).

A failure nothing can replace (no shadow, no spare) ends the stream with :class:`~.fault_policy.RoleLost`, which
names the role and the step: never a silent skip.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import time
from typing import Callable, Iterable

from .constructor_actor import ConstructorActor
from .fault_policy import FAILURES, FaultPolicy, RoleLost, unanswering
from .loader_actor import LoaderActor
from .recovery_store import FENCE_KEY, PLANNER_KEY, RecoveryStore
from .refs import ConstructorRef, LoaderRef, constructor_actor, loader_actor
from .shadows import Shadows
from .spares import Spares
from .step import JobReset, JobState

__all__ = ["Recovery"]

log = logging.getLogger("torchdata_overlord")


class Recovery:
    """Who serves each role now (replacements get new names: a frozen predecessor may wake up), and
    how a failed one is replaced."""

    def __init__(self, job, policy: FaultPolicy):
        self.job, self.policy, self.store = job, policy, policy.store
        self.peers, self.timeout, self.sources = job.peers, job.timeout, job.sources
        self.active = {key: loader_actor(key) for key in self.keys}       # loader key -> the actor serving it
        self.constructor_names = [constructor_actor(c) for c in range(job.n)]
        self.loader_state: dict[str, dict] = {}        # each source's state after the last completed step
        self.renames = 0
        self.replaced: dict[str, int] = collections.defaultdict(int)   # role ("loader:web") -> replacements
        self.home: str | None = None                   # the Planner's worker when it is a replacement on a spare
        self.incarnation = 0                           # which Planner this is: 0 the first, k its k-th replacement
        self.events: list[dict] = []                   # failures handled: what, role, step, seconds, how
        self.shadows, self.checkpoints = Shadows(self), RecoveryStore(self)
        self.spares = Spares(self.peers, policy.spares, self.checkpoints.roles)

    @property
    def keys(self) -> list[str]:
        """Every Source Loader's key: a source's name, or one of its data-parallel parts (``job.parts``)."""
        return self.job.parts.keys

    def loader_actor_args(self, key: str) -> tuple:
        """The arguments of a new :class:`~.loader_actor.LoaderActor` for loader ``key``."""
        parts = self.job.parts
        return self.policy.loader_actor_args(parts.source_of(key), self.peers, parts.shard_of(key))

    def loader_ref(self, name: str) -> LoaderRef:
        return LoaderRef(self.peers, name, self.timeout)

    def constructor_ref(self, name: str) -> ConstructorRef:
        return ConstructorRef(self.peers, name, self.timeout)

    # -- calling every loader / constructor, replacing those that fail -------------------------------
    def each_loader(self, call: Callable[[LoaderRef, str], cf.Future], step: int, rejoin: bool = False,
                    only: Iterable[str] | None = None) -> dict:
        """``call(ref, key)`` on every active loader (``only``: on these loader keys); a loader
        that fails is replaced and called again (``rejoin``: not called again, the replacement starts at
        the wanted state). A failed constructor behind a loader's delivery is re-raised for the caller."""
        todo = {s: call(self.loader_ref(self.active[s]), s) for s in (self.keys if only is None else only)}
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

    def check_current(self) -> None:
        """Raise JobReset when a later Planner has replaced this one (it was frozen, not dead, and woke up): it
        must not write the store or replace roles of the job its successor now runs. The successor says so in
        the store first (:data:`FENCE_KEY`, at its incarnation) before it restores anything."""
        if self.store is None:
            return
        later = [k for k in self.store.steps(FENCE_KEY) if k > self.incarnation]
        if later:
            raise JobReset(f"this Planner (incarnation {self.incarnation}) was replaced by Planner incarnation "
                           f"{max(later)}: it was frozen, not dead; it acts no more")

    def new_name(self, base: str) -> str:
        """A replacement's name (never its predecessor's: a frozen one may wake up)."""
        self.renames += 1
        return f"{base}#{self.renames}"

    # -- Source Loaders -------------------------------------------------------------------------------
    def failover(self, source: str, step: int, err: BaseException) -> None:
        """Replace loader ``source`` (a loader key): promote its shadow, else restore one on a spare process."""
        self.check_current()
        t0 = time.perf_counter()
        old, state = self.active[source], self.loader_state.get(source)
        how = "promoted its shadow" if self.shadows.promote(source, state) else None
        if how is None:
            try:
                name = self._new_loader(source)
                # ``state`` is the one after the last completed step (``step`` steps planned): during a
                # delivery the Planner's own counter has already moved on to the next step
                restored = self._restore_loader(name, source, step, state)
            except (FAILURES + (RoleLost,)) as e:
                raise RoleLost(f"source {source!r}: its loader {old!r} failed at step {step} ({err}) and could not be "
                               f"replaced: {e}") from e
            self.active[source], how = name, f"restored on a spare process ({restored})"
        self.replaced[loader_actor(source)] += 1
        self._event("loader", old, step, t0, how, err)
        self.shadows.ensure(source)

    def _new_loader(self, source: str) -> str:
        """A new primary for ``source`` on a spare, never on its shadow's process (not restored yet)."""
        name = self.new_name(loader_actor(source))
        self.spares.spawn(name, LoaderActor, self.loader_actor_args(source), self.shadows.workers(source))
        return name

    def _restore_loader(self, name: str, source: str, version: int, state: dict | None) -> str:
        """Bring loader ``name`` to ``source``'s state at ``version`` (steps planned): from its last
        snapshot plus the consumption log in the store, else from the state kept in memory."""
        if self.store is not None:
            got = self.checkpoints.differential(self.job.parts.source_of(source), version)
            if got is not None:
                snap_version, snapshot, consumed = got
                self.loader_ref(name).restore(self.job.gen, snapshot, consumed, timeout=self.timeout * 4).result(
                    self.timeout * 4 + 5)         # a replay may take longer than one call's timeout
                return f"snapshot of step {snap_version} + {len(consumed)} replayed steps"
        if state is None:
            raise RoleLost(f"no checkpoint of source {source!r} at step {version}")
        self.loader_ref(name).promote(self.job.gen, state).result(self.timeout + 5)
        return "state kept by the Planner"

    # -- Data Constructors ----------------------------------------------------------------------------
    def _start_constructor(self, c: int, step: int, err: BaseException) -> str:
        name = self.new_name(constructor_actor(c))
        try:
            self.spares.spawn(name, ConstructorActor, self.policy.constructor_actor_args(c, self.peers, self.timeout))
        except (FAILURES + (RoleLost,)) as e:
            raise RoleLost(f"constructor {c} failed at step {step} ({err}) and could not be replaced: {e}") from e
        self.constructor_names[c] = name
        self.replaced[constructor_actor(c)] += 1
        return name

    def replace_constructor(self, c: int, step: int, err: BaseException) -> None:
        """A new constructor on a spare, then a rewind to where every client is."""
        self.check_current()
        t0, old = time.perf_counter(), self.constructor_names[c]
        name = self._start_constructor(c, step, err)
        # its predecessor checkpointed where the clients were; the Planner's own position is newer or equal
        resume = self.constructor_ref(name).resume_point().result(self.timeout)
        to = self.job.releases.released
        self.job.rewind(to)
        self._event("constructor", old, step, t0, f"replaced on a spare, rewound to step {to} (its checkpoint said "
                    f"{resume})", err)

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
        # back to where every client was (the newest checkpoint's released position), or before
        newest, version, ck = self.checkpoints.restore_point()
        self.checkpoints.restore_roles(newest["roles"])
        self.events[:0] = newest.get("events", [])      # the recoveries before this one (stats() reports them)
        job.gen = int(newest["gen"])
        job.prefetch = newest.get("prefetch")
        self.replaced[PLANNER_KEY] += 1
        # fence the predecessor first: frozen rather than dead, it may wake up and act on the roles and the store
        self.incarnation = max(self.replaced[PLANNER_KEY], max(self.store.steps(FENCE_KEY), default=0) + 1)
        self.store.put(FENCE_KEY, self.incarnation, {"planner": job.name})
        self.store.gc(FENCE_KEY, keep=2)
        self.home = home
        self.peers.learn(dict(self.spares.where))
        snaps = {}
        for s in self.keys:
            snaps[s] = self.checkpoints.differential(self.job.parts.source_of(s), version)
            if snaps[s] is None:
                raise RoleLost(f"source {s!r}: no snapshot at or before step {version} to restore from")
        # the predecessor may have been frozen, not killed, and the roles of its process with it: a ping (answered
        # whatever the role is busy with) finds them within one call timeout, all at once, instead of each
        # restore waiting out its own, longer, timeout in turn (the replay's)
        shadows = [n for n in self.shadows.names.values() if n is not None]
        frozen = unanswering(self.peers.ping, list(self.active.values()) + list(self.constructor_names) + shadows,
                             self.timeout)
        for s, name in self.shadows.names.items():
            if name in frozen:                          # frozen (or gone) with it: a new one at the next step
                self.shadows.names[s] = None
        loaders = self._restore_loaders(version, snaps, frozen)
        for c, name in enumerate(list(self.constructor_names)):
            if name in frozen:            # replaced now, not after the new generation's call to it times out
                t1 = time.perf_counter()
                self._start_constructor(c, version, frozen[name])
                self._event("constructor", name, version, t1, "replaced on a spare", frozen[name])
        job.new_generation({JobState.PLANNER: ck["planner"], JobState.LOADERS: job.parts.merge_states(loaders),
                            JobState.FEEDBACK: ck["feedback"]})
        self._event("planner", PLANNER_KEY, version, t0, f"restored from the checkpoint of step {version}", None)

    def _restore_loaders(self, version: int, snaps: dict, frozen: dict) -> dict:
        """Every loader key's state at ``version``, each loader restored from its snapshot and the consumption
        log since (``snaps``): the serving loader where its process answers (not in ``frozen``); for one lost,
        its live shadow, restored the same way; else a new loader on a spare. Each round's restores run at once."""
        gen = self.job.gen

        def restore_all(names: dict[str, str]) -> tuple[dict, dict]:
            asked = {s: self.loader_ref(n).restore(gen, snaps[s][1], snaps[s][2], timeout=self.timeout * 4)
                     for s, n in names.items()}
            cf.wait(list(asked.values()), timeout=self.timeout * 4 + 5)
            done, lost = {}, {}
            for s, f in asked.items():
                try:
                    done[s] = f.result(timeout=1)
                except FAILURES + (cf.TimeoutError,) as e:
                    lost[s] = e
            return done, lost

        loaders, failed = restore_all({s: self.active[s] for s in self.keys if self.active[s] not in frozen})
        failed.update({s: frozen[self.active[s]] for s in self.keys if self.active[s] in frozen})
        t1 = time.perf_counter()
        twins = {s: self.shadows.names.get(s) for s in failed}
        promoted, gone = restore_all({s: n for s, n in twins.items() if n is not None})
        for s in gone:
            self.shadows.names[s] = None                # lost too: a new one is started at the next step
        for s, state in promoted.items():               # no spare needed
            old, loaders[s] = self.active[s], state
            self.active[s], self.shadows.names[s] = twins[s], None
            self.replaced[loader_actor(s)] += 1
            self._event("loader", old, version, t1, "its shadow took over, restored from the checkpoint with the "
                        "Planner", failed.pop(s))
        started = {s: (time.perf_counter(), self.active[s], self._new_loader(s), e) for s, e in failed.items()}
        restored, lost = restore_all({s: name for s, (_, _, name, _) in started.items()})
        if lost:
            s, e = next(iter(lost.items()))
            raise RoleLost(f"source {s!r}: its loader could not be restored on a spare process with the Planner: {e}")
        for s, (t, old, name, e) in started.items():
            loaders[s], self.active[s] = restored[s], name
            self.replaced[loader_actor(s)] += 1
            self._event("loader", old, version, t, "restored on a spare process with the Planner", e)
        return loaders

    # -- what happened, who serves where -------------------------------------------------------------
    def _event(self, kind: str, role: str, step: int, t0: float, how: str, err: BaseException | None) -> None:
        ev = {"kind": kind, "role": role, "step": int(step), "seconds": round(time.perf_counter() - t0, 4),
              "how": how, "error": None if err is None else f"{type(err).__name__}: {str(err)[:200]}"}
        self.events.append(ev)
        log.warning("recovered %s %s at step %d in %.3f s: %s", kind, role, step, ev["seconds"], how)

    def roles(self) -> dict:
        """Every serving role -> where it lives (replacements), the shadows, and how many times each
        role (``"planner"``, ``"loader:<source>"``, ...) was taken over by a replacement."""
        return {"loaders": dict(self.active), "parts": self.job.parts.to_dict(), "shadows": dict(self.shadows.names),
                "constructors": list(self.constructor_names), "where": dict(self.spares.where),
                "replaced": dict(self.replaced)}
