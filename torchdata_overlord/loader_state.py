"""The OverlordLoader's checkpoint format: build it, and check a loaded one as a whole.

A state is ``{"version", "config", "step", "job", "checksum"}``: the loader's configuration (with the
strategy's mixture), the consumed step, the roles' state as one JSON string (so the dict's structure
is the same for every loader of a configuration, as ``torch.distributed.checkpoint`` needs) and the
SHA-256 of that string. :func:`unpack` refuses, with one :class:`ConfigError` naming the first
inconsistency, anything that is not such a state of this configuration, before any role sees it.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Mapping

from .errors import ConfigError
from .runtime.step import JobState

__all__ = ["FORMAT", "pack", "unpack"]

FORMAT = 2                    # 2: checksum of the job part, the strategy's mixture in the config
VERSION, CONFIG, STEP, JOB, CHECKSUM = "version", "config", "step", "job", "checksum"
MIXTURE = "mixture"           # the config entry a resume may change with strict=False
FIX = "load a state this loader's configuration wrote, unmodified"


def checksum(job: str) -> str:
    return hashlib.sha256(job.encode()).hexdigest()


def pack(config: dict, step: int, job: dict) -> dict:
    """The state of ``job`` (the roles' state) after ``step`` consumed steps: plain types only."""
    text = json.dumps(job, sort_keys=True)
    return {VERSION: FORMAT, CONFIG: config, STEP: step, JOB: text, CHECKSUM: checksum(text)}


def _bad(where: str, what: str) -> ConfigError:
    return ConfigError(f"not a valid OverlordLoader state: {where} {what}; {FIX}")


def _count(value, where: str, at_least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise _bad(where, f"is {value!r:.80}, not an integer >= {at_least}")
    return value


def _of(value, kind: type, where: str):
    if not isinstance(value, kind):
        raise _bad(where, f"is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _keys(value: Mapping, keys, where: str) -> None:
    missing = [k for k in keys if k not in value]
    if missing:
        raise _bad(where, f"lacks {missing} (has {sorted(value)})")


def unpack(state, config: Mapping, strict: bool = True) -> tuple[int, dict, list[str]]:
    """Check ``state`` against this loader's ``config``; returns (step, job, changes). ``changes``
    lists a changed mixture, accepted only with ``strict=False``; anything else inconsistent raises."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"not an OverlordLoader state: expected the dict OverlordLoader.state_dict() returns, "
                          f"got {type(state).__name__}")
    version = state.get(VERSION)
    if version != FORMAT:
        if isinstance(version, int) and not isinstance(version, bool) and version < FORMAT:
            raise ConfigError(f"this OverlordLoader state has format version {version}, written by an older "
                              f"torchdata_overlord; this one reads version {FORMAT} (which adds a checksum and the "
                              f"strategy's mixture): resume with the release that wrote it, or start afresh")
        raise ConfigError(f"not an OverlordLoader state of format version {FORMAT}: 'version' is {version!r:.40} "
                          f"(keys {sorted(map(str, state))})")
    _keys(state, (CONFIG, STEP, JOB, CHECKSUM), "the state")
    theirs = _of(state[CONFIG], Mapping, "'config'")
    step = _count(state[STEP], "'step'")
    text = _of(state[JOB], str, "'job'")
    if checksum(text) != state[CHECKSUM]:
        raise _bad("'job'", f"({len(text)} characters) does not match its checksum: it was truncated, corrupted or "
                            f"edited")
    diffs = [f"{k}: saved {theirs.get(k)!r}, now {v!r}" for k, v in config.items()
             if k != MIXTURE and theirs.get(k) != v]
    if diffs:
        raise ConfigError("this state comes from another loader configuration: " + "; ".join(diffs))
    try:
        job = json.loads(text)
    except ValueError as e:
        raise _bad("'job'", f"is not JSON ({e})") from None
    check_job(_of(job, dict, "'job'"), step, config)
    changes = []
    if theirs.get(MIXTURE) != config[MIXTURE]:
        change = f"the strategy's mixture: saved {theirs.get(MIXTURE)}, now {config[MIXTURE]}"
        if strict:
            raise ConfigError(f"this state was saved with another strategy ({change}); a changed mixture is "
                              f"another sample stream. Resume with the saved strategy, or pass "
                              f"load_state_dict(state, strict=False) to continue from the saved position with the "
                              f"new one")
        changes.append(change)
    return step, job, changes


def check_job(job: dict, step: int, config: Mapping) -> None:
    """The roles' parts agree with each other, with the consumed ``step`` and with ``config``."""
    _keys(job, (JobState.PLANNER, JobState.LOADERS, JobState.FEEDBACK), "'job'")
    planner = _of(job[JobState.PLANNER], dict, "job.planner")
    _keys(planner, ("step", "seed", "global_batch", "mesh", "primitives"), "job.planner")
    planned = _count(planner["step"], "job.planner.step")
    if planned != step:
        raise _bad("job.planner.step", f"is {planned} but the state's 'step' is {step}: its parts come from "
                                       f"different points of a run")
    for key in ("seed", "global_batch", "mesh"):
        if planner[key] != json.loads(json.dumps(config[key])):
            raise _bad(f"job.planner.{key}", f"is {planner[key]!r:.80}, but the state's config has {config[key]!r:.80}")
    for key, prim in _of(planner["primitives"], dict, "job.planner.primitives").items():
        _check_mix(key, prim, step, config["global_batch"])
    loaders = _of(job[JobState.LOADERS], dict, "job.loaders")
    if sorted(loaders) != sorted(config["sources"]):
        raise _bad("job.loaders", f"has sources {sorted(loaders)}, the config {sorted(config['sources'])}")
    for name, part in loaders.items():
        where = f"job.loaders[{name!r}]"
        _keys(_of(part, dict, where), ("source", "taken", "epochs_started"), where)
        _of(part["source"], dict, f"{where}.source")
        for i, index in enumerate(_of(part["taken"], list, f"{where}.taken")):
            _count(index, f"{where}.taken[{i}]")
        epochs = [_count(e, f"{where}.epochs_started[{i}]")
                  for i, e in enumerate(_of(part["epochs_started"], list, f"{where}.epochs_started"))]
        if not epochs or epochs != sorted(epochs):
            raise _bad(f"{where}.epochs_started", f"is {epochs}, not a non-empty increasing list")
    for i, entry in enumerate(_of(job[JobState.FEEDBACK], list, "job.feedback")):
        where = f"job.feedback[{i}]"
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], dict)):
            raise _bad(where, f"is {entry!r:.80}, not [step, {{source: value}}]")
        _count(entry[0], f"{where}[0]", at_least=step)
        for k, v in entry[1].items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise _bad(f"{where}[1][{k!r}]", f"is {v!r:.40}, not a finite number")


def _check_mix(key: str, prim, step: int, global_batch: int) -> None:
    """A mixer draws ``global_batch`` samples per planned step at most: its counts bound the step."""
    where = f"job.planner.primitives[{key!r}]"
    _of(prim, dict, where)
    if not key.split("#")[0] == "mix" or "apportion" not in prim:
        return
    realised = _of(_of(prim["apportion"], dict, f"{where}.apportion").get("realised", {}), dict,
                   f"{where}.apportion.realised")
    drawn = sum(_count(v, f"{where}.apportion.realised[{k!r}]") for k, v in realised.items())
    if drawn > step * global_batch:
        raise _bad(where, f"has drawn {drawn} samples, more than {step} steps of {global_batch} can: the planner's "
                          f"step and its mixer disagree")
