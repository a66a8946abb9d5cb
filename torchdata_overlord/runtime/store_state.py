"""A job's state read back from its fault-tolerance checkpoint store, to restart from the data plane's
own checkpoints (under the same or another mesh) rather than from a trainer's ``state_dict()``.

The store holds, per planned step, the Planner's checkpoint (its state, the unplanned feedback, the
feedback its plan used, the leader's prefetch, what the step took from each source, how many steps
every trainer had consumed) and, every ``snapshot_every`` steps, each source's state (see
:mod:`.recovery_store`). The state after step ``k`` is the Planner's checkpoint at ``k``; per source,
its last snapshot at or before ``k`` plus a replay of what the steps since took (the replay reads and
transforms those rows again, in this process, on a copy of the source); and the feedback the trainer
had given by consuming ``k`` steps, for plans after ``k``: feedback given after consuming ``c`` steps
weighs the plan of ``c + prefetch``, so it is what the plans of steps ``k .. k + prefetch`` used, taken
from their checkpoints. A plan the store does not have yet (the job stopped before it) may lack
feedback the trainer gave; the resume then says so.
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
                   step: int | None = None) -> tuple[int, dict, dict, list[str]]:
    """``(step, job, saved config, changes in words)`` from the store at ``root``: the state after ``step``
    steps (default: the last step every trainer had reported consumed, which may be up to ``prefetch`` steps before what
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
    feedback, changes = _feedback_by(store, at, kept)
    job = {JobState.PLANNER: planner, JobState.LOADERS: loaders, JobState.FEEDBACK: feedback}
    saved = {"sources": names, "seed": planner["seed"], "global_batch": planner["global_batch"],
             "mesh": planner["mesh"]}
    return at, job, saved, changes


def _feedback_by(store: CheckpointStore, at: int, kept: list[int]) -> tuple[list, list[str]]:
    """The feedback the trainer had given by consuming ``at`` steps, for the plans of ``at`` and later
    (``[step, values]`` entries, in the order given), and what the store cannot tell, in words."""
    records = {v: store.get(PLANNER_KEY, v) for v in kept if v >= at}
    newest = records[kept[-1]]
    if any("applied" not in r for r in records.values()):
        # written before the store recorded the feedback each plan used: only what was unplanned at `at`
        return records[at]["feedback"], ["feedback: this store was written by an older version, which did not record "
                                          "the feedback each plan used; if the job gave feedback(), the plans after "
                                          "the resumed step use only what was not yet planned when it was checkpointed"]
    # (the checkpoint of step 0 may predate the leader's attach, which tells the prefetch)
    prefetch = next((r["prefetch"] for r in reversed(records.values()) if r.get("prefetch") is not None), None)
    if prefetch is None:
        return records[at]["feedback"], []
    feedback, unplanned = [], []
    for t in range(at, at + int(prefetch) + 1):
        if t + 1 in records:                             # planned: what its plan used
            feedback += [[t, dict(values)] for _, values in records[t + 1]["applied"]]
        else:                                            # not planned when the job stopped: what it had heard
            feedback += [[s, dict(values)] for s, values in newest["feedback"] if s == t]
            unplanned.append(t)
    used = any(r["applied"] or r["feedback"] for r in records.values())
    # feedback given after consuming c steps (all of it, however many calls) reaches the Planner together, with the
    # trainer's next request: a step the store heard of is complete; one it did not may have been lost with the job
    unheard = [t for t in unplanned if not any(s == t for s, _ in feedback)]
    if unheard and used:
        p = int(prefetch)
        exact = kept[-1] - p - 1
        fixes = ([f"resume at step {exact} or earlier (the store keeps steps {kept[0]}..{kept[-1]})"]
                 if exact >= kept[0] else []) + \
                (["give the feedback of the last step consumed again with feedback() right after this call (it counts "
                  "after the loaded step)"] if unheard == [at + p] else [])
        return feedback, [f"feedback: the store has none for the plans of steps {unheard}, which were not made before "
                          f"the job stopped: if the trainer gave feedback after consuming {[t - p for t in unheard]} "
                          f"steps, it never reached the store" +
                          (f". For the exact stream, {' or '.join(fixes)}" if fixes else "")]
    return feedback, []
