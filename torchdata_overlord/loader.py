"""OverlordLoader: the trainer's drop-in ``DataLoader`` replacement (the paper's client).

Iterating yields, per training step, what this rank receives: its microbatches as dicts of
tensors (or metadata only, or nothing, as the plan says). A background thread prefetches
``prefetch`` steps (``prefetch=0``: no thread, each ``next()`` builds its own step); each step is
packaged (and pinned) as soon as it is answered, on the thread that answered it, so ``next()`` of a
ready step only takes it (it waits on no future, Condition or thread); a failed step reaches the trainer
as its exception, never as the end of the stream. ``state_dict()`` describes
what the trainer has *consumed*, not what was prefetched, holds only plain Python types, is cheap
and side-effect free; ``load_state_dict()`` checks its input as a whole (see
:mod:`~torchdata_overlord.loader_state`), copies it and applies it at the next ``iter()`` or ``next()``, which
continues with exactly the steps an uninterrupted run would have produced.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import copy
import logging
import math
import numbers
import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from . import loader_state
from .elastic import adapt, source_changes
from .errors import ConfigError, OverlordError
from .loader_state import transform_files, transform_spec
from .plane.dry_run import check_strategy
from .plane.mixture_probe import mixture_spec
from .plane.place_tree import ClientPlaceTree
from .runtime.coverage import check_clients_cover_mesh
from .runtime.job_config import check_autoscale, check_source_names
from .roles.planner import check_seed
from .roles.source_loader import SourceLoader
from .runtime.local import LocalJob
from .runtime.step import JobState, SourceExhausted
from .runtime.rpc_job import RpcJob

__all__ = ["OverlordLoader", "FaultTolerance"]

log = logging.getLogger("torchdata_overlord")
RUNTIMES = {"local": LocalJob, "rpc": RpcJob}


_END = object()      # the producer's last item when it stops without a failed step


def _failed(e: BaseException) -> cf.Future:
    fut: cf.Future = cf.Future()
    fut.set_exception(e)
    return fut


def _no_wakeup_preemption() -> None:
    """Run the calling thread under Linux's ``SCHED_BATCH``: the same share of the CPU as before, but
    waking it does not preempt the thread that woke it (it runs on an idle core, or at the waker's
    next tick or wait). ``next()`` wakes the producer with each slot it gives back; without this, on
    a busy machine the scheduler often switched the trainer out for it inside ``next()`` (involuntary
    context switches of the trainer there, measured), and the trainer then waited for the CPU. Threads
    this one starts inherit the policy. A no-op where unsupported."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


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


