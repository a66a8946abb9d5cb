"""The roles as actors of a disaggregated job, and the protocol of one step between them.

One step ``s`` (paper Fig. 5, the lazy workflow), driven by the Planner actor:

1. the Planner asks every Source Loader for its buffer ``metadata()`` (only ``BufferMeta`` travels);
2. it plans, then sends the Plan to every Data Constructor (one per DP group; bucket ``b`` is built
   by constructor ``b % n``) and asks every loader to ``deliver`` the step: the loader takes the
   planned samples and sends each constructor exactly the ones its buckets read (tensors go
   loader -> constructor directly, never through the Planner), then returns its new state;
3. each constructor builds its buckets in a background thread once the plan and every expected
   part arrived, and answers the clients' ``fetch(step, ranks)``.

Clients (trainer processes) ask the Planner to ``ensure(step)``: the reply routes each rank to its
constructor (or gives what a rank that receives nothing gets: a ``broadcast_at`` receiver fetches
nothing) and carries the job's state after that step (what a checkpoint of the consumed position
holds). Only the *leader* (client 0) makes the Planner plan: other clients wait for the leader's
request, so the leader's feedback, sent before its next request, always reaches the plan it is
meant for and the stream never depends on which client is fastest. A constructor drops a step once
every client has consumed it (clients report their consumed position with each request).

A *generation* counts resets (``attach`` with a state): a call from an older generation fails with
:class:`JobReset` instead of mixing two streams.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import copy
import logging
import os
import threading
import time
from typing import Callable, Mapping

import numpy as np

from ..errors import BufferShortageError, ConfigError, OverlordError
from ..plane.place_tree import ClientPlaceTree
from ..plane.plan import Plan
from ..plane.records import SampleKey
from ..roles.constructor import DataConstructor, bucket_inputs, receives_nothing
from ..roles.planner import Planner
from ..roles.source_loader import SourceLoader, record_bytes
from .local import LocalJob, SourceExhausted
from .procstats import listening_addresses, process_memory
from .transport import settle

__all__ = ["PlannerActor", "LoaderActor", "ConstructorActor", "JobReset", "JobClosed", "PLANNER", "loader_actor",
           "constructor_actor", "role_names"]

log = logging.getLogger("torchdata_overlord")
PLANNER = "planner"


def loader_actor(name: str) -> str:
    return f"loader:{name}"


def constructor_actor(c: int) -> str:
    return f"constructor:{c}"


def role_names(sources: list[str], constructors: int) -> list[str]:
    """Every actor of a job, in placement order: the Planner, the loaders, the constructors."""
    return [PLANNER] + [loader_actor(n) for n in sources] + [constructor_actor(c) for c in range(constructors)]


class JobReset(OverlordError, RuntimeError):
    """The job was reset (a client loaded a state) after this call's generation began."""


class JobClosed(OverlordError, RuntimeError):
    """The leader closed the job: requests still waiting are answered with this."""


def _fail_all(futs, exc: BaseException) -> None:
    for fut in futs:
        settle(fut, exc=exc)


def gather(futs: Mapping, timeout: float) -> dict:
    """Wait for every future (issued together), then their results, or raise the first error."""
    cf.wait(list(futs.values()), timeout=timeout + 5)
    return {k: f.result(timeout=1) for k, f in futs.items()}


class _Role:
    """What every role actor answers: its process, memory and listening sockets."""

    def process(self) -> dict:
        return {**process_memory(os.getpid()), "listening": listening_addresses(os.getpid())}


# ------------------------------------------------------------------------------------ Source Loader

class LoaderActor(_Role):
    """A SourceLoader that delivers each step's planned samples straight to the constructors."""

    def __init__(self, spec, buffer_size: int, workers: int, image_token_id: int | None, timeout: float, peers):
        self.loader = SourceLoader(spec.build(), buffer_size, workers, image_token_id)
        self.name, self.timeout, self.peers = spec.name, float(timeout), peers
        self.delivered = 0
        self.sent = {"samples": 0, "bytes": 0, "seconds": 0.0}   # to constructors: what and how long

    def metadata(self):
        return self.loader.metadata()

    def deliver(self, gen: int, step: int, indices: list, routes: Mapping[str, list]) -> dict:
        """Take ``indices`` (every sampled one, dropped ones too: consumed), send each constructor
        its part, and return this loader's state after the step."""
        recs = self.loader.take(indices) if indices else {}
        t0 = time.perf_counter()
        futs = {c: self.peers.call(c, "put", gen, step, self.name, {i: recs[i] for i in idx}, timeout=self.timeout)
                for c, idx in routes.items()}
        gather(futs, self.timeout)
        self.sent["seconds"] += time.perf_counter() - t0
        self.sent["samples"] += sum(len(idx) for idx in routes.values())
        self.sent["bytes"] += sum(record_bytes(recs[i]) for idx in routes.values() for i in idx)
        self.delivered += 1
        return self.loader.get_state()

    def exhausted(self) -> bool:
        return bool(self.loader.exhausted)

    def stats(self) -> dict:
        return {**self.loader.stats(), "steps_delivered": self.delivered, "sent": dict(self.sent)}

    def get_state(self) -> dict:
        return self.loader.get_state()

    def reset(self, state: dict) -> None:
        self.loader.reset(state)

    def close(self) -> None:
        self.loader.close()


