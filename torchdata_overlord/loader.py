"""OverlordLoader: the trainer's drop-in ``DataLoader`` replacement (the paper's client).

Iterating yields, per training step, what this rank receives: its microbatches as dicts of
tensors (or metadata only, or nothing, as the plan says). A background thread prefetches
``prefetch`` steps (``prefetch=0``: no thread, each ``next()`` builds its own step). ``state_dict()`` describes what the trainer has *consumed*, not what was
prefetched, holds only plain Python types, is cheap and side-effect free; ``load_state_dict()``
copies its input and applies it at the next ``iter()``, which continues with exactly the steps
an uninterrupted run would have produced.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import copy
import json
import logging
import queue
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from .errors import ConfigError, OverlordError
from .plane.place_tree import ClientPlaceTree
from .runtime.local import LocalJob, SourceExhausted
from .runtime.rpc_job import RpcJob

__all__ = ["OverlordLoader", "FaultTolerance"]

log = logging.getLogger("torchdata_overlord")
RUNTIMES = {"local": LocalJob, "rpc": RpcJob}


def _pin(x):
    if isinstance(x, torch.Tensor):
        return x.pin_memory()
    if isinstance(x, dict):
        return {k: _pin(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_pin(v) for v in x]
    return x


@dataclass
class FaultTolerance:
    """Keep feeding through failed roles (``runtime="rpc"``, paper section 6.1).

    ``checkpoint_dir`` (a path or ``pyarrow.fs`` URI) receives the Planner's checkpoint every step
    and each Source Loader's snapshot every ``snapshot_every`` steps; ``shadows`` starts a standby
    loader per source; a role that does not answer within ``call_timeout`` seconds counts as failed;
    a step not delivered within ``recovery_timeout`` seconds of a failure raises in ``next()``.
    Replacements start on the loader's ``spares`` processes."""

    checkpoint_dir: str | None = None
    shadows: bool = True
    snapshot_every: int = 10
    call_timeout: float = 30.0
    recovery_timeout: float = 120.0

    def job_options(self) -> dict:
        return {"checkpoint_dir": self.checkpoint_dir, "shadows": self.shadows, "snapshot_every": self.snapshot_every,
                "timeout": self.call_timeout, "recovery_timeout": self.recovery_timeout}


