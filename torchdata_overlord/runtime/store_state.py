"""A job's state read back from its fault-tolerance checkpoint store, to restart from the data plane's
own checkpoints (under the same or another mesh) rather than from a trainer's ``state_dict()``.

The store holds, per planned step, the Planner's checkpoint (its state, the unplanned feedback, what
the step took from each source, how many steps every trainer had consumed) and, every
``snapshot_every`` steps, each source's state (see :mod:`.recovery_store`). The state after step
``k`` is the Planner's checkpoint at ``k`` and, per source, its last snapshot at or before ``k`` plus
a replay of what the steps since took: the replay reads and transforms those rows again, in this
process, on a copy of the source.
"""

from __future__ import annotations

from typing import Callable, Mapping

from ..errors import ConfigError, OverlordError
from ..roles.source_loader import SourceLoader
from .checkpoint_store import CheckpointStore
from .job_config import SourceSpec
from .recovery_store import PLANNER_KEY
from .step import JobState

__all__ = ["job_from_store"]


def job_from_store(root: str, sources: Mapping[str, object], buffer_size: Callable[[str], int],
                   step: int | None = None) -> tuple[int, dict, dict]:
    """``(step, job, saved config)`` from the store at ``root``: the state after ``step`` steps (default:
    the last step every trainer had reported consumed, which may be up to ``prefetch`` steps before what
    they really consumed: pass the step of your model checkpoint to resume exactly). ``sources`` (name ->
    Source) are replayed on copies; a source of the store not among them keeps its snapshot (it was
    removed: the resume drops it or refuses, see :mod:`~torchdata_overlord.elastic`)."""
    store = CheckpointStore(root)
    newest = store.latest(PLANNER_KEY)
    if newest is None:
        raise ConfigError(f"no Planner checkpoint in {root}: point checkpoint_dir at the folder a job with "
                          f"FaultTolerance(checkpoint_dir=...) wrote")
    kept = store.steps(PLANNER_KEY)
    at = min(int(newest[1]["released"]), newest[0]) if step is None else step
    if isinstance(at, bool) or not isinstance(at, int) or at not in kept:
        raise ConfigError(f"{root} has no Planner checkpoint at step {at!r} (it keeps steps {kept[0]}..{kept[-1]}: "
                          f"the steps since the oldest source snapshot); resume at one of those")
    ck = store.get(PLANNER_KEY, at)
    names = list(ck["consumed"])
    loaders = {}
    for name in names:
        snap = store.latest(f"loader/{name}", at_most=at)
        if snap is None:
            raise ConfigError(f"{root}: source {name!r} has no snapshot at or before step {at}")
        if name not in sources:
            loaders[name] = snap[1]
            continue
        try:
            consumed = [store.get(PLANNER_KEY, v)["consumed"].get(name, []) for v in range(snap[0] + 1, at + 1)]
        except (FileNotFoundError, OverlordError) as e:
            raise ConfigError(f"{root}: the consumption log of source {name!r} after its snapshot of step {snap[0]} "
                              f"is incomplete ({e}); resume at step {snap[0]} or from a trainer's state_dict()") from e
        spec = SourceSpec.from_source(sources[name])
        if spec.paths is None:
            raise ConfigError(f"source {name!r}: its state is replayed from the store here, which needs the source "
                              f"itself, not only its name")
        copy = spec.build()
        widest = max([buffer_size(name), *(len(c) for c in consumed)])
        loader = SourceLoader(copy, widest)
        try:
            loaders[name] = loader.replay(snap[1], consumed)
        finally:
            loader.close()
    planner = ck["planner"]
    job = {JobState.PLANNER: planner, JobState.LOADERS: loaders, JobState.FEEDBACK: ck["feedback"]}
    saved = {"sources": names, "seed": planner["seed"], "global_batch": planner["global_batch"],
             "mesh": planner["mesh"]}
    return at, job, saved