# ------------------------------------------------------------------------------------ Data Constructor

class _Work:
    """One step at one constructor: the plan, the parts still expected, and who waits for it."""

    def __init__(self):
        self.plan: Plan | None = None
        self.buckets: list[int] = []
        self.expected: set[str] | None = None
        self.samples: dict = {}
        self.samples_from: set[str] = set()
        self.outputs: dict | None = None
        self.error: BaseException | None = None
        self.waiters: list[tuple[list, cf.Future]] = []
        self.building = False


class ConstructorActor(_Role):
    """A Data Constructor serving the buckets ``b`` with ``b % n == index`` of every step."""

    def __init__(self, index: int, seq_len, pad_id: int, ignore_index: int, image_token_id):
        self.index = index
        self.constructor = DataConstructor(seq_len, pad_id=pad_id, ignore_index=ignore_index,
                                           image_token_id=image_token_id)
        self.gen, self.released, self.built = 0, 0, 0
        self.steps: dict[int, _Work] = {}
        self.lock = threading.Lock()
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix=f"overlord-build-{index}")

    def _work(self, gen: int, step: int) -> _Work | None:
        if gen != self.gen or step < self.released:
            return None
        return self.steps.setdefault(step, _Work())

    def reset(self, gen: int) -> None:
        with self.lock:
            old, self.steps = self.steps, {}
            self.gen, self.released = gen, 0
        _fail_all([fut for w in old.values() for _, fut in w.waiters],
                  JobReset(f"the job was reset to generation {gen}; call iter() again"))

    def plan(self, gen: int, step: int, plan: Plan, buckets: list[int], expected: list[str]) -> None:
        with self.lock:
            w = self._work(gen, step)
            if w is None:
                return
            w.plan, w.buckets, w.expected = plan, list(buckets), set(expected) - w.samples_from
            self._maybe_build(step, w)

    def put(self, gen: int, step: int, source: str, records: Mapping[int, object]) -> None:
        with self.lock:
            w = self._work(gen, step)
            if w is None:
                return
            w.samples.update({SampleKey(source, int(i)): r for i, r in records.items()})
            w.samples_from.add(source)
            if w.expected is not None:
                w.expected.discard(source)
            self._maybe_build(step, w)

    def _maybe_build(self, step: int, w: _Work) -> None:
        if w.plan is not None and not w.expected and not w.building:
            w.building = True
            self.pool.submit(self._build, step, w)

    def _build(self, step: int, w: _Work) -> None:
        try:
            outputs = {}
            for b in w.buckets:
                outputs.update(self.constructor.build(w.plan, b, w.samples))
            err = None
        except BaseException as e:         # noqa: BLE001 - delivered to every fetch of this step
            outputs, err = None, e
        with self.lock:
            w.outputs, w.error, w.samples, w.plan = outputs, err, {}, None
            waiters, w.waiters = w.waiters, []
            self.built += 1
        for ranks, fut in waiters:
            self._answer(w, ranks, fut)

    @staticmethod
    def _answer(w: _Work, ranks: list, fut: cf.Future) -> None:
        if w.error is not None:
            settle(fut, exc=w.error)
            return
        missing = [r for r in ranks if r not in w.outputs]
        if missing:
            settle(fut, exc=ConfigError(f"ranks {missing} are not in this constructor's buckets"))
        else:
            settle(fut, {r: w.outputs[r] for r in ranks})

    def fetch(self, gen: int, step: int, ranks: list) -> cf.Future:
        """What ``ranks`` receive at ``step``: answered once the step is built."""
        fut: cf.Future = cf.Future()
        with self.lock:
            if gen != self.gen:
                settle(fut, exc=JobReset(f"fetch of step {step} belongs to generation {gen}, the job is at "
                                         f"{self.gen}; call iter() again"))
                return fut
            if step < self.released:
                settle(fut, exc=ConfigError(f"step {step} was released: every client had consumed it"))
                return fut
            w = self.steps.setdefault(step, _Work())
            if w.outputs is None and w.error is None:
                w.waiters.append((list(ranks), fut))
                return fut
        self._answer(w, ranks, fut)
        return fut

    def release(self, gen: int, below: int) -> None:
        """Forget every step before ``below`` (every client consumed them)."""
        with self.lock:
            if gen != self.gen:
                return
            self.released = max(self.released, below)
            for s in [s for s in self.steps if s < below]:
                del self.steps[s]

    def stats(self) -> dict:
        with self.lock:
            return {"steps_held": len(self.steps), "steps_built": self.built,
                    "waiting_fetches": sum(len(w.waiters) for w in self.steps.values()),
                    "staged_samples": sum(len(w.samples) for w in self.steps.values())}

    def close(self) -> None:
        with self.lock:
            waiting = [fut for w in self.steps.values() for _, fut in w.waiters]
            self.steps = {}
        _fail_all(waiting, JobClosed("the job was closed by client 0 (the leader)"))
        self.pool.shutdown(wait=False, cancel_futures=True)




