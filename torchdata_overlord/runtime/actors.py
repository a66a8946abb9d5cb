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

import concurrent.futures as cf
import logging
import os
import threading
import time
from typing import Mapping

from ..errors import ConfigError, OverlordError
from ..plane.plan import Plan
from ..plane.records import SampleKey
from ..roles.constructor import DataConstructor
from ..roles.source_loader import SourceLoader, record_bytes
from .procstats import listening_addresses, process_memory
from .transport import settle

__all__ = ["LoaderActor", "ConstructorActor", "JobReset", "JobClosed", "PLANNER", "loader_actor", "shadow_actor",
           "constructor_actor", "role_names"]

log = logging.getLogger("torchdata_overlord")
PLANNER = "planner"


def loader_actor(name: str) -> str:
    return f"loader:{name}"


def shadow_actor(name: str) -> str:
    return f"shadow:{name}"


def constructor_actor(c: int) -> str:
    return f"constructor:{c}"


def role_names(sources: list[str], constructors: int, shadows: bool = False) -> list[str]:
    """Every actor of a job, in placement order: the Planner, the loaders, the constructors, the shadows."""
    return ([PLANNER] + [loader_actor(n) for n in sources] + [constructor_actor(c) for c in range(constructors)]
            + ([shadow_actor(n) for n in sources] if shadows else []))


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
    """A SourceLoader that delivers each step's planned samples straight to the constructors.

    Fault tolerance: every ``snapshot_every`` steps it writes its state to the checkpoint store
    (``loader/<source>`` at version = steps delivered); between snapshots the Planner's per-step
    checkpoints log what each step took, so :meth:`restore` rebuilds the state at any version from
    the last snapshot plus a replay. A *shadow* is the same actor kept idle: it is told the
    primary's state after every step (:meth:`follow`) and :meth:`promote` makes it the primary.
    Calls from an older generation (a frozen Planner that woke up) are refused.
    """

    def __init__(self, spec, buffer_size: int, workers: int, image_token_id: int | None, timeout: float, peers,
                 store=None, snapshot_every: int = 0):
        self.loader = SourceLoader(spec.build(), buffer_size, workers, image_token_id)
        self.name, self.timeout, self.peers = spec.name, float(timeout), peers
        self.store, self.snapshot_every = store, int(snapshot_every)
        self.gen, self.delivered, self.snapshots = 0, 0, 0
        self.followed: tuple[int, dict] | None = None        # (version, state) of the primary, when a shadow
        self.sent = {"samples": 0, "bytes": 0, "seconds": 0.0}   # to constructors: what and how long

    def _check_gen(self, gen: int) -> None:
        if gen < self.gen:
            raise JobReset(f"loader {self.name!r}: a call of generation {gen}, the job is at {self.gen}")

    def warm(self) -> int:
        """Open the source and fill the first buffer (at start-up, under the start-up timeout, so the
        first step's calls are not mistaken for a frozen loader); returns the samples buffered."""
        self.loader.fill()
        return self.loader.stats()["buffered"]

    def metadata(self):
        return self.loader.metadata()

    def deliver(self, gen: int, step: int, indices: list, routes: Mapping[str, list],
                where: Mapping[str, str] | None = None) -> dict:
        """Take ``indices`` (every sampled one, dropped ones too: consumed), send each constructor
        its part, and return this loader's state after the step."""
        self._check_gen(gen)
        if where:
            self.peers.learn(dict(where))
        self.loader.fill()                  # a promoted or restored loader starts with an empty buffer
        recs = self.loader.take(indices) if indices else {}
        t0 = time.perf_counter()
        futs = {c: self.peers.call(c, "put", gen, step, self.name, {i: recs[i] for i in idx}, timeout=self.timeout)
                for c, idx in routes.items()}
        gather(futs, self.timeout)
        self.sent["seconds"] += time.perf_counter() - t0
        self.sent["samples"] += sum(len(idx) for idx in routes.values())
        self.sent["bytes"] += sum(record_bytes(recs[i]) for idx in routes.values() for i in idx)
        self.delivered += 1
        state = self.loader.get_state()
        version = step + 1
        if self.store is not None and self.snapshot_every and version % self.snapshot_every == 0:
            self.store.put(f"loader/{self.name}", version, state)
            self.snapshots += 1
        return state

    # -- standby and recovery ------------------------------------------------------------------
    def follow(self, version: int, state: dict) -> None:
        """A shadow keeps the primary's latest state (cheap: a few numbers, no reading). The first
        time, it also reads a buffer's worth at that state, so its files are open, its row group
        decoded and its transform loaded: a promotion then only re-reads one buffer."""
        first = self.followed is None
        self.followed = (int(version), state)
        if first:
            self.loader.reset(state)
            self.loader.fill()
            self.loader.reset(state)         # keep the warm source, not the buffered samples

    def promote(self, gen: int, state: dict) -> dict:
        """Become the primary at ``state`` (the state after the last completed step)."""
        self.gen = gen
        self.loader.reset(state)
        return self.loader.get_state()

    def restore(self, gen: int, snapshot: dict, consumed: list) -> dict:
        """Differential restore: ``snapshot`` plus a replay of the steps' consumption since."""
        self.gen = gen
        return self.loader.replay(snapshot, consumed)

    def exhausted(self) -> bool:
        return bool(self.loader.exhausted)

    def stats(self) -> dict:
        return {**self.loader.stats(), "steps_delivered": self.delivered, "sent": dict(self.sent),
                "snapshots": self.snapshots}

    def get_state(self) -> dict:
        return self.loader.get_state()

    def reset(self, state: dict, gen: int | None = None) -> None:
        if gen is not None:
            self.gen = gen
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
    """A Data Constructor serving the buckets ``b`` with ``b % n == index`` of every step.

    Its durable state is the position every client has consumed (``released``), checkpointed when
    it moves; what it holds beyond that (staged samples, built steps) is rebuilt by a rewind."""

    def __init__(self, index: int, seq_len, pad_id: int, ignore_index: int, image_token_id, store=None):
        self.index, self.store = index, store
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
            if w is None or w.building:       # a promoted loader re-sending a part that already arrived
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
        if self.store is not None:          # where the clients are: a replacement resumes from here
            self.store.put(f"constructor/{self.index}", below, {"released": below, "generation": gen})

    def stats(self) -> dict:
        with self.lock:
            return {"steps_held": len(self.steps), "steps_built": self.built,
                    "waiting_fetches": sum(len(w.waiters) for w in self.steps.values()),
                    "staged_samples": sum(len(w.samples) for w in self.steps.values())}

    def resume_point(self) -> int | None:
        """The consumed position the predecessor of this constructor checkpointed (None: none)."""
        got = self.store.latest(f"constructor/{self.index}") if self.store is not None else None
        return None if got is None else int(got[1]["released"])

    def close(self) -> None:
        with self.lock:
            waiting = [fut for w in self.steps.values() for _, fut in w.waiters]
            self.steps = {}
        _fail_all(waiting, JobClosed("the job was closed by client 0 (the leader)"))
        self.pool.shutdown(wait=False, cancel_futures=True)
