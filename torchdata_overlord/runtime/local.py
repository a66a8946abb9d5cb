"""The embedded runtime: Source Loaders, Planner and Data Constructors in the caller's process.

One step follows the paper's lazy workflow: the loaders report buffer metadata, the Planner
plans, the loaders hand over (stage) exactly the planned samples, and the Data Constructors
build what each requested client receives; loaders refill on the next metadata request. The
plan is a pure function of the state, so every trainer rank running its own LocalJob plans the
same step without talking to the others and builds only its own bucket.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np

from ..errors import BufferShortageError, ConfigError, OverlordError
from ..plane.place_tree import ClientPlaceTree
from ..plane.plan import Plan
from ..plane.records import SampleKey
from ..roles.constructor import DataConstructor
from ..roles.planner import Planner
from ..roles.source_loader import SourceLoader
from .procstats import process_memory

__all__ = ["LocalJob", "SourceExhausted", "StepResult"]


def source_settings(names: list[str]) -> Callable:
    """Check the source names; returns ``get(value, name, default)`` for settings given as one value
    for every source or as a ``{source: value}`` dict (unknown names refused)."""
    if not names:
        raise ConfigError("a job needs at least one source")
    if len(set(names)) != len(names):
        raise ConfigError(f"source names must be unique, got {names}")

    def get(value, name, default):
        if isinstance(value, Mapping):
            unknown = set(value) - set(names)
            if unknown:
                raise ConfigError(f"settings name unknown sources {sorted(unknown)}; sources are {names}")
            return value.get(name, default)
        return default if value is None else value
    return get


class SourceExhausted(OverlordError, StopIteration):
    """A source configured with a finite number of epochs ran out: the stream ends here."""


@dataclass
class StepResult:
    step: int
    plan: Plan | None
    outputs: dict            # rank -> what that client receives (see DataConstructor.build)
    state: dict | None = None   # the job's state after this step (from ``submit``)


class LocalJob:
    """All roles of one job in this process.

    ``buffer_size`` (default: the global batch, enough for any mixture) and ``workers`` may be an
    int for every source or a ``{source: int}`` dict, so a slow image source gets more workers.
    """

    PLANNER, LOADERS, FEEDBACK = "planner", "loaders", "feedback"

    def __init__(self, sources: Iterable, strategy: Callable, mesh: ClientPlaceTree, global_batch: int,
                 seq_len: int | None, seed: int = 0, buffer_size: int | Mapping[str, int] | None = None,
                 workers: int | Mapping[str, int] = 0, image_token_id: int | None = None, pad_id: int = 0,
                 ignore_index: int = -100):
        sources = list(sources)
        per_source = source_settings([s.name for s in sources])
        self.mesh = mesh
        self.planner = Planner(strategy, mesh, global_batch, seed=seed)
        self.loaders = {s.name: SourceLoader(s, per_source(buffer_size, s.name, global_batch),
                                             per_source(workers, s.name, 0), image_token_id) for s in sources}
        self.constructor = DataConstructor(seq_len, pad_id=pad_id, ignore_index=ignore_index,
                                           image_token_id=image_token_id)
        self.feedback: list[list] = []      # [step, {source: value}] waiting for the plan of that step

    def add_feedback(self, step: int, values: Mapping[str, float]) -> None:
        """Queue trainer feedback for the dynamic schedules of step ``step`` (not yet planned)."""
        if step < self.planner.step:
            raise ConfigError(f"feedback for step {step} comes too late: step {self.planner.step} is next to plan")
        self.feedback.append([int(step), {str(k): float(v) for k, v in values.items()}])

    @property
    def step_index(self) -> int:
        return self.planner.step

    def step(self, ranks: Iterable[int] | None = None) -> StepResult:
        """Plan and build the next step for ``ranks`` (all ranks when None)."""
        metas = [loader.metadata() for loader in self.loaders.values()]
        step = self.planner.step
        due = [v for s, v in self.feedback if s == step]
        try:
            plan = self.planner.plan(metas, feedback=due)
        except BufferShortageError as e:
            done = [n for n, l in self.loaders.items() if l.exhausted]
            if done:
                raise SourceExhausted(f"step {step}: source(s) {done} finished their configured epochs; the stream "
                                      f"ends here ({e})") from e
            raise
        self.feedback = [f for f in self.feedback if f[0] > step]
        samples = self._stage(plan)
        wanted = range(self.mesh.world_size) if ranks is None else list(ranks)
        outputs = {}
        for b in sorted({plan.bucket_of(r) for r in wanted}):
            built = self.constructor.build(plan, b, samples)
            outputs.update({r: built[r] for r in wanted if r in built})
        return StepResult(step, plan, outputs)

    def submit(self, ranks: Iterable[int] | None = None, consumed: int | None = None) -> cf.Future:
        """The next step with the job's state after it, as a completed future (RpcJob's interface;
        ``consumed`` only matters where several clients share the roles)."""
        out: cf.Future = cf.Future()
        try:
            res = self.step(ranks)
            res.state = self.state_dict()
            out.set_result(res)
        except BaseException as e:          # noqa: BLE001 - delivered through the future
            out.set_exception(e)
        return out

    def _stage(self, plan: Plan) -> dict:
        """Take every sampled record of the step out of its loader (dropped ones too: consumed)."""
        recs = plan.records
        samples = {}
        for sid, name in enumerate(recs.sources):
            idx = recs.index[recs.source_id == sid]
            if len(idx):
                for i, rec in self.loaders[name].take(np.asarray(idx).tolist()).items():
                    samples[SampleKey(name, i)] = rec
        return samples

    def state_dict(self) -> dict:
        return {self.PLANNER: self.planner.state_dict(),
                self.LOADERS: {n: l.get_state() for n, l in self.loaders.items()},
                self.FEEDBACK: [[s, dict(v)] for s, v in self.feedback]}

    def load_state_dict(self, state: Mapping) -> None:
        theirs, ours = set(state[self.LOADERS]), set(self.loaders)
        if theirs != ours:
            raise ConfigError(f"state has sources {sorted(theirs)}, this job has {sorted(ours)}")
        self.planner.load_state_dict(state[self.PLANNER])
        self.feedback = [[int(s), dict(v)] for s, v in state.get(self.FEEDBACK, [])]
        for n, l in self.loaders.items():
            l.reset(state[self.LOADERS][n])

    def stats(self) -> dict:
        """Per-source loader stats, and every role's process (all this one) with its memory."""
        mem = process_memory()
        return {"sources": {n: l.stats() for n, l in self.loaders.items()},
                "roles": {**{f"loader:{n}": mem["pid"] for n in self.loaders}, "planner": mem["pid"],
                          "constructor": mem["pid"]},
                "processes": {mem["pid"]: mem}}

    def close(self) -> None:
        for l in self.loaders.values():
            l.close()
