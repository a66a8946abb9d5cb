"""Resharding a source live (paper 5.2): the Planner moves a source from its data-parallel loader
actors to ``k`` new ones while the old ones go on serving steps, with nothing lost or repeated.

Three phases, driven by the Planner at its step boundaries (after a step's deliveries and commits):

1. *Prepare*, off the Planner's thread. When the scaler decides after step ``s``, the source's state
   after ``s`` (its parts' states merged: placement-free, see :mod:`~torchdata_overlord.roles.loader_parts`)
   is the reshard's *base*. A small executor of the Planner's starts the ``k`` new actors on the job's
   least-loaded role processes and loads the base into each; then each warms (fills its buffer) on its
   own thread. The old actors serve the steps meanwhile.
2. *Catch up*, in rounds, on the new actors' own threads. The Planner logs what every step since the
   base took from the source. At a boundary where the last round (at first: the warm-up) is done and
   the new actors are more than one step behind, the next round replays the steps logged since
   (:meth:`~.loader_actor.LoaderActor.catch_up`: fill, take the step's indices a part holds, from where
   the part is, no reset). A row those steps took is read again for its place in the order but not
   transformed again, so a round costs reading, not decoding, and the new parts outrun the steps. The
   log is the Planner's own, in memory, only for the steps not yet replayed (the store's consumption
   log is on disk, and there is none without a checkpoint directory).
3. *Switch*, on the Planner's thread, small. At a boundary where the new actors are at most one step
   behind, they replay that step (one step's refill, as a delivery) and answer their states; the
   Planner retires the old actors and their shadows and plans the next step from the new ones.

Merged parts are exactly one loader, so the plans do not change. One reshard per source at a time. A
new actor that fails (cannot start, load, warm or catch up, or does not answer in time) aborts its
reshard: the new actors are closed, the old ones go on untouched. A new generation (a loaded state, a
rewind) aborts every pending reshard, its base being the old line of history's; an old actor replaced
meanwhile does not (the base does not depend on who serves). Closing the Planner stops the executor
and closes the pending actors.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass, field

from ..roles.loader_parts import merge_states, part_keys
from .loader_actor import LoaderActor
from .refs import PLANNER, LoaderRef, loader_actor

__all__ = ["Resharding", "Pending"]

log = logging.getLogger("torchdata_overlord")


class Aborted(RuntimeError):
    """A pending reshard was given up before its actors all started."""


def _actor_cores(cores: dict, source: str, actors: int) -> float:
    """Estimated cores of one of ``actors`` loader actors of ``source`` (its share of the source's, by
    :meth:`~torchdata_overlord.scaling.AutoScaler.cores`)."""
    return cores["sources"].get(source, 0.0) / actors


def _hosts(r, parts, count: int, each: float, retiring: list[str], busy: list[tuple], cores: dict) -> list:
    """A role process for each of ``count`` new actors of ``each`` estimated cores: the process whose
    serving actors have the least estimated load first, then the one with the fewest of them. Serving:
    the loaders but the ``retiring`` ones (a source's cores shared by its ``parts``), the constructors,
    the Planner, and ``busy`` ((process, cores) of other pending reshards' new actors); ``cores``:
    :meth:`~torchdata_overlord.scaling.AutoScaler.cores`. Spares are kept for replacements. None where
    actors are not placed (one process)."""
    placement = getattr(r.peers, "placement", None)
    if not placement:
        return [None] * count
    spares = set(r.policy.spares)
    load = {w: [0.0, 0] for w in sorted(set(placement.values()) - spares)}
    per_loader = {s: _actor_cores(cores, s, n) for s, n in parts.counts.items()}
    serving = [(placement.get(name), per_loader[parts.source_of(key)]) for key, name in r.active.items()
               if key not in retiring]
    serving += [(placement.get(name), cores["constructor"]) for name in r.constructor_names]
    serving += [(r.home or placement.get(PLANNER), cores["planner"]), *busy]
    for w, c in serving:
        if w in load:
            load[w][0] += c
            load[w][1] += 1
    out = []
    for _ in range(count):
        w = min(load, key=lambda w: (*load[w], w))
        load[w][0] += each
        load[w][1] += 1
        out.append(w)
    return out


@dataclass(eq=False)
class Pending:
    """One source's reshard in progress: its new actors and how far they are."""

    source: str
    old: int                        # actors serving the source when it was decided
    k: int
    workers: int
    names: dict                     # new loader key -> its actor
    hosts: dict                     # new loader key -> its role process (None: one process)
    gen: int
    decision_step: int              # decided after this step: the base is the state after it
    t0: float
    log: list = field(default_factory=list)      # the source's sampled indices of each step not yet sent
    behind_from: int = 0            # the first step of ``log``
    rounds: int = 0                 # catch-up rounds launched
    t_switch: float = 0.0           # when the switch's last replay began
    started: list = field(default_factory=list)  # new keys whose actor exists (the executor appends)
    cancelled: threading.Event = field(default_factory=threading.Event)
    prepare: cf.Future | None = None             # the executor's start + load; answers the warm-ups
    round: dict | None = None                    # new key -> the future of its warm-up or catch-up round
    closing: list = field(default_factory=list)  # close() futures of its actors, once aborted

    def phase(self) -> str:
        if self.round is None:
            return "starting"
        return "warming" if self.rounds == 0 else f"catching up (round {self.rounds})"


def _prepare(p: Pending, peers, args: dict, base: dict, timeout: float) -> dict:
    """On the executor: start every new actor and load ``base`` into it; returns its warm-up's future."""
    for key, name in p.names.items():
        if p.cancelled.is_set():
            raise Aborted(f"source {p.source!r}: reshard given up while its actors started")
        peers.spawn(name, LoaderActor, args[key], p.hosts[key])
        p.started.append(key)
    refs = {key: LoaderRef(peers, name, timeout) for key, name in p.names.items()}
    for f in [ref.new_generation(p.gen, base) for ref in refs.values()]:
        f.result(timeout + 5)
    return {key: ref.warm() for key, ref in refs.items()}


class Resharding:
    """The pending reshards of a :class:`~.planner_actor.PlannerActor` (``pending``: source -> :class:`Pending`);
    each finished or aborted one is recorded in the Planner's ``reshards``."""

    def __init__(self, job):
        self.job = job
        self.pending: dict[str, Pending] = {}
        self._pool: cf.ThreadPoolExecutor | None = None
        self._closed = False

    def counts(self) -> dict[str, int]:
        """Each source's loader actors, a pending reshard's as if done (what the scaler decides from)."""
        return {**self.job.parts.counts, **{s: p.k for s, p in self.pending.items()}}

    def _ref(self, name: str, timeout: float | None = None) -> LoaderRef:
        r = self.job.recovery
        return LoaderRef(r.peers, name, timeout or r.timeout)

    # -- phase 1 ----------------------------------------------------------------------------------
    def start(self, source: str, actors: int, workers: int, step: int) -> bool:
        """Decided after ``step``: start moving ``source`` to ``actors`` new actors of ``workers``
        threads (False: one is pending for it already, or the Planner closed)."""
        if source in self.pending or self._closed:
            log.info("source %r: resharding to %d loader actors decided after step %d waits: one is pending",
                     source, actors, step)
            return False
        job, r = self.job, self.job.recovery
        old = list(job.parts.by_source[source])
        base = merge_states([r.loader_state[key] for key in old])
        keys = part_keys(source, actors)
        # the other pending reshards' actors count where they will serve, not where they serve now
        retiring = old + [key for s in self.pending for key in job.parts.by_source[s]]
        cores = job.autoscaler.cores()          # only an active scaler's decisions start reshards
        busy = [(h, _actor_cores(cores, p.source, p.k)) for p in self.pending.values() for h in p.hosts.values()]
        each = _actor_cores(cores, source, actors)
        hosts = dict(zip(keys, _hosts(r, job.parts, actors, each, retiring, busy, cores)))
        names = {key: r.new_name(loader_actor(key)) for key in keys}
        a = r.policy.loader_args[source]
        args = {key: (a[0], a[1], workers, *a[3:], r.peers, (j, actors)) for j, key in enumerate(keys)}
        p = Pending(source, len(old), actors, workers, names, hosts, job.gen, step, time.perf_counter())
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="overlord-reshard")
        p.prepare = self._pool.submit(_prepare, p, r.peers, args, base, r.timeout)
        p.behind_from = step + 1
        self.pending[source] = p
        log.info("source %r: resharding from %d to %d loader actors decided after step %d; the old ones serve "
                 "until the new ones caught up", source, len(old), actors, step)
        return True

    # -- phases 2 and 3, at every step boundary ---------------------------------------------------
    def after_step(self, step: int, sampled: dict) -> None:
        """Step ``step`` was delivered: log what it took from each pending source, and move each
        pending reshard on (a round, the switch, or an abort)."""
        for source, p in list(self.pending.items()):
            p.log.append(list(sampled.get(source, [])))
            try:
                states = self._ready(p)
            except Exception as e:           # noqa: BLE001 - a new actor failed: the old ones go on
                self._abort(p, e, step)
                continue
            if states is not None:
                self._switch(p, states, step)

    def _ready(self, p: Pending) -> dict | None:
        """The new actors' states once they caught up with the last step (the last one replayed
        here, synchronously); None while they are not ready (a round launched or running)."""
        if not p.prepare.done():
            return None
        if p.round is None:
            p.round = p.prepare.result()     # raises what starting or loading raised
        if not all(f.done() for f in p.round.values()):
            return None
        for f in p.round.values():
            f.result()                       # raises what the last round raised
        todo, p.log = p.log, []
        p.behind_from += len(todo)
        if len(todo) > 1:                    # more than one step behind: another round
            p.rounds += 1
            p.round = {key: self._ref(name).catch_up(p.gen, todo, timeout=4 * self.job.timeout)
                       for key, name in p.names.items()}
            return None
        p.t_switch = time.perf_counter()
        futs = {key: self._ref(name).catch_up(p.gen, todo, timeout=2 * self.job.timeout)
                for key, name in p.names.items()}
        cf.wait(list(futs.values()), timeout=2 * self.job.timeout + 5)
        return {key: f.result(timeout=0) for key, f in futs.items()}

    def _switch(self, p: Pending, states: dict, step: int) -> None:
        """The new actors serve ``p.source`` from the next step; the old ones and their shadows retire."""
        job, r = self.job, self.job.recovery
        old = list(job.parts.by_source[p.source])
        for key in old:
            name, shadow = r.active.pop(key), r.shadows.names.pop(key, None)
            r.loader_state.pop(key, None)
            for a in (name, shadow):
                if a is not None:
                    self._ref(a).close()
        job.parts = job.parts.resized({p.source: p.k})
        r.active.update(p.names)
        r.loader_state.update(states)
        for key, name in p.names.items():
            if p.hosts[key] is not None:    # where it lives, for the clients (stats) and the other roles
                r.spares.where[name] = p.hosts[key]
            r.shadows.names[key] = None
            r.shadows.ensure(key)
        del self.pending[p.source]
        now = time.perf_counter()
        rec = {"source": p.source, "from": len(old), "to": p.k, "workers": p.workers, "ok": True, "step": step + 1,
               "decision_step": p.decision_step, "switch_step": step, "rounds": p.rounds,
               "seconds": round(now - p.t0, 4), "blocked_s": round(now - p.t_switch, 4),
               "where": {k: getattr(r.peers, "placement", {}).get(n) for k, n in p.names.items()}}
        job.reshards.append(rec)
        log.info("source %r: resharded from %d to %d loader actors (%d workers each) after step %d, decided after "
                 "step %d: %.3f s, %d catch-up rounds, the switch blocked %.3f s", p.source, len(old), p.k, p.workers,
                 step, p.decision_step, rec["seconds"], p.rounds, rec["blocked_s"])

    # -- aborts -----------------------------------------------------------------------------------
    def _abort(self, p: Pending, err: BaseException, step: int) -> None:
        """Give ``p`` up: its actors are closed (those still starting once started), the old ones go on."""
        self.pending.pop(p.source, None)
        p.cancelled.set()

        def close(_=None) -> None:
            for key in list(p.started):
                try:
                    p.closing.append(self._ref(p.names[key]).close())
                except Exception:            # noqa: BLE001 - the transport is gone: nothing left to close
                    pass

        p.prepare.add_done_callback(close)
        given_up = isinstance(err, Aborted)          # a new generation or the close: nothing failed
        log.log(logging.INFO if given_up else logging.WARNING, "source %r: resharding %d -> %d loader actors "
                "(decided after step %d) %s at step %d (%s); the old ones go on", p.source, p.old, p.k,
                p.decision_step, "was given up" if given_up else "failed", step, err)
        self.job.reshards.append({"source": p.source, "from": p.old, "to": p.k, "workers": p.workers, "ok": False,
                                  "step": step + 1, "decision_step": p.decision_step, "aborted_step": step,
                                  "error": f"{type(err).__name__}: {err}"})

    def abort_all(self, why: str, step: int) -> list[Pending]:
        """Give every pending reshard up (a new generation, or the Planner closing)."""
        gone = list(self.pending.values())
        for p in gone:
            self._abort(p, Aborted(why), step)
        return gone

    def close(self) -> None:
        """Abort every pending reshard, stop the executor, close the new actors (bounded)."""
        self._closed = True
        gone = self.abort_all("the job closed", self.job.step - 1)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)    # at most the actor being started
        cf.wait([f for p in gone for f in p.closing], timeout=self.job.timeout + 5)

    def stats(self) -> list[dict]:
        return [{"source": s, "from": p.old, "to": p.k, "decision_step": p.decision_step, "phase": p.phase(),
                 "behind_from": p.behind_from, "steps_behind": len(p.log)} for s, p in self.pending.items()]

    def wait(self, timeout: float) -> bool:
        """Wait (up to ``timeout`` s) until every pending reshard's started work is done (its actors
        started and loaded, its warm-up or catch-up round answered): its next step boundary then moves
        it on. For tests and benchmarks that must not depend on timing; True if all were done."""
        deadline = time.monotonic() + timeout
        for p in list(self.pending.values()):
            try:
                futs = p.prepare.result(max(0.0, deadline - time.monotonic())) if p.round is None else p.round
            except cf.TimeoutError:
                return False
            except Exception:                # noqa: BLE001 - the next boundary aborts it
                continue
            _, left = cf.wait(list(futs.values()), timeout=max(0.0, deadline - time.monotonic()))
            if left:
                return False
        return True