class OverlordLoader:
    """``OverlordLoader(sources, strategy, mesh, rank, global_batch, seq_len, runtime="local", ...)``.

    ``rank=None`` simulates every rank of the mesh in this process: each item is then
    ``{rank: item}``. ``runtime="local"`` runs every role in this process; ``runtime="rpc"`` runs
    the Planner, each Source Loader and one Data Constructor per DP group (``constructors=``) as
    actors in worker processes over ``torch.distributed.rpc`` (one process per role, or
    ``n_workers``), on loopback, started by this process; with ``group=`` (a ``torch.distributed``
    process group, or ``"default"``) every trainer process of the group is a client and group rank 0
    starts the roles; with ``address="host:port"`` the roles were started by
    ``python -m torchdata_overlord.launch`` and this process joins them as client ``rank``. The
    strategy must then be picklable (e.g. a module-level function). Several rpc loaders may be open
    in one process: one opened while another runs shares its RPC group and worker processes.
    Every runtime yields the same batches. ``timeout`` bounds every wait for the next step;
    ``startup_timeout`` bounds the rpc runtime's start-up (processes joining, every Source Loader's first
    buffer): raise it for hundreds of sources.
    Each item: ``{"step": int, "delivery": "data" | "metadata" | "none", "microbatches": list | None}``
    (see :class:`~torchdata_overlord.roles.constructor.DataConstructor` for the microbatch fields),
    plus ``"encoder"`` (the images this rank embeds) when the plan carries an encoder module.
    """

    VERSION = 1
    K_VERSION, K_CONFIG, K_STEP, K_JOB = "version", "config", "step", "job"

    def __init__(self, sources: Iterable, strategy: Callable, mesh: ClientPlaceTree, rank: int | None,
                 global_batch: int, seq_len: int | None, runtime: str = "local", seed: int = 0, prefetch: int = 2,
                 pin_memory: bool = False, buffer_size: int | Mapping[str, int] | None = None,
                 workers: int | Mapping[str, int] = 0, image_token_id: int | None = None, pad_id: int = 0,
                 timeout: float = 300.0, startup_timeout: float = 60.0, n_workers: int | None = None,
                 constructors: int | None = None, group=None, address: str | None = None, spares: int = 0,
                 fault_tolerance: "FaultTolerance | None" = None):
        if runtime not in RUNTIMES:
            raise ConfigError(f"unknown runtime {runtime!r}; choose 'local' (every role in this process) or 'rpc' "
                              f"(roles in worker processes over torch.distributed.rpc)")
        if not isinstance(mesh, ClientPlaceTree):
            raise ConfigError(f"mesh must be a ClientPlaceTree, got {type(mesh).__name__}")
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < mesh.world_size):
            raise ConfigError(f"rank {rank!r} is outside the mesh's {mesh.world_size} ranks ({mesh.describe()})")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch must be an integer >= 0 (0: each next() builds its own step), got {prefetch!r}")
        if not timeout > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
        sources = list(sources)
        self.mesh, self.rank, self.prefetch, self.timeout = mesh, rank, prefetch, float(timeout)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        if pin_memory and not self.pin_memory:
            warnings.warn("pin_memory=True but no accelerator is available; batches are not pinned", stacklevel=2)
        extra = {}
        if runtime == "rpc":
            extra = dict(n_workers=n_workers, timeout=min(timeout, 60.0), startup_timeout=startup_timeout,
                         constructors=constructors, group=group,
                         address=address, client=rank if address is not None and rank is not None else None,
                         spares=spares)
            if fault_tolerance is not None:
                extra.update(fault_tolerance.job_options())
        elif (n_workers, constructors, group, address, spares, fault_tolerance) != (None, None, None, None, 0, None):
            raise ConfigError("n_workers, constructors, group, address, spares and fault_tolerance are options of "
                              "runtime='rpc'")
        self._job = RUNTIMES[runtime](sources, strategy, mesh, global_batch, seq_len, seed=seed,
                                      buffer_size=buffer_size, workers=workers, image_token_id=image_token_id,
                                      pad_id=pad_id, **extra)
        self._config = {"sources": [getattr(s, "name", s) for s in sources], "seed": seed, "global_batch": global_batch,
                        "seq_len": seq_len, "mesh": mesh.to_dict(), "image_token_id": image_token_id}
        self._consumed = {self.K_STEP: 0, self.K_JOB: self._job.state_dict()}
        self._pending: dict | None = None
        self._thread: threading.Thread | None = None
        self._active = False               # iterating (with a producer thread when prefetch > 0)
        self._stop = threading.Event()
        # C-level queues only between the trainer thread and the producer: a Ctrl-C landing in the
        # trainer's wait must not leave a Python-level lock held that the producer then blocks on
        self._queue: queue.SimpleQueue = queue.SimpleQueue()      # built steps' futures, in order
        self._slots: queue.SimpleQueue = queue.SimpleQueue()      # one token per step that may be built ahead
        self._ahead: collections.deque = collections.deque()      # the same futures, to peek at the head
        self._closed = False
        self._lock = threading.Lock()      # the producer steps the job under it; stats() reads under it
        self.exhausted_reason: str | None = None
        self.last_plan = None              # the Plan of the step the trainer consumed last (stats, render)
        self._feedback: list[list] = []    # [step, values] given by the trainer, until planned and consumed
        self._waits: collections.deque = collections.deque(maxlen=1000)   # seconds next() waited, recent steps
        self.stalls = 0                    # next() calls that waited for a step delayed by a role's failure

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> "OverlordLoader":
        """Start (or restart) producing from the consumed position, or from a loaded state."""
        if self._closed:
            raise OverlordError("this OverlordLoader is closed")
        self._stop_producer()
        if self._pending is not None:
            self._consumed, self._pending = self._pending, None
            self._feedback = copy.deepcopy(self._consumed[self.K_JOB].get(LocalJob.FEEDBACK, []))
        self._job.load_state_dict(self._job_state(self._consumed))
        self._active = True
        if self.prefetch == 0:                 # no producer: each next() builds its own step
            return self
        self._stop = threading.Event()
        self._queue, self._slots, self._ahead = queue.SimpleQueue(), queue.SimpleQueue(), collections.deque()
        for _ in range(self.prefetch):                      # steps the producer may build ahead of the trainer
            self._slots.put(None)
        self._thread = threading.Thread(target=self._produce,
                                        args=(self._stop, self._queue, self._slots, self._ahead),
                                        name="overlord-prefetch", daemon=True)
        self._thread.start()
        return self

    def _produce(self, stop: threading.Event, out: queue.SimpleQueue, slots: queue.SimpleQueue,
                 ahead: collections.deque) -> None:
        """Submit steps ahead of the trainer (at most ``prefetch`` not yet consumed); the queue holds
        each step's future in order (LocalJob computes it here, RpcJob's roles compute it remotely)."""
        ranks = None if self.rank is None else [self.rank]
        while not stop.is_set():
            try:
                slots.get(timeout=0.1)              # at most `prefetch` steps built and not yet consumed
            except queue.Empty:
                continue
            try:
                with self._lock:
                    fut = self._job.submit(ranks, consumed=self._consumed[self.K_STEP])
            except BaseException as e:  # noqa: BLE001 (handed to the trainer thread, re-raised there)
                fut = cf.Future()
                fut.set_exception(e)
            ahead.append(fut)
            out.put(fut)
            if fut.done() and fut.exception() is not None:
                return

    def __next__(self) -> dict:
        if not self._active:
            iter(self)
        t0 = time.perf_counter()
        if self.prefetch == 0:
            with self._lock:
                fut = self._job.submit(None if self.rank is None else [self.rank],
                                       consumed=self._consumed[self.K_STEP])
        else:
            while True:
                try:
                    fut = self._queue.get(timeout=0.1)
                    self._ahead.popleft()
                    break
                except queue.Empty:
                    if self._thread is None or not self._thread.is_alive():
                        self._end()
                        raise StopIteration from None
                    self._check_timeout(t0)
        ready = fut.done()
        while True:
            try:
                res = fut.result(timeout=0.1)
                break
            except cf.TimeoutError:
                self._check_timeout(t0)
            except SourceExhausted as e:
                self.exhausted_reason = str(e)
                log.info("OverlordLoader: %s", e)
                self._end()
                raise StopIteration from None
            except Exception:               # the step failed: the stream stops here (an interrupt is not caught)
                self._end()
                raise
        if self.prefetch:
            self._slots.put(None)
        self._waits.append(time.perf_counter() - t0)
        if not ready and getattr(fut, "delayed", False):
            self.stalls += 1               # the trainer waited for a step a failure had delayed
        self._consumed = {self.K_STEP: res.step + 1, self.K_JOB: res.state}
        planned = res.state[LocalJob.PLANNER]["step"]
        self._feedback = [f for f in self._feedback if f[0] >= planned]   # the rest is in the snapshot
        self.last_plan = res.plan
        return self._package(res.step, res.outputs)

    def _end(self) -> None:
        """The stream stopped (exhausted or failed): stop the producer; a next ``iter()`` restarts."""
        self._active = False
        self._stop_producer()

    def _check_timeout(self, t0: float) -> None:
        if time.perf_counter() - t0 >= self.timeout:
            raise TimeoutError(f"no step produced within {self.timeout:.0f} s (step {self._consumed[self.K_STEP]}); "
                               f"raise OverlordLoader(timeout=...) for very slow sources")

    def _package(self, step: int, outputs: dict):
        def one(rank):
            out = outputs[rank]
            item = {"step": step}
            if isinstance(out, dict):      # a plan with an encoder module: backbone part + images to embed
                item.update(out)
            else:
                item.update(delivery=self._delivery(rank, out), microbatches=out)
            if self.pin_memory:
                item = _pin(item)
            return item
        if self.rank is not None:
            return one(self.rank)
        return {r: one(r) for r in sorted(outputs)}

    def _delivery(self, rank: int, out) -> str:
        if out is None:
            return "none"
        return "metadata" if self.mesh.coords(rank).get("pp", 0) > 0 else "data"

    # -- trainer feedback ----------------------------------------------------------------------
    def feedback(self, values: Mapping[str, float]) -> None:
        """Per-source feedback (e.g. loss) for dynamic schedules such as ``ol.Dynamic``.

        Given after consuming step ``k``, it weighs the plan of step ``k + prefetch``, the first one
        the prefetch thread cannot have built yet; so the stream depends only on the feedback
        sequence (and ``prefetch``), never on timing. Checkpoints keep feedback not yet planned.
        Where several trainer processes share one rpc job, the Planner takes rank 0's feedback (the
        group's leader); give every rank the same values (e.g. an all-reduced loss).
        """
        values = {str(k): float(v) for k, v in values.items()}
        entry = [self._consumed[self.K_STEP] + self.prefetch, values]
        with self._lock:
            self._job.add_feedback(entry[0], values)
        self._feedback.append(entry)

    # -- state ---------------------------------------------------------------------------------
    def _job_state(self, at: dict) -> dict:
        """The roles' state at a consumed point, with the trainer feedback not yet planned there."""
        job = copy.deepcopy(at[self.K_JOB])
        planned = job[LocalJob.PLANNER]["step"]
        job[LocalJob.FEEDBACK] = [copy.deepcopy(f) for f in self._feedback if f[0] >= planned]
        return job

    def state_dict(self) -> dict:
        """What the trainer consumed (or a loaded state still to apply): plain types only, so
        ``torch.load(weights_only=True)`` reads it.

        The roles' state (whose shape changes as the job runs) is one JSON string, so the dict's
        structure is the same for every loader of a configuration: ``torch.distributed.checkpoint``
        loads into the structure of the live loader's ``state_dict()`` and would drop anything else.
        """
        if self._pending is not None:                 # a loaded state not yet applied
            step, job = self._pending[self.K_STEP], self._pending[self.K_JOB]
        else:
            step, job = self._consumed[self.K_STEP], self._job_state(self._consumed)
        return {self.K_VERSION: self.VERSION, self.K_CONFIG: copy.deepcopy(self._config),
                self.K_STEP: step, self.K_JOB: json.dumps(job, sort_keys=True)}

    def load_state_dict(self, state: Mapping) -> None:
        """Copy ``state``; the next ``iter()`` continues exactly after the step it describes."""
        if not isinstance(state, Mapping) or state.get(self.K_VERSION) != self.VERSION:
            raise ConfigError(f"not an OverlordLoader state of version {self.VERSION}: keys "
                              f"{sorted(state) if isinstance(state, Mapping) else type(state).__name__}")
        theirs = state[self.K_CONFIG]
        diffs = [f"{k}: saved {theirs.get(k)!r}, now {v!r}" for k, v in self._config.items() if theirs.get(k) != v]
        if diffs:
            raise ConfigError("this state comes from another loader configuration: " + "; ".join(diffs))
        job = state[self.K_JOB]
        job = json.loads(job) if isinstance(job, str) else copy.deepcopy(dict(job))
        self._pending = {self.K_STEP: int(state[self.K_STEP]), self.K_JOB: job}

    # -- shutdown ------------------------------------------------------------------------------
    def _stop_producer(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=self.timeout)
        if thread.is_alive():
            raise OverlordError(f"the prefetch thread did not stop within {self.timeout:.0f} s")

    def close(self) -> None:
        """Stop the prefetch thread and the loaders' worker pools; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_producer()
        finally:
            self._job.close()

    def __enter__(self) -> "OverlordLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    def stats(self) -> dict:
        """The consumed step; how long ``next()`` waited for data over recent steps (p50/p99/max, ms);
        per source: buffer size and bytes, samples served, epochs, skips; per role: its process id;
        per process: RSS and PSS in MiB (from /proc)."""
        waits = sorted(self._waits)
        pick = lambda q: round(1000 * waits[min(int(q * len(waits)), len(waits) - 1)], 3) if waits else None  # noqa: E731
        fetch = {"steps": len(waits), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": pick(1.0)}
        with self._lock:
            return {"step": self._consumed[self.K_STEP], "fetch_wait": fetch, "stalls": self.stalls,
                    **self._job.stats()}
