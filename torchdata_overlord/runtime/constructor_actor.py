"""The Data Constructor actor: the trainer's only door to the data plane (the paper's lazy order).

A client asks its constructor for a step (``fetch``); the leader client's request is the one that
makes the constructor ask the Planner to plan it (``advance``, once per step, never once per
client), with the leader's feedback. The Planner orders the loaders to ``put`` the planned samples
straight to the constructors, then ``commit``\\ s the plan and the job's state after the step to
every constructor. A constructor serves the buckets ``b`` with ``b % n == index`` and builds a
bucket only once a client asks for one of its ranks (so a trainer process that runs every
role in-process builds only its own rank's bucket); a rank of another constructor's bucket is
fetched from that constructor on the client's behalf, and the answer names the right constructor
(``routing``) so the client asks it directly from then on.

Its durable state is the position every client has consumed (``released``), checkpointed when it
moves; what it holds beyond that (staged samples, built buckets) is rebuilt by a rewind.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Mapping

from ..errors import ConfigError
from ..plane.plan import Plan
from ..plane.records import make_key
from ..roles.constructor import DataConstructor, receives_nothing
from .refs import PLANNER, ConstructorRef, PlannerRef
from .role import RoleActor, fail_all
from .step import JobClosed, JobReset
from .transport import settle

__all__ = ["ConstructorActor"]


_BUILD_STOP_WAIT = 5.0  # s close() waits for a build under way
_START = object()      # marks work _progress decided (a build, a forward) in the list it returns: started after the lock


class _Waiter:
    """One fetch until it is answered: its ranks, and what other constructors answered for it."""

    def __init__(self, ranks: list, fut: cf.Future, with_plan: bool):
        self.ranks, self.fut, self.with_plan = list(ranks), fut, with_plan
        self.forwarded: dict | None = None      # rank -> output fetched from another constructor
        self.forwarding = False


class _Work:
    """One step at one constructor: the parts delivered, the plan and state once committed, the built
    buckets, who waits."""

    def __init__(self):
        self.plan: Plan | None = None
        self.buckets: list[int] = []
        self.names: dict = {}
        self.samples: dict = {}
        self.samples_from: set[str] = set()
        self.outputs: dict[int, dict] = {}           # bucket -> {rank: output}
        self.errors: dict[int, BaseException] = {}
        self.building: set[int] = set()
        self.state: dict | None = None
        self.delayed = False
        self.triggered = False
        self.waiters: list[_Waiter] = []

    def unasked(self) -> bool:
        """Neither planned nor asked for by the leader: once the leader has left, never planned."""
        return self.plan is None and not self.triggered


class ConstructorActor(RoleActor):
    """``ConstructorActor(index, seq_len, pad_id, ignore_index, image_token_id, peers, timeout, store=None)``."""

    #: Short, no I/O, never waiting on another actor (builds and forwards start elsewhere): a lane's
    #: reader thread that receives one of these calls may run it itself (``_rpc_worker.dispatch``).
    QUICK_METHODS = frozenset({"put", "commit", "fail", "fetch"})

    def __init__(self, index: int, seq_len, pad_id: int, ignore_index: int, image_token_id, peers, timeout: float,
                 store=None, build_thread: bool = True):
        self.index, self.peers, self.timeout, self.store = index, peers, float(timeout), store
        self.constructor = DataConstructor(seq_len, pad_id=pad_id, ignore_index=ignore_index,
                                           image_token_id=image_token_id)
        self.gen, self.released, self.built, self.buckets_built = 0, 0, 0, 0
        self.planner = PLANNER
        self.failed: tuple[int, BaseException] | None = None
        self.consumed: dict[int, int] = {}          # client -> steps it consumed (reported with its fetches)
        self.steps: dict[int, _Work] = {}
        self.leader_gone: str | None = None         # why no more steps will be planned (the leader left)
        self.lock = threading.Lock()
        # builds run on a thread of their own (the actor keeps taking parts meanwhile), or, with
        # build_thread=False (every role in one process), in the commit, on the Planner's thread
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix=f"overlord-build-{index}") if build_thread else None

    def _work(self, gen: int, step: int) -> _Work | None:
        if gen != self.gen or step < self.released:
            return None
        return self.steps.setdefault(step, _Work())

    # -- from the Planner ---------------------------------------------------------------------
    def new_generation(self, gen: int, planner: str = PLANNER, where: Mapping[str, str] | None = None) -> None:
        """A new generation (a loaded state, or a rewind after a failure): forget every step."""
        if where:
            self.peers.learn(dict(where))
        with self.lock:
            old, self.steps = self.steps, {}
            self.gen, self.released, self.failed, self.planner = gen, 0, None, planner
            self.leader_gone = None
            self.consumed = {}
        fail_all([w.fut for work in old.values() for w in work.waiters],
                 JobReset(f"the job was reset to generation {gen}; call iter() again"))

    def put(self, gen: int, step: int, source: str, records: Mapping[int, object], loader: str | None = None) -> None:
        """What one Source Loader (``loader``: its key, one of the source's data-parallel parts; default
        the source) sends of ``step``: the samples this constructor's buckets need from it."""
        loader = source if loader is None else loader
        with self.lock:
            w = self._work(gen, step)
            if w is None or loader in w.samples_from:      # a promoted loader re-sending a part that arrived
                return
            w.samples.update({make_key((source, int(i))): r for i, r in records.items()})
            w.samples_from.add(loader)

    def commit(self, gen: int, step: int, plan: Plan, buckets: list[int], state: dict, info: dict) -> dict:
        """``step`` is delivered (every part is in): its plan, the buckets this constructor builds and
        the job's state after it (what a checkpoint taken after it holds); ``info`` names the
        constructors, where replaced roles live and whether a failure ``delayed`` the step. Answers
        with the consumed position of every client this constructor has heard from."""
        if info.get("where"):
            self.peers.learn(dict(info["where"]))
        with self.lock:
            w = self._work(gen, step)
            if w is not None:
                w.plan, w.buckets, w.names = plan, list(buckets), dict(info)
                w.state, w.delayed = state, bool(info.get("delayed"))
                todo = self._progress(step, w)
            else:
                todo = []
            consumed = dict(self.consumed)
        self._settle(todo)
        return consumed

    def fail(self, gen: int, step: int, error: BaseException) -> None:
        """``step`` cannot be planned (a source ran out, a role is lost...): it and every later fetch fail."""
        with self.lock:
            if gen != self.gen:
                return
            if self.failed is None or step < self.failed[0]:
                self.failed = (step, error)
            futs = [w.fut for s, work in self.steps.items() if s >= step for w in work.waiters]
            for s, work in self.steps.items():
                if s >= step:
                    work.waiters = []
        fail_all(futs, error)

    def leader_left(self, gen: int, reason: str) -> None:
        """The leader client closed: a step it has not asked for will never be planned, so the fetches waiting
        for one, and later ones, are answered with ``JobClosed(reason)`` now (not after a timeout); the steps it
        asked for are still served."""
        with self.lock:
            if gen != self.gen:
                return
            self.leader_gone = str(reason)
            futs = []
            for work in self.steps.values():
                if work.unasked():
                    futs += [w.fut for w in work.waiters]
                    work.waiters = []
        fail_all(futs, JobClosed(self.leader_gone))

    def release(self, gen: int, below: int) -> None:
        """Forget every step before ``below`` (every client consumed them)."""
        with self.lock:
            if gen != self.gen:
                return
            self.released = max(self.released, below)
            for s in [s for s in self.steps if s < below]:
                del self.steps[s]
        if self.store is not None:          # where the clients are: a replacement resumes from here
            key = f"constructor/{self.index}"
            self.store.put(key, below, {"released": below, "generation": gen})
            self.store.gc(key, keep=2)      # the newest (and the one before, should it be torn) is all it reads

    # -- from the clients ---------------------------------------------------------------------
    def fetch(self, gen: int, step: int, ranks: list, client: int | None, consumed: int, lead: bool = False,
              feedback: list = (), with_plan: bool = False) -> cf.Future:
        """What ``ranks`` receive at ``step``, once it is planned, built and committed. ``lead``: the
        leader client's request, which makes the Planner plan the step (with ``feedback``)."""
        fut: cf.Future = cf.Future()
        with self.lock:
            err = self._refuse(gen, step)
            known = self.steps.get(step)
            if err is None and self.leader_gone is not None and not lead and (known is None or known.unasked()):
                err = JobClosed(self.leader_gone)
            if err is not None:
                settle(fut, exc=err)
                return fut
            if client is not None:
                self.consumed[client] = max(self.consumed.get(client, 0), int(consumed))
            w = self.steps.setdefault(step, _Work())
            w.waiters.append(_Waiter(ranks, fut, with_plan))
            trigger = lead and not w.triggered and w.plan is None
            w.triggered = w.triggered or lead
            planner = self.planner
            todo = self._progress(step, w)
        self._settle(todo)
        if trigger:
            asked = PlannerRef(self.peers, planner, self.timeout).advance(gen, step, feedback, timeout=4 * self.timeout)
            asked.add_done_callback(lambda f: f.exception() is not None and self.fail(gen, step, f.exception()))
        return fut

    def _refuse(self, gen: int, step: int) -> BaseException | None:
        if gen != self.gen:
            return JobReset(f"fetch of step {step} belongs to generation {gen}, the job is at {self.gen}; call "
                            f"iter() again")
        if self.failed is not None and step >= self.failed[0]:
            return self.failed[1]
        if step < self.released:
            return ConfigError(f"step {step} was released: every client had consumed it")
        return None

    # -- building and answering (under the lock; futures are settled after it) ----------------
    def _progress(self, step: int, w: _Work) -> list:
        """Start what the waiting fetches need; return the (future, result, error) to settle."""
        if w.plan is None:
            return []
        n, done = len(w.names.get("constructors", [])) or 1, []
        for waiter in list(w.waiters):
            foreign: dict[int, list] = {}
            ready = True
            for r in waiter.ranks:
                if receives_nothing(w.plan, r)[0]:
                    continue
                b = w.plan.bucket_of(r)
                if b not in w.buckets:
                    foreign.setdefault(b % n, []).append(r)
                elif b in w.errors:
                    w.waiters.remove(waiter)
                    done.append((waiter.fut, None, w.errors[b]))
                    ready = None
                    break
                elif b not in w.outputs:
                    ready = False
                    if b not in w.building:
                        w.building.add(b)
                        done.append((self._build, (step, w, b), _START))
            if ready is None:
                continue
            if foreign and waiter.forwarded is None:
                ready = False
                if not waiter.forwarding:
                    waiter.forwarding = True
                    done.append((self._forward, (step, w, waiter, foreign), _START))
            if ready:
                w.waiters.remove(waiter)
                done.append((waiter.fut, self._answer(w, waiter, n), None))
        if len(w.outputs) + len(w.errors) == len(w.buckets) and w.samples:
            w.samples = {}                  # every bucket of this constructor is built
        return done

    def _answer(self, w: _Work, waiter: _Waiter, n: int) -> dict:
        outputs, routing = {}, {}
        for r in waiter.ranks:
            nothing, value = receives_nothing(w.plan, r)
            b = w.plan.bucket_of(r)
            routing[r] = -1 if nothing else b % n
            outputs[r] = value if nothing else (w.outputs[b][r] if b in w.outputs else waiter.forwarded[r])
        return {"outputs": outputs, "routing": routing, "state": w.state, "delayed": w.delayed,
                "released": self.released, "plan": w.plan if waiter.with_plan else None}

    def _forward(self, step: int, w: _Work, waiter: _Waiter, foreign: dict[int, list]) -> None:
        """Fetch the ranks of other constructors' buckets for ``waiter`` (a client that asked the
        wrong constructor learns the right one from the answer's routing)."""
        gen, names = self.gen, w.names["constructors"]
        parts = [ConstructorRef(self.peers, names[c], self.timeout).fetch(gen, step, rs, None, 0,
                                                                          timeout=4 * self.timeout)
                 for c, rs in foreign.items()]

        def arrived(_):
            if not all(p.done() for p in parts):
                return
            errors = [p.exception() for p in parts if p.exception() is not None]
            with self.lock:
                if errors:
                    if waiter in w.waiters:
                        w.waiters.remove(waiter)
                    todo = [(waiter.fut, None, errors[0])]
                else:
                    waiter.forwarded = {r: out for p in parts for r, out in p.result()["outputs"].items()}
                    todo = self._progress(step, w)
            self._settle(todo)

        for p in parts:
            p.add_done_callback(arrived)

    def _build(self, step: int, w: _Work, b: int) -> None:
        try:
            out, err = self.constructor.build(w.plan, b, w.samples), None
        except BaseException as e:         # noqa: BLE001 - delivered to every fetch of this bucket
            out, err = None, e
        with self.lock:
            w.building.discard(b)
            if err is None:
                w.outputs[b] = out
            else:
                w.errors[b] = err
            self.built += len(w.outputs) + len(w.errors) == 1
            self.buckets_built += 1
            todo = self._progress(step, w)
        self._settle(todo)

    def _settle(self, todo: list) -> None:
        """Answer the futures ``_progress`` settled, and start the builds and forwards it decided
        (outside the lock: a forward that fails at once, a build inline, take it again)."""
        for fut, result, exc in todo:
            if exc is _START:
                if fut == self._build and self.pool is not None:
                    self.pool.submit(fut, *result)
                else:
                    fut(*result)
            else:
                settle(fut, result, exc)

    # -- diagnostics and recovery -------------------------------------------------------------
    def stats(self) -> dict:
        with self.lock:
            return {"steps_held": len(self.steps), "steps_built": self.built, "buckets_built": self.buckets_built,
                    "waiting_fetches": sum(len(w.waiters) for w in self.steps.values()),
                    "staged_samples": sum(len(w.samples) for w in self.steps.values())}

    def resume_point(self) -> int | None:
        """The consumed position the predecessor of this constructor checkpointed (None: none)."""
        got = self.store.latest(f"constructor/{self.index}") if self.store is not None else None
        return None if got is None else int(got[1]["released"])

    def close(self) -> None:
        with self.lock:
            waiting = [w.fut for work in self.steps.values() for w in work.waiters]
            self.steps = {}
        fail_all(waiting, JobClosed("the job was closed by client 0 (the leader)"))
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            # a build already running ends on its own (it takes no lock this holds): wait for it, bounded, so
            # that a closed constructor leaves no thread behind
            deadline = time.monotonic() + _BUILD_STOP_WAIT
            for t in list(getattr(self.pool, "_threads", ())):
                if t is not threading.current_thread():
                    t.join(max(0.0, deadline - time.monotonic()))