def _world_note() -> str:
    """What torch.distributed says of the trainer processes, for an error about ranks ("" when not initialised)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return f" (torch.distributed has {dist.get_world_size()} processes here)"
    return ""


class OverlordLoader:
    """``OverlordLoader(sources, strategy, mesh, rank, global_batch, seq_len, runtime="local", ...)``.

    ``rank=None`` simulates every rank of the mesh in this process: each item is then
    ``{rank: item}``. ``runtime="local"`` runs every role in this process; ``runtime="rpc"`` runs
    the Planner, each Source Loader and one Data Constructor per DP group (``constructors=``) as
    actors in worker processes over ``torch.distributed.rpc``, on loopback, started by this process.
    Where: ``placement="auto"`` (default) profiles every source (transform time, sample and row-group
    bytes; journaled, so a restart over unchanged files reuses it) and gives each source data-parallel
    actors and transform workers by its share of the mixture's cost, packed into as few processes as
    the cores this process leaves free (see :mod:`torchdata_overlord.scaling`; ``loader.placement.render()``
    says where and why); a :class:`~torchdata_overlord.scaling.Placement` places by hand;
    ``n_workers=N`` puts one actor per source round robin on N processes, as before, each with the measured
    transform threads of ``placement="auto"`` unless ``workers=`` is given. With a profiled
    placement, ``autoscale=True`` (default; or a :class:`~torchdata_overlord.scaling.AutoScaler`) lets the
    Planner add loader actors to a source whose share of the mixture grows and take them back when it
    falls, resharding its unread row groups live (the batches do not change); with ``group=`` (a ``torch.distributed``
    process group, or ``"default"``) every trainer process of the group is a client and group rank 0
    starts the roles; with ``address="host:port"`` the roles were started by
    ``python -m torchdata_overlord.launch`` and this process joins them as client ``rank``. The
    strategy must then be picklable (e.g. a module-level function). Several rpc loaders may be open
    in one process: one opened while another runs shares its RPC group and worker processes.
    Every runtime yields the same batches. ``timeout`` bounds every wait for the next step, and with
    ``runtime="local"`` each call between the roles too (a Source Loader's fill, a first one included: a role
    stuck in user code then fails its step, not holding the Planner up; rpc: ``min(timeout, 60)``);
    ``startup_timeout`` bounds the rpc runtime's start-up (processes joining, every Source Loader's first
    buffer): raise it for hundreds of sources.
    Each item: ``{"step": int, "delivery": "data" | "metadata" | "none", "microbatches": list | None,
    "encoder": dict | None}``, the same keys for every delivery (see :mod:`~torchdata_overlord.batch`).
    ``image_token_id`` is your tokenizer's id of the image placeholder piece (e.g. ``"<image>"``
    trained as a sentencepiece ``user_defined_symbols`` entry:
    ``SentencePieceProcessor(model_file=spm_path).piece_to_id("<image>")``): each image stands in the
    backbone sequence as ``patches`` copies of it, counted in the tokens that packing and balancing
    see. ``None``: text-only sequences; images still ride along.

    Iteration (as ``StatefulDataLoader`` after a ``load_state_dict``, since a mixed stream has no
    epochs to restart): the loader is one stream over the whole run and its own iterator. A second
    ``iter()`` (a new ``for`` after a ``break``) continues after the last step the trainer consumed;
    steps prefetched but not consumed are built again, so nothing is skipped or repeated. After a
    failed step, ``iter()`` tries that step again. Each source reshuffles itself at each of its
    epochs (``ParquetSource(seed=..., epochs=...)``), so there is no ``set_epoch``. With
    ``epochs=None`` (default) a source repeats forever; with finite epochs the stream ends
    (``StopIteration``, the reason in ``exhausted_reason``) at the first step that a finished source
    cannot fill its share of: the first source to run out ends it, as torchdata's
    ``StopCriteria.FIRST_DATASET_EXHAUSTED`` and ``drop_last=True`` would, because bending the
    mixture to use up the other sources would break the schedule. ``next()`` then keeps raising
    ``StopIteration`` and ``iter()`` raises :class:`OverlordError` saying why (a silent empty epoch
    would read as "done"); ``load_state_dict()`` of an earlier state reads the stream again.
    ``len()`` raises ``TypeError``: how many steps a finite stream has depends on the mixture, the
    buffers and skipped rows; count steps (``itertools.islice(loader, steps)``).
    """

    K_STEP, K_JOB = loader_state.STEP, loader_state.JOB
    IDLE_WAKE = 2.0        # seconds between the idle prefetch thread's checks of its stop flag (close() wakes it at once)

    def __init__(self, sources: Iterable, strategy: Callable, mesh: ClientPlaceTree, rank: int | None,
                 global_batch: int, seq_len: int | None, runtime: str = "local", seed: int = 0, prefetch: int = 2,
                 pin_memory: bool = False, buffer_size: int | Mapping[str, int] | None = None,
                 workers: int | Mapping[str, int] | None = None, image_token_id: int | None = None, pad_id: int = 0,
                 timeout: float = 300.0, startup_timeout: float = 60.0, n_workers: int | None = None,
                 constructors: int | None = None, group=None, address: str | None = None, spares: int = 0,
                 fault_tolerance: "FaultTolerance | None" = None, placement="auto", autoscale=True):
        if runtime not in RUNTIMES:
            raise ConfigError(f"unknown runtime {runtime!r}; choose 'local' (every role in this process) or 'rpc' "
                              f"(roles in worker processes over torch.distributed.rpc)")
        if not isinstance(mesh, ClientPlaceTree):
            raise ConfigError(f"mesh must be a ClientPlaceTree, got {type(mesh).__name__}")
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < mesh.world_size):
            raise ConfigError(f"rank {rank!r} is outside the mesh's {mesh.world_size} ranks ({mesh.describe()}): "
                              f"rank is this trainer's rank in the mesh (e.g. dist.get_rank()), so the mesh must be "
                              f"the trainers' own: its sizes multiply to the number of trainer processes"
                              + _world_note())
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch must be an integer >= 0 (0: each next() builds its own step), got {prefetch!r}")
        if not timeout > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
        seed = check_seed(seed)
        check_autoscale(autoscale)          # (the local runtime's default placement takes none: checked here)
        for name, value in (("pad_id", pad_id), ("image_token_id", image_token_id)):
            if not (value is None and name == "image_token_id") and (
                    isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
                raise ConfigError(f"{name} must be a token id, an integer >= 0 (an embedding row), got {value!r}")
        sources = list(sources)
        names = [getattr(s, "name", s) for s in sources]
        check_source_names(names)
        self.mesh, self.rank, self.prefetch, self.timeout = mesh, rank, prefetch, float(timeout)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        if pin_memory and not self.pin_memory:
            warnings.warn("pin_memory=True but no accelerator is available; batches are not pinned", stacklevel=2)
        extra = {}
        if runtime == "rpc":
            extra = dict(n_workers=n_workers, timeout=min(timeout, 60.0), startup_timeout=startup_timeout,
                         constructors=constructors, group=group,
                         address=address, client=rank if address is not None and rank is not None else None,
                         spares=spares, placement=placement, autoscale=autoscale)
            if fault_tolerance is not None:
                extra.update(fault_tolerance.job_options())
        elif (n_workers, constructors, group, address, spares, fault_tolerance) != (None, None, None, None, 0, None):
            raise ConfigError("n_workers, constructors, group, address, spares and fault_tolerance are options of "
                              "runtime='rpc'")
        else:
            # the roles' calls wait as long as next() does (a first buffer fill included): a role stuck in user
            # code then fails its step within the user's timeout, not the local runtime's default 300 s
            extra = dict(timeout=timeout)
            if placement != "auto":
                extra.update(placement=placement, autoscale=autoscale)
        check_clients_cover_mesh(mesh, rank, group)        # no mesh rank left without a trainer process
        self._takes_feedback = check_strategy(strategy, mesh, names, global_batch, seed)   # None: cannot tell
        self._job = RUNTIMES[runtime](sources, strategy, mesh, global_batch, seq_len, seed=seed,
                                      buffer_size=buffer_size, workers=workers, image_token_id=image_token_id,
                                      pad_id=pad_id, **extra)
        self._job.prefetch = prefetch            # the Planner's checkpoints record it (see load_checkpoint_store)
        self._config = {"sources": names, "seed": seed, "global_batch": global_batch, "seq_len": seq_len,
                        "mesh": mesh.to_dict(), "image_token_id": image_token_id, loader_state.PREFETCH: prefetch,
                        loader_state.MIXTURE: mixture_spec(strategy, mesh, names, global_batch, seed),
                        loader_state.TRANSFORMS: {getattr(s, "name", s): transform_spec(s) for s in sources},
                        loader_state.TRANSFORM_FILES: {getattr(s, "name", s): transform_files(s) for s in sources}}
        self._consumed = {self.K_STEP: 0, self.K_JOB: self._job.start_state()}
        self._initial_job = copy.deepcopy(self._consumed[self.K_JOB])     # where a source added at a resume starts
        self._sources = sources
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
        self._starting = threading.Lock()  # one next() (re)starts the stream when threads share the loader
        self.exhausted_reason: str | None = None
        self.last_plan = None              # the Plan of the step the trainer consumed last (stats, render)
        self._handed = None                # the batch the last next() returned (freed by the producer, see next())
        self._feedback: list[list] = []    # [step, values] given by the trainer, until planned and consumed
        self._waits: collections.deque = collections.deque(maxlen=1000)   # seconds next() waited, recent steps
        self.stalls = 0                    # next() calls that waited for a step delayed by a role's failure

    def __reduce__(self):
        raise TypeError("an OverlordLoader cannot be pickled or copied: it runs a prefetch thread (and, with "
                        "runtime='rpc', role processes) for one stream. Hand over loader.state_dict() instead and "
                        "continue it with load_state_dict() on a loader built where it is needed")

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> "OverlordLoader":
        """Start (or restart) producing from the consumed position, or from a loaded state; after
        the stream ended (a source finished its epochs), only a loaded state starts it again."""
        self._check_open("iter()")
        if self._pending is None and self.exhausted_reason is not None:
            raise OverlordError(f"this stream ended after step {self._consumed[self.K_STEP] - 1}: "
                                f"{self.exhausted_reason}. An OverlordLoader is one stream over the whole run, not "
                                f"an epoch: give the sources more epochs (ParquetSource(epochs=N), None: forever) "
                                f"for more passes, or load_state_dict() an earlier state to read it again")
        self._stop_producer()
        if self._pending is not None:
            self._consumed, self._pending = self._pending, None
            self._feedback = copy.deepcopy(self._consumed[self.K_JOB].get(JobState.FEEDBACK, []))
            self.exhausted_reason = None
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
        each step's future in order (LocalJob computes it here, RpcJob's roles compute it remotely;
        :meth:`_prepare` packages it once answered). Each slot token ``next()`` gives back carries the
        records that step replaced and the batch the previous ``next()`` returned, so freeing them happens
        here, not on the trainer's thread (in the rpc runtime, dropping a batch of tensors received through
        shared memory costs ~0.2 ms); the wake-up itself does not preempt the trainer
        (:func:`_no_wakeup_preemption`).
        The last item this thread queues is a failed step's future or ``_END`` (stopped), so the
        trainer never has to guess from the thread's liveness why nothing more comes."""
        ranks = None if self.rank is None else [self.rank]
        _no_wakeup_preemption()
        try:
            while not stop.is_set():
                try:
                    slots.get(timeout=self.IDLE_WAKE)   # at most `prefetch` steps built and not yet consumed
                except queue.Empty:
                    continue
                if stop.is_set():                       # woken by _stop_producer
                    break
                try:
                    with self._lock:
                        fut = self._job.submit(ranks, consumed=self._consumed[self.K_STEP])
                except BaseException as e:  # noqa: BLE001 (handed to the trainer thread, re-raised there)
                    fut = _failed(e)
                fut.add_done_callback(self._prepare)     # packaged off the trainer's thread, once answered
                ahead.append(fut)
                out.put(fut)
                if fut.done() and fut.exception() is not None:
                    return
        except BaseException as e:  # noqa: BLE001 (a fault of this loop itself: the trainer raises it)
            out.put(_failed(e))
        finally:
            out.put(_END)

    def __next__(self) -> dict:
        self._check_open("next()")
        if not self._active or self._pending is not None:
            with self._starting:
                if not self._active or self._pending is not None:
                    if self._pending is None and self.exhausted_reason is not None:
                        raise StopIteration    # an ended stream stays ended (a loaded state restarts it)
                    iter(self)                 # (a state loaded inside a running loop applies from this step)
        t0 = time.perf_counter()
        if self.prefetch == 0:
            with self._lock:
                fut = self._job.submit(None if self.rank is None else [self.rank],
                                       consumed=self._consumed[self.K_STEP])
        else:
            while True:
                try:
                    fut = self._queue.get(timeout=0.1)
                    break
                except queue.Empty:
                    self._check_timeout(t0)
            if fut is _END:                 # stopped by close() or iter() from another thread
                self._end()
                raise OverlordError("the prefetch thread was stopped (close() or iter() from another thread) "
                                    "while next() waited; call iter() to continue from the consumed step")
            if self._ahead and self._ahead[0] is fut:
                self._ahead.popleft()
        built = getattr(fut, self._BUILT, None)   # a ready step: answered, unpickled and packaged already
        if built is not None:
            res, item = built
            ready = True
        else:
            ready = fut.done()
            while True:
                try:
                    res = fut.result(timeout=0.1)
                    break
                except cf.TimeoutError:
                    self._check_timeout(t0)
                except SourceExhausted as e:
                    self.exhausted_reason = str(e)
                    # one source ending a mixture cuts the others off mid-epoch: say so where the default log shows
                    log.log(logging.WARNING if len(self._sources) > 1 else logging.INFO,
                            "OverlordLoader: the stream ends: %s", e)
                    self._end()
                    raise StopIteration from None
                except Exception:           # the step failed: the stream stops here (an interrupt is not caught)
                    self._end()
                    raise
            item = self._package(res.step, res.outputs)
        self._waits.append(time.perf_counter() - t0)
        if not ready and getattr(fut, "delayed", False):
            self.stalls += 1               # the trainer waited for a step a failure had delayed
        # the step this one replaces, and the batch the last next() gave (the trainer lets go of it as it
        # takes this one: the producer frees its tensors then, off the trainer's thread)
        released = (self._consumed, self.last_plan, self._handed)
        self._consumed = {self.K_STEP: res.step + 1, self.K_JOB: res.state}
        if self._feedback:
            planned = JobState.step(res.state)
            self._feedback = [f for f in self._feedback if f[0] >= planned]   # the rest is in the snapshot
        self.last_plan = res.plan
        if self.prefetch:
            self._handed = item
            self._slots.put(released)      # the producer may build one more, and drops `released` there
        return item

    _BUILT = "overlord_built"              # a step future's (StepResult, item), set by _prepare

    def _prepare(self, fut: cf.Future) -> None:
        """A step's future completed (on whichever thread completed it: an actor's, an RPC callback's, the
        producer's): package its item now, so that ``next()`` of a ready step only takes it. A failed
        step is left to ``next()``, which raises its exception."""
        try:
            if fut.cancelled() or fut.exception() is not None:
                return
            res = fut.result()
            setattr(fut, self._BUILT, (res, self._package(res.step, res.outputs)))
        except Exception:  # noqa: BLE001 (next() packages it itself and raises what that raises)
            log.debug("OverlordLoader: packaging step off the trainer's thread failed", exc_info=True)

    def __len__(self) -> int:
        raise TypeError("an OverlordLoader has no len(): sources with epochs=None repeat forever, and with finite "
                        "epochs the stream ends when the first source runs out, which depends on the mixture, the "
                        "buffers and skipped rows; count steps instead, e.g. itertools.islice(loader, steps)")

    def __bool__(self) -> bool:
        return True                        # not len(): a loader is always true

    def _end(self) -> None:
        """The stream stopped (exhausted or failed): stop the producer; a next ``iter()`` restarts."""
        self._active = False
        self._stop_producer()

    def _check_timeout(self, t0: float) -> None:
        if time.perf_counter() - t0 >= self.timeout:
            raise TimeoutError(f"no step produced within {self.timeout:.0f} s (step {self._consumed[self.K_STEP]}); "
                               f"{self._why_no_step()}")

    def _why_no_step(self) -> str:
        """What a timed-out ``next()`` advises: a role whose process answers no ping (frozen: SIGSTOP, a debugger,
        swapped out; or gone) is named, since no timeout fixes it; else raise the timeout for slow sources."""
        try:
            lost = self._job.unanswering(min(5.0, self.timeout))
        except Exception:                    # noqa: BLE001 - advice only
            lost = {}
        if not lost:
            stuck = getattr(self._job, "stuck_loaders", lambda _: {})(self.timeout / 2)
            if stuck:
                roles = ", ".join(f"{a} in {m}() for {t:.0f} s" for a, (m, t) in sorted(stuck.items()))
                return (f"waiting for {roles}: its source's read or transform is slow or does not return (user code, "
                        f"which no timeout stops); raise OverlordLoader(timeout=...) for very slow sources")
            return "raise OverlordLoader(timeout=...) for very slow sources"
        roles = "; ".join(f"{a}: {type(e).__name__}: {str(e).splitlines()[0][:160]}" for a, e in lost.items())
        return (f"the process of {sorted(lost)} answers no ping ({roles}): it is frozen (SIGSTOP, a debugger, "
                f"swapped out) or gone, which no timeout fixes; with fault_tolerance= and spares= the job replaces "
                f"such roles")

    def _package(self, step: int, outputs: dict):
        def one(rank):
            item = {"step": step, **outputs[rank]}
            if self.pin_memory:
                item = _pin(item)
            return item
        if self.rank is not None:
            return one(self.rank)
        return {r: one(r) for r in sorted(outputs)}

    # -- trainer feedback ----------------------------------------------------------------------
    def feedback(self, values: Mapping[str, float]) -> None:
        """Per-source feedback (e.g. loss) for dynamic schedules such as ``ol.Dynamic``.

        Given after consuming ``k`` steps (the batch of step ``k - 1``), it weighs the plan of step
        ``k + prefetch``, the first one the prefetch thread cannot have built yet; so the stream depends
        only on the feedback sequence (and ``prefetch``), never on timing. Checkpoints keep feedback not yet planned.
        Where several trainer processes share one rpc job, the Planner takes rank 0's feedback (the
        group's leader); give every rank the same values (e.g. an all-reduced loss). With
        ``runtime="local"`` every trainer process plans for itself, so every rank must give the same
        values at the same steps: a rank whose feedback differs plans other batches than the rest, and
        samples are then duplicated or lost across ranks.
        """
        self._check_open("feedback()")
        values = self._checked_feedback(values)
        if self._takes_feedback is False:       # else the plan it weighs, prefetch steps on, fails in next()
            raise ConfigError("feedback() given, but no schedule of this strategy takes feedback; mix with a dynamic "
                              "schedule such as ol.Dynamic")
        if self._pending is not None:          # given after a load_state_dict(): it follows the loaded step
            entry = [self._pending[self.K_STEP] + self.prefetch, values]
            self._pending[self.K_JOB].setdefault(JobState.FEEDBACK, []).append(entry)
            return
        entry = [self._consumed[self.K_STEP] + self.prefetch, values]
        with self._lock:
            self._job.add_feedback(entry[0], values)
        self._feedback.append(entry)

    def _checked_feedback(self, values: Mapping[str, float]) -> dict[str, float]:
        """``values`` as ``{source: float}``; a ConfigError now for an unknown source or a value that is not a
        finite number, which would otherwise fail every plan from ``prefetch`` steps on, and every resume."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"feedback() takes a {{source: value}} dict, got {type(values).__name__}")
        unknown = sorted(set(map(str, values)) - set(self._config["sources"]))
        if unknown:
            raise ConfigError(f"feedback() names unknown sources {unknown}; this loader's sources are "
                              f"{self._config['sources']}")
        out = {}
        for k, v in values.items():
            try:
                out[str(k)] = float(v)
            except (TypeError, ValueError):
                raise ConfigError(f"feedback() value for {k!r} is {v!r:.60}, not a number") from None
            if not math.isfinite(out[str(k)]):
                raise ConfigError(f"feedback() value for {k!r} is {v}; it must be finite (a diverged loss? skip "
                                  f"that step's feedback)")
        return out

    # -- state ---------------------------------------------------------------------------------
    def _job_state(self, at: dict) -> dict:
        """The roles' state at a consumed point, with the trainer feedback not yet planned there."""
        job = copy.deepcopy(at[self.K_JOB])
        planned = JobState.step(job)
        job[JobState.FEEDBACK] = [copy.deepcopy(f) for f in self._feedback if f[0] >= planned]
        return job

    def state_dict(self) -> dict:
        """What the trainer consumed (or a loaded state still to apply): plain types only, so
        ``torch.load(weights_only=True)`` reads it; the format is in :mod:`~torchdata_overlord.loader_state`
        (version, config with the strategy's mixture, step, the roles' state as one JSON string and its
        checksum; the same structure for every loader of a configuration, as
        ``torch.distributed.checkpoint`` needs).
        """
        if self._pending is not None:                 # a loaded state not yet applied
            step, job = self._pending[self.K_STEP], self._pending[self.K_JOB]
        else:
            step, job = self._consumed[self.K_STEP], self._job_state(self._consumed)
        return loader_state.pack(copy.deepcopy(self._config), step, job)

    def load_state_dict(self, state: Mapping, strict: bool = True, sources_changed: str = "refuse") -> list[str]:
        """Check ``state`` as a whole and copy it; the next ``next()`` or ``iter()`` continues exactly
        after the step it describes (inside a running ``for`` loop too: its next item is the loaded
        position's; ``feedback()`` given between this call and that ``next()`` counts as given after the
        loaded step, and what was given before this call goes with the old position). A state that is
        not one this configuration wrote, unmodified, is refused with a :class:`ConfigError` naming the
        first inconsistency. A state saved under another mesh,
        global batch, number of constructors or loader actors, or runtime continues here elastically
        (:mod:`~torchdata_overlord.elastic` says what carries over and what "consumed" means). A state
        saved with another source set needs ``sources_changed="allow"``; under another mixing strategy
        or another transform, ``strict=False``: it then continues from the saved position with this
        loader's, and the changes are warned about. The sources' files and a transform's model file
        copied under another root are no change (the same relative paths, sizes and rows; the same
        model content): the move is logged; a model file changed in place is another transform. Returns every
        change, in words.
        (``torch.distributed.checkpoint.load`` calls this with ``strict=True``; to opt in there,
        load into ``{"loader": loader.state_dict()}`` and pass that entry here.)"""
        self._check_open("load_state_dict()")
        step, job, saved, changes = loader_state.unpack(state, self._config, strict, sources_changed)
        return self._resume(step, job, saved, changes)

    def load_checkpoint_store(self, checkpoint_dir: str, step: int | None = None,
                              sources_changed: str = "refuse") -> list[str]:
        """Resume from the data plane's own checkpoints: the store a job with
        ``FaultTolerance(checkpoint_dir=...)`` wrote, under this loader's mesh, batch and runtime, like
        :meth:`load_state_dict`. ``step``: the steps your model checkpoint consumed (default: the last
        step every trainer had reported consumed, up to ``prefetch`` steps fewer than they had). Each
        source's state is its last snapshot plus a replay of the steps since, read again here
        (:mod:`~torchdata_overlord.runtime.store_state`); the trainer feedback given by ``step`` comes
        from the checkpoints of the plans that used it (a ``step`` within ``prefetch`` steps of the
        store's last plan may lack some: the returned changes, also warned, say so and what makes it
        exact). The store keeps only the steps since each source's older of its two newest snapshots
        (about the last one to two ``snapshot_every``). Returns every change, in words."""
        from .runtime.store_state import job_from_store
        cfg = self._job.cfg
        step, job, saved, changes = job_from_store(checkpoint_dir, {s.name: s for s in self._sources
                                                                    if not isinstance(s, str)},
                                                   lambda name: cfg.get(cfg.buffer_size, name, cfg.global_batch), step)
        if saved["seed"] != self._config["seed"]:
            raise ConfigError(f"the store at {checkpoint_dir} comes from a job of seed {saved['seed']}, this loader's "
                              f"is {self._config['seed']}; resume with the same seed")
        saved = {**self._config, **saved}               # what the store does not record is taken as this loader's
        source_changes(saved["sources"], self._config["sources"], sources_changed)
        loader_state.check_job(job, step, saved)
        return self._resume(step, job, saved, changes, "load_checkpoint_store")

    def _resume(self, step: int, job: dict, saved: dict, changes: list[str], how: str = "load_state_dict") -> list[str]:
        """Continue at ``step`` with ``job`` (checked, saved under config ``saved``) at the next ``iter()`` or
        ``next()``."""
        if changes:
            warnings.warn(f"OverlordLoader.{how}: " + "; ".join(changes), stacklevel=3)
        job, elastic = adapt(job, step, saved, self._config, self._initial_job)
        for source in self._sources:              # another file set, seed or column choice: refused here
            if hasattr(source, "check_state") and source.name in saved["sources"]:
                source.check_state(job[JobState.LOADERS][source.name][SourceLoader.SOURCE_STATE])
        if elastic:
            log.info("OverlordLoader: resuming at step %d elastically: %s", step, "; ".join(elastic))
        self._pending = {self.K_STEP: step, self.K_JOB: job}
        return changes + elastic

    # -- shutdown ------------------------------------------------------------------------------
    def _stop_producer(self) -> None:
        self._handed = None
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        self._slots.put(None)                  # wake the producer now (it waits for a slot)
        thread.join(timeout=self.timeout)
        if thread.is_alive():
            raise OverlordError(f"the prefetch thread did not stop within {self.timeout:.0f} s")

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise OverlordError(f"{what} on a closed OverlordLoader (steps prefetched before close() are dropped, "
                                f"not served); state_dict() and stats() still answer, for a checkpoint: load it into "
                                f"a new loader to continue")

    def close(self) -> None:
        """Stop the prefetch thread and the roles (the loaders' worker pools, or the rpc worker processes);
        idempotent. Bounded, also after a ``next()`` that timed out on a stuck source: with
        ``runtime="local"`` within about 11 s (5 after a Ctrl-C), a role still in user code (a transform
        that does not return, which Python cannot stop) being named in a warning and left running as a
        daemon thread that does not keep the process from exiting; with ``runtime="rpc"``, a role whose process
        answers no ping (frozen, e.g. SIGSTOP, or gone) is not waited for: its worker is killed."""
        self._close()

    def _close(self, interrupted: bool = False) -> None:
        """``interrupted``: on a Ctrl-C (a ``with`` block left by ``KeyboardInterrupt``), the local roles are
        not waited for (only their threads, 5 s at most), so the interrupt reaches the trainer at once."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_producer()
        finally:
            self._job.close(interrupted)

    def __enter__(self) -> "OverlordLoader":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._close(interrupted=exc_type is not None and issubclass(exc_type, KeyboardInterrupt))

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    @property
    def placement(self):
        """The :class:`~torchdata_overlord.scaling.Placement` the roles were started with (``render()`` says
        where every actor runs and why), or None (every role in this process, or round robin over ``n_workers``)."""
        return getattr(self._job, "placement", None)

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
