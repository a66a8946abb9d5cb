"""RpcJob: LocalJob's roles as actors in worker processes, driven from the caller's process.

Same public surface and the same results as :class:`~torchdata_overlord.runtime.local.LocalJob`
(same seed and inputs: bit-identical outputs, and the two jobs' ``state_dict`` formats are the
same, so a state of one loads into the other). Placement: one Source Loader actor per source
(``"loader:<name>"``) spread round-robin over the workers, the ``"planner"`` actor on worker 0 and
one ``"constructor"`` actor on the last worker. One step:

1. every loader's ``metadata()`` (all calls issued, then waited on): only ``BufferMeta`` travels;
2. ``planner.plan(metas, feedback)`` gives the step's Plan (it pickles: it is plain data);
3. every loader's ``take(indices)`` (in parallel) returns its planned records (tensors over RPC);
4. the constructor actor builds the requested ranks' buckets from the plan and the staged samples.

Every call carries ``timeout`` seconds. Sources are rebuilt inside the workers from a
:class:`SourceSpec` (a used ParquetSource holds open Arrow files and does not pickle); the
strategy, transforms and mesh must pickle (a strategy defined at module level does, a closure
or lambda does not). torch.distributed.rpc can be initialised once per process, so a process can
run one RpcJob with the default transport; pass ``transport=`` to place the actors elsewhere (an
:class:`~torchdata_overlord.runtime.transport.InProcessTransport` runs the same code in this process).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..errors import BufferShortageError, ConfigError
from ..plane.place_tree import ClientPlaceTree
from ..plane.plan import Plan
from ..plane.records import SampleKey
from ..roles.constructor import DataConstructor
from ..roles.planner import Planner
from ..roles.source_loader import SourceLoader
from ..sources.parquet import ParquetSource
from .local import LocalJob, SourceExhausted, StepResult, source_settings
from .procstats import process_memory
from .transport import Transport

__all__ = ["RpcJob", "SourceSpec"]

PLANNER, CONSTRUCTOR = "planner", "constructor"


def loader_actor(name: str) -> str:
    return f"loader:{name}"


@dataclass
class SourceSpec:
    """How to rebuild a ParquetSource in another process: its constructor arguments and position.

    ``from_source`` reads a ParquetSource's public attributes: for local files, ``paths`` are its
    resolved :attr:`~ParquetSource.files` (the worker reads exactly the same files in the same
    order); for URIs or a ``filesystem=`` (pyarrow filesystems pickle), the paths as given, which the
    worker resolves again; the state's file fingerprint then refuses a file set that changed.
    """

    name: str
    paths: Any
    transform: Callable | None = None
    kwargs: dict = field(default_factory=dict)     # columns, shuffle, seed, epochs, on_error, ...
    state: dict | None = None                      # ParquetSource.state_dict() to start from

    @classmethod
    def from_source(cls, src) -> "SourceSpec":
        if isinstance(src, SourceSpec):
            return src
        if not isinstance(src, ParquetSource):
            raise ConfigError(f"RpcJob sources must be ParquetSource or SourceSpec, got {type(src).__name__}")
        kwargs = dict(columns=src.columns, shuffle=src.shuffle, seed=src.seed, epochs=src.epochs,
                      on_error=src.on_error)
        paths = list(src.files)
        if src.filesystem is not None or any("://" in f for f in src.files):
            paths, kwargs["filesystem"] = src.paths, src.filesystem
        return cls(src.name, paths, src.transform, kwargs, src.state_dict())

    def build(self) -> ParquetSource:
        src = ParquetSource(self.name, self.paths, self.transform, **self.kwargs)
        if self.state is not None:
            src.load_state_dict(self.state)
        return src


class _LoaderActor:
    """A SourceLoader over a source rebuilt from its spec, in the worker."""

    def __init__(self, spec: SourceSpec, buffer_size: int, workers: int, image_token_id: int | None):
        self.loader = SourceLoader(spec.build(), buffer_size, workers, image_token_id)

    def metadata(self):
        return self.loader.metadata()

    def take(self, indices: list) -> dict:
        return self.loader.take(indices)

    def exhausted(self) -> bool:
        return bool(self.loader.exhausted)

    def stats(self) -> dict:
        return self.loader.stats()

    def get_state(self) -> dict:
        return self.loader.get_state()

    def reset(self, state: dict) -> None:
        self.loader.reset(state)

    def close(self) -> None:
        self.loader.close()


class _ConstructorActor:
    """One DataConstructor building every requested bucket of a step in one call."""

    def __init__(self, seq_len, pad_id, ignore_index, image_token_id):
        self.constructor = DataConstructor(seq_len, pad_id=pad_id, ignore_index=ignore_index,
                                           image_token_id=image_token_id)

    def build(self, plan: Plan, wanted: list, samples: Mapping) -> dict:
        samples = {SampleKey(*k): v for k, v in samples.items()}
        outputs = {}
        for b in sorted({plan.bucket_of(r) for r in wanted}):
            built = self.constructor.build(plan, b, samples)
            outputs.update({r: built[r] for r in wanted if r in built})
        return outputs


class RpcJob:
    """``RpcJob(sources, strategy, mesh, global_batch, seq_len, seed=0, buffer_size=None, workers=0,
    image_token_id=None, pad_id=0, ignore_index=-100, n_workers=2, timeout=60.0, startup_timeout=60.0,
    transport=None)``: LocalJob's API (``step``, ``state_dict``, ``load_state_dict``, ``add_feedback``,
    ``step_index``, ``close``, context manager) with the roles in RPC worker processes."""

    PLANNER, LOADERS, FEEDBACK = LocalJob.PLANNER, LocalJob.LOADERS, LocalJob.FEEDBACK

    def __init__(self, sources: Iterable, strategy: Callable, mesh: ClientPlaceTree, global_batch: int,
                 seq_len: int | None, seed: int = 0, buffer_size: int | Mapping[str, int] | None = None,
                 workers: int | Mapping[str, int] = 0, image_token_id: int | None = None, pad_id: int = 0,
                 ignore_index: int = -100, n_workers: int = 2, *, timeout: float = 60.0,
                 startup_timeout: float = 60.0, transport: Transport | None = None):
        specs = [SourceSpec.from_source(s) for s in sources]
        names = [s.name for s in specs]
        per_source = source_settings(names)
        if not isinstance(mesh, ClientPlaceTree):
            raise ConfigError(f"mesh must be a ClientPlaceTree, got {type(mesh).__name__}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")

        if transport is None or hasattr(transport, "worker_of"):
            try:
                pickle.dumps(strategy)
            except Exception as e:          # noqa: BLE001
                raise ConfigError(f"RpcJob runs the strategy in a worker process, so it must pickle (define it at "
                                  f"module level, not as a closure or lambda): {type(e).__name__}: {e}") from e
        self.mesh, self.names, self.timeout = mesh, names, float(timeout)
        self.feedback: list[list] = []
        self._step = 0
        self._closed = False
        self._own_transport = transport is None
        if transport is None:
            from .rpc_transport import RpcTransport
            transport = RpcTransport(n_workers, startup_timeout=startup_timeout, rpc_timeout=self.timeout)
        self.transport = transport
        placed = hasattr(transport, "worker_of")          # RpcTransport takes worker=; others place themselves
        n = getattr(transport, "n_workers", 1)

        def where(i):
            return {"worker": i % n} if placed else {}

        try:
            transport.start_actor(PLANNER, Planner, strategy, mesh, global_batch, seed=seed, **where(0))
            for i, spec in enumerate(specs):
                transport.start_actor(loader_actor(spec.name), _LoaderActor, spec,
                                      per_source(buffer_size, spec.name, global_batch),
                                      per_source(workers, spec.name, 0), image_token_id, **where(i))
            transport.start_actor(CONSTRUCTOR, _ConstructorActor, seq_len, pad_id, ignore_index, image_token_id,
                                  **where(n - 1))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------ calls

    def _call(self, actor: str, method: str, *args):
        return self.transport.call(actor, method, *args, timeout=self.timeout)

    def _gather(self, futs: dict) -> dict:
        """Wait for every future (issued together), then return their results or raise the first error."""
        cf.wait(list(futs.values()), timeout=self.timeout + 5)
        return {k: f.result(timeout=5) for k, f in futs.items()}

    def _on_loaders(self, method: str, args: Mapping[str, tuple] | None = None) -> dict:
        return self._gather({n: self._call(loader_actor(n), method, *((args or {}).get(n, ())))
                             for n in self.names})

    # ------------------------------------------------------------------------------ LocalJob API

    def add_feedback(self, step: int, values: Mapping[str, float]) -> None:
        if step < self._step:
            raise ConfigError(f"feedback for step {step} comes too late: step {self._step} is next to plan")
        self.feedback.append([int(step), {str(k): float(v) for k, v in values.items()}])

    @property
    def step_index(self) -> int:
        return self._step

    def step(self, ranks: Iterable[int] | None = None) -> StepResult:
        """Plan and build the next step for ``ranks`` (all ranks when None)."""
        metas = self._on_loaders("metadata")
        step = self._step
        due = [v for s, v in self.feedback if s == step]
        try:
            plan = self._call(PLANNER, "plan", [metas[n] for n in self.names], due).result(self.timeout + 5)
        except BufferShortageError as e:
            done = [n for n, ex in self._on_loaders("exhausted").items() if ex]
            if done:
                raise SourceExhausted(f"step {step}: source(s) {done} finished their configured epochs; the stream "
                                      f"ends here ({e})") from e
            raise
        self._step = step + 1
        self.feedback = [f for f in self.feedback if f[0] > step]
        recs = plan.records
        wanted_idx = {name: np.asarray(recs.index[recs.source_id == sid]).tolist()
                      for sid, name in enumerate(recs.sources)}
        wanted_idx = {n: i for n, i in wanted_idx.items() if i}
        taken = self._gather({n: self._call(loader_actor(n), "take", idx) for n, idx in wanted_idx.items()})
        samples = {(n, i): rec for n, got in taken.items() for i, rec in got.items()}
        wanted = list(range(self.mesh.world_size)) if ranks is None else [int(r) for r in ranks]
        outputs = self._call(CONSTRUCTOR, "build", plan, wanted, samples).result(self.timeout + 5)
        return StepResult(step, plan, outputs)

    def state_dict(self) -> dict:
        futs = {n: self._call(loader_actor(n), "get_state") for n in self.names}
        futs[None] = self._call(PLANNER, "state_dict")
        got = self._gather(futs)
        return {self.PLANNER: got.pop(None), self.LOADERS: {n: got[n] for n in self.names},
                self.FEEDBACK: [[s, dict(v)] for s, v in self.feedback]}

    def load_state_dict(self, state: Mapping) -> None:
        theirs, ours = set(state[self.LOADERS]), set(self.names)
        if theirs != ours:
            raise ConfigError(f"state has sources {sorted(theirs)}, this job has {sorted(ours)}")
        self._call(PLANNER, "load_state_dict", dict(state[self.PLANNER])).result(self.timeout + 5)
        self._step = int(state[self.PLANNER][Planner.STEP])
        self.feedback = [[int(s), dict(v)] for s, v in state.get(self.FEEDBACK, [])]
        self._on_loaders("reset", {n: (state[self.LOADERS][n],) for n in self.names})

    def stats(self) -> dict:
        """Per-source loader stats (asked of the actors), each role's process, and their memory."""
        sources = self._on_loaders("stats")
        actors = [PLANNER, CONSTRUCTOR] + [loader_actor(n) for n in self.names]
        if hasattr(self.transport, "worker_of"):
            pids = self.transport.worker_pids
            roles = {a: pids[self.transport.worker_of(a)] for a in actors}
        else:
            roles = {a: os.getpid() for a in actors}
        procs = {pid: process_memory(pid) for pid in sorted(set(roles.values()) | {os.getpid()})}
        return {"sources": sources, "roles": roles, "processes": procs}

    def close(self) -> None:
        """Close the loaders (bounded by the timeout, errors ignored), then stop our transport."""
        if self._closed:
            return
        self._closed = True
        try:
            futs = []
            for n in self.names:
                try:
                    futs.append(self.transport.call(loader_actor(n), "close", timeout=self.timeout))
                except Exception:        # noqa: BLE001 - the actor may never have started
                    pass
            cf.wait(futs, timeout=self.timeout + 5)
        finally:
            if self._own_transport:
                self.transport.stop()

    def __enter__(self) -> "RpcJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