# ------------------------------------------------------------------------------------ Planner

class PlannerActor(_Role):
    """The central Planner, driving each step for the leader client (see the module docstring)."""

    LEADER = 0

    def __init__(self, strategy: Callable, mesh: ClientPlaceTree, global_batch: int, seed: int, sources: list[str],
                 constructors: int, clients: int, timeout: float, peers):
        self.planner = Planner(strategy, mesh, global_batch, seed=seed)
        self.mesh, self.sources, self.n = mesh, list(sources), int(constructors)
        self.clients, self.timeout, self.peers = int(clients), float(timeout), peers
        self.gen = 0
        self.feedback: list[list] = []                 # [step, values] not planned yet
        self.history: dict[int, dict] = {}             # step -> reply (routing, state, plan)
        self.waiting: dict[int, list] = collections.defaultdict(list)
        self.consumed: dict[int, int] = {}             # client -> steps it consumed
        self.released = 0
        self.failed: tuple[int, BaseException] | None = None
        self.leader_starts: list[tuple[int, int]] = []  # (generation, start step) of each leader attach
        self.attaches: dict[int, int] = collections.defaultdict(int)
        self.attach_waiting: list[tuple[int, int, int, cf.Future]] = []
        self.planned_steps = 0

    def _call(self, actor: str, method: str, *args) -> cf.Future:
        return self.peers.call(actor, method, *args, timeout=self.timeout)

    def _on_loaders(self, method: str, args: Mapping[str, tuple] | None = None) -> dict:
        return gather({n: self._call(loader_actor(n), method, *((args or {}).get(n, ()))) for n in self.sources},
                      self.timeout)

    def _on_constructors(self, method: str, *args) -> dict:
        return gather({c: self._call(constructor_actor(c), method, *args) for c in range(self.n)}, self.timeout)

    # -- clients ------------------------------------------------------------------------------
    def attach(self, client: int, state: dict | None, step: int) -> dict | cf.Future:
        """Start (or restart) a client at consumed ``step``. The leader's ``state`` (None: keep the
        current one) resets every role; the others must start where the leader did."""
        self.attaches[client] += 1
        if client == self.LEADER:
            if state is not None:
                self._reset(state)
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

    def _reset(self, state: Mapping) -> None:
        self.planner.load_state_dict(state[LocalJob.PLANNER])
        if set(state[LocalJob.LOADERS]) != set(self.sources):
            raise ConfigError(f"state has sources {sorted(state[LocalJob.LOADERS])}, this job has {sorted(self.sources)}")
        self.gen += 1
        self._on_loaders("reset", {n: (state[LocalJob.LOADERS][n],) for n in self.sources})
        self._on_constructors("reset", self.gen)
        self.feedback = [[int(s), dict(v)] for s, v in state.get(LocalJob.FEEDBACK, [])]
        _fail_all([fut for futs in self.waiting.values() for fut, _ in futs],
                  JobReset(f"the job was reset to generation {self.gen}; call iter() again"))
        self.history, self.waiting, self.consumed = {}, collections.defaultdict(list), {}
        self.released, self.failed = self.planner.step, None

    def add_feedback(self, step: int, values: Mapping[str, float]) -> None:
        if step < self.planner.step:
            raise ConfigError(f"feedback for step {step} comes too late: step {self.planner.step} is next to plan")
        self.feedback.append([int(step), {str(k): float(v) for k, v in values.items()}])

    def ensure(self, client: int, gen: int, step: int, consumed: int, with_plan: bool = False) -> dict | cf.Future:
        """The reply for ``step`` (routing per rank, state after the step, the plan if asked), once
        the leader asked for it; the leader's request plans every step up to it."""
        if gen != self.gen:
            raise JobReset(f"client {client} asks for step {step} of generation {gen}; the job is at generation "
                           f"{self.gen} (a client loaded a state): call iter() again")
        self.consumed[client] = max(self.consumed.get(client, 0), int(consumed))
        self._release()
        if client == self.LEADER:
            while self.planner.step <= step and self.failed is None:
                self._plan_one()
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
                "plan": h["plan"] if with_plan else None}

    def _release(self) -> None:
        below = min(self.consumed.get(c, self.released) for c in range(self.clients))
        if below <= self.released:
            return
        self.released = below
        for s in [s for s in self.history if s < below]:
            del self.history[s]
        for c in range(self.n):             # answered in order before any later plan of this constructor
            self._call(constructor_actor(c), "release", self.gen, below)

    # -- one step ---------------------------------------------------------------------------------
    def _plan_one(self) -> None:
        step = self.planner.step
        try:
            metas = self._on_loaders("metadata")
            due = [v for s, v in self.feedback if s == step]
            try:
                plan = self.planner.plan([metas[n] for n in self.sources], feedback=due)
            except BufferShortageError as e:
                done = [n for n, ex in self._on_loaders("exhausted").items() if ex]
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
        for fut, with_plan in self.waiting.pop(step, []):
            settle(fut, self._reply(step, with_plan))

    def _dispatch(self, step: int, plan: Plan) -> None:
        n = self.n
        buckets = {c: [b for b in range(len(plan.buckets)) if b % n == c] for c in range(n)}
        routes: dict[str, dict[str, list]] = {s: {} for s in self.sources}
        expected: dict[int, list] = {}
        for c, bs in buckets.items():
            need: dict[str, set] = {}
            for b in bs:
                for src, idx in bucket_inputs(plan, b).items():
                    need.setdefault(src, set()).update(idx)
            expected[c] = sorted(need)
            for src, idx in need.items():
                routes[src][constructor_actor(c)] = sorted(idx)
        recs = plan.records
        sampled = {name: np.asarray(recs.index[recs.source_id == sid]).tolist() for sid, name in enumerate(recs.sources)}
        plans = {c: self._call(constructor_actor(c), "plan", self.gen, step, plan, buckets[c], expected[c])
                 for c in range(n)}
        states = gather({s: self._call(loader_actor(s), "deliver", self.gen, step, sampled.get(s, []), routes[s])
                         for s in self.sources}, self.timeout)
        gather(plans, self.timeout)
        routing, empty = [], {}
        for r in range(self.mesh.world_size):        # ranks that receive nothing are answered here
            nothing, value = receives_nothing(plan, r)
            routing.append(-1 if nothing else plan.bucket_of(r) % n)
            if nothing:
                empty[r] = value
        state = {LocalJob.PLANNER: self.planner.state_dict(), LocalJob.LOADERS: states,
                 LocalJob.FEEDBACK: copy.deepcopy(self.feedback)}
        self.history[step] = {"routing": routing, "empty": empty, "state": state, "plan": plan}
        self.planned_steps += 1

    # -- state and stats ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The job's state at the current planned position (LocalJob's format)."""
        return {LocalJob.PLANNER: self.planner.state_dict(), LocalJob.LOADERS: self._on_loaders("get_state"),
                LocalJob.FEEDBACK: copy.deepcopy(self.feedback)}

    def close(self) -> None:
        """Answer every waiting request (the leader is leaving: nothing more will be planned)."""
        exc = JobClosed("the job was closed by client 0 (the leader): no more steps are planned")
        _fail_all([fut for futs in self.waiting.values() for fut, _ in futs], exc)
        _fail_all([item[3] for item in self.attach_waiting], exc)
        self.waiting, self.attach_waiting = collections.defaultdict(list), []

    def stats(self) -> dict:
        return {"generation": self.gen, "next_step": self.planner.step, "released_below": self.released,
                "steps_held": len(self.history), "waiting_requests": sum(len(v) for v in self.waiting.values()),
                "consumed": dict(self.consumed), "pending_feedback": len(self.feedback)}
