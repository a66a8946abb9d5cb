"""Elastic resume: a loader state continued under another configuration, nothing lost or repeated.

**What a state carries** is placement-free: each source's consumed position (its row position, the
samples taken after it, the epochs it started), the schedule's position (the step), the mixer's
carried apportionment (each source's cumulative target and realised count, in samples), the trainer
feedback not yet planned, and the seed (a plan's randomness is a function of seed and step). **What is
re-derived** at the resume: the buckets, the Data Constructors and the routes (from the new
``ClientPlaceTree``), and the loaders' data-parallel parts. So a state saved under one mesh (any of PP,
DP, CP, TP), global batch, number of constructors or loader actors, or runtime continues under
another. A step-indexed schedule continues at the saved step; the mixer's cumulative targets grow by
the new global batch from there, so every source stays within one sample of its schedule.

**Consumed** means: a rank's ``state_dict()`` describes the steps that rank's trainer consumed
(``next()`` returned them). Every sample of a later step, planned, prefetched or already delivered to
other ranks, is back in its source's buffer in that state, and is planned again after the resume, for
the new mesh. Ranks of one job consume steps in lockstep and their states agree; where they do not (a
rank died mid-step), load the state with the fewest steps (:func:`earliest`) on every new rank: the
samples of the steps after it reach the ranks that had them once more, but none is lost. Every new
rank loads the same state.

**Sources changed** (opt in with ``sources_changed="allow"``): kept sources continue from their
positions, new ones start from their beginning, removed ones are dropped from the mixer's carried
counts and reported; the new strategy's schedule starts afresh at the saved step.
"""

from __future__ import annotations

import copy
from typing import Mapping, Sequence

from .errors import ConfigError
from .runtime.step import JobState

__all__ = ["ELASTIC", "adapt", "earliest", "SOURCES_CHANGED"]

ELASTIC = ("mesh", "global_batch")      # config entries a resume re-derives from
SOURCES_CHANGED = ("refuse", "allow")


def earliest(states: Sequence[Mapping]) -> Mapping:
    """Of several ranks' loader states, the one that consumed the fewest steps (see the module docstring)."""
    if not states:
        raise ConfigError("earliest() needs at least one loader state")
    return min(states, key=lambda s: s["step"] if isinstance(s, Mapping) and isinstance(s.get("step"), int) else -1)


def source_changes(saved: Sequence[str], now: Sequence[str], sources_changed: str) -> tuple[list, list]:
    """(removed, added) source names; a change needs ``sources_changed="allow"``."""
    if sources_changed not in SOURCES_CHANGED:
        raise ConfigError(f"sources_changed must be one of {SOURCES_CHANGED}, got {sources_changed!r}")
    removed = [s for s in saved if s not in now]
    added = [s for s in now if s not in saved]
    if (removed or added) and sources_changed != "allow":
        raise ConfigError(f"this state was saved with sources {list(saved)}, this loader has {list(now)} (removed: "
                          f"{removed}, added: {added}); pass load_state_dict(state, sources_changed='allow') to "
                          f"continue the kept sources from their positions and start the new ones from zero")
    return removed, added


def adapt(job: dict, step: int, saved: Mapping, config: Mapping, initial: Mapping) -> tuple[dict, list[str]]:
    """``job`` (checked against the ``saved`` config) for this loader's ``config``: the Planner's mesh and
    global batch replaced (the batch history kept, which bounds what the mixer may have drawn), each kept
    source's state as saved, new sources at their ``initial`` state, removed ones dropped everywhere.
    Returns the adapted job and what changed, in words."""
    job = copy.deepcopy(job)
    changes = []
    planner = job[JobState.PLANNER]
    if saved.get("mesh") != config["mesh"]:
        changes.append(f"mesh: saved {_mesh_text(saved.get('mesh'))}, now {_mesh_text(config['mesh'])} (buckets, "
                       f"constructors and routes re-derived)")
    planner["mesh"] = copy.deepcopy(config["mesh"])
    old_batch, batch = planner["global_batch"], config["global_batch"]
    if old_batch != batch:
        changes.append(f"global_batch: saved {old_batch}, now {batch} from step {step}")
        history = planner.get("batches") or [[0, old_batch]]
        planner["batches"] = history + [[step, batch]]
        planner["global_batch"] = batch
    removed = [s for s in saved["sources"] if s not in config["sources"]]
    added = [s for s in config["sources"] if s not in saved["sources"]]
    loaders = job[JobState.LOADERS]
    if removed or added:
        for s in removed:
            loaders.pop(s)
        for s in added:
            loaders[s] = copy.deepcopy(initial[JobState.LOADERS][s])
        for key, prim in planner["primitives"].items():
            if key.split("#")[0] != "mix":
                continue
            for part in ("target", "realised"):
                for s in removed:
                    prim.get("apportion", {}).get(part, {}).pop(s, None)
            prim.pop("schedule", None)                  # another source set: the strategy's schedule is new
        for entry in job[JobState.FEEDBACK]:
            for s in removed:
                entry[1].pop(s, None)
        changes.append(f"sources: removed {removed} (their positions dropped), added {added} (from their start)")
    job[JobState.LOADERS] = {s: loaders[s] for s in config["sources"]}
    return job, changes


def _mesh_text(mesh) -> str:
    """``pp=1 dp=4 cp=1 tp=1`` (and each attached module's sizes) of a ``ClientPlaceTree.to_dict()``."""
    if not isinstance(mesh, Mapping) or not isinstance(mesh.get("sizes"), Mapping):
        return repr(mesh)
    text = " ".join(f"{k}={v}" for k, v in mesh["sizes"].items())
    mods = mesh.get("modules") or {}
    return text + "".join(f"; {name}: {_mesh_text(m)}" for name, m in mods.items())


def batch_bound(planner: Mapping, step: int) -> int:
    """The samples ``step`` planned steps drew at most: each step one global batch, as the batch history says."""
    history = planner.get("batches") or [[0, planner.get("global_batch")]]
    total = 0
    for i, (start, batch) in enumerate(history):
        end = history[i + 1][0] if i + 1 < len(history) else step
        total += max(0, min(end, step) - start) * int(batch)
    return total
