"""The OverlordLoader's checkpoint format: build it, and check a loaded one as a whole.

A state is ``{"version", "config", "step", "job", "checksum"}``: the loader's configuration (with the
strategy's mixture, each transform described and the sha256 of its model file), the consumed step, the
roles' state as one JSON string (so the dict's structure is the same for every loader of a configuration,
as ``torch.distributed.checkpoint`` needs) and the SHA-256 of that string. :func:`unpack` refuses, with
one :class:`ConfigError` naming the first inconsistency, anything that is not such a state of this
configuration, before any role sees it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from typing import Mapping

from .elastic import ELASTIC, batch_bound, source_changes
from .errors import ConfigError, a_type
from .runtime.step import JobState

__all__ = ["FORMAT", "pack", "unpack", "transform_spec", "transform_files"]

log = logging.getLogger("torchdata_overlord")

FORMAT = 2                    # 2: checksum of the job part, the strategy's mixture in the config
VERSION, CONFIG, STEP, JOB, CHECKSUM = "version", "config", "step", "job", "checksum"
MIXTURE = "mixture"           # the config entry a resume may change with strict=False
PREFETCH = "prefetch"         # how far feedback leads its plan: a change is reported, not refused
TRANSFORMS = "transforms"     # each source's transform, described: a change needs strict=False too
TRANSFORM_FILES = "transform_files"   # each source's transform's model file, {path: sha256}: a moved copy is the same
FIX = "load a state this loader's configuration wrote, unmodified"


def transform_spec(source) -> str | None:
    """A source's transform as the config records it: its type and ``repr`` (memory addresses removed,
    so an object without a ``__repr__`` of its own still describes itself the same in every process)."""
    t = getattr(source, "transform", None)
    if t is None:
        return None
    return f"{type(t).__module__}.{type(t).__qualname__}: {re.sub(r' at 0x[0-9a-fA-F]+', '', repr(t))}"


_sha256_of: dict[tuple, str] = {}      # (path, size, mtime_ns) -> sha256 of the file's content


def transform_files(source) -> dict[str, str] | None:
    """``{path: sha256}`` of the sentencepiece model a source's :class:`~torchdata_overlord.Tokenize` or
    :class:`~torchdata_overlord.ImageText` transform loads (its ``model``), None for another transform (its
    files, if any, are unknown here: a model of GBs is not hashed at every start). The config records it
    beside :func:`transform_spec`, whose ``repr`` holds the path: a state then also loads when that file
    moved (the same content at another path), as its sources' files may (see ``ParquetSource``)."""
    from .transforms import ImageText, Tokenize

    t = getattr(source, "transform", None)
    path = t.model if isinstance(t, (Tokenize, ImageText)) else None
    if not isinstance(path, str) or not os.path.isfile(path):
        return None
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    if key not in _sha256_of:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        _sha256_of[key] = h.hexdigest()
    return {path: _sha256_of[key]}


def _moved_model(saved: str, now: str, saved_files, now_files) -> tuple[list[tuple[str, str]], str]:
    """Whether transform spec ``saved`` is ``now`` but for model files that moved (the same sha256 at another
    path): ``([(old path, new path), ...], "")`` if so; else ``([], why)``, ``why`` saying what about the model
    files differs when that is known (else "")."""
    if not now_files:
        return [], ""
    if not saved_files:
        moved = [p for p in now_files if repr(p) not in saved]
        return [], (f"; this state was saved by an earlier release, which did not record the content of the "
                    f"transform's model file, so {moved[0]} cannot be told to be the state's moved: if it is, "
                    f"pass strict=False" if moved else "")
    by_digest = {d: p for p, d in now_files.items()}
    pairs, renamed = [], saved
    for p, d in saved_files.items():
        q = by_digest.get(d)
        if q is None:
            other = next(iter(now_files.items()))
            return [], (f"; its model file differs: saved {p} (sha256 {str(d)[:12]}), now {other[0]} "
                        f"(sha256 {other[1][:12]})")
        if q != p:
            pairs.append((p, q))
            renamed = renamed.replace(repr(p), repr(q))
    return (pairs, "") if pairs and renamed == now else ([], "")


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
        raise _bad(where, f"is {a_type(value)}, not {a_type(kind.__name__)}")
    return value


def _keys(value: Mapping, keys, where: str) -> None:
    missing = [k for k in keys if k not in value]
    if missing:
        raise _bad(where, f"lacks {missing} (has {sorted(value)})")


def unpack(state, config: Mapping, strict: bool = True,
           sources_changed: str = "refuse") -> tuple[int, dict, dict, list[str]]:
    """Check ``state`` against this loader's ``config``; returns (step, job, the saved config, changes).
    The mesh and global batch may differ (an elastic resume, :mod:`~torchdata_overlord.elastic`); the
    sources only with ``sources_changed="allow"``; ``changes`` lists a changed mixture or transform,
    accepted only with ``strict=False`` (or with the sources changed); anything else inconsistent raises.
    A transform that differs only in the path of a model file of the same content (moved) is the same, and
    logged; a state without those contents (an earlier release's) needs ``strict=False`` for it."""
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
                            f"edited, or (saved with torch.distributed.checkpoint) it mixes the states of trainer ranks "
                            f"that differ: ranks saved after different numbers of steps, or that gave feedback() "
                            f"different values or only some of them. Save every rank at the same step with the same "
                            f"feedback; ranks whose states differ are saved per rank (torch.save) and resumed from "
                            f"ol.elastic.earliest() of them")
    diffs = [f"{k}: saved {theirs.get(k)!r}, now {v!r}" for k, v in config.items()
             if k not in (MIXTURE, TRANSFORMS, TRANSFORM_FILES, PREFETCH, "sources", *ELASTIC) and theirs.get(k) != v]
    if diffs:
        raise ConfigError("this state comes from another loader configuration: " + "; ".join(diffs) +
                          "; build the loader with the saved values to resume")
    _keys(theirs, ("sources", *ELASTIC), "'config'")
    saved_sources = [str(x) for x in _of(theirs["sources"], list, "config.sources")]
    removed, added = source_changes(saved_sources, config["sources"], sources_changed)
    try:
        job = json.loads(text)
    except ValueError as e:
        raise _bad("'job'", f"is not JSON ({e})") from None
    check_job(_of(job, dict, "'job'"), step, theirs)
    changes = []
    dynamic = bool(job.get(JobState.FEEDBACK)) or '"Dynamic"' in str(config.get(MIXTURE))
    if theirs.get(PREFETCH) is not None and theirs[PREFETCH] != config.get(PREFETCH) and dynamic:
        changes.append(f"prefetch: saved {theirs[PREFETCH]}, now {config.get(PREFETCH)}: feedback() given from here "
                       f"weighs the plan {config.get(PREFETCH)} steps after it, not {theirs[PREFETCH]}, so a dynamic "
                       f"schedule's stream differs from the uninterrupted run")
    if theirs.get(MIXTURE) != config[MIXTURE]:
        change = f"the strategy's mixture: saved {theirs.get(MIXTURE)}, now {config[MIXTURE]}"
        if strict and not (removed or added):
            raise ConfigError(f"this state was saved with another strategy ({change}); a changed mixture is "
                              f"another sample stream. Resume with the saved strategy, or pass "
                              f"load_state_dict(state, strict=False) to continue from the saved position with the "
                              f"new one")
        changes.append(change)
    saved_t, now_t = theirs.get(TRANSFORMS) or {}, config.get(TRANSFORMS) or {}
    saved_f, now_f = theirs.get(TRANSFORM_FILES) or {}, config.get(TRANSFORM_FILES) or {}
    for name in sorted(set(saved_t) & set(now_t)):
        change, why = None, ""
        if saved_t[name] != now_t[name]:
            moved, why = _moved_model(saved_t[name], now_t[name], saved_f.get(name), now_f.get(name))
            if moved:                   # the same model file at another path: the same samples
                log.info("source %r's transform: its model file moved (the same content): %s", name,
                         "; ".join(f"{a} -> {b}" for a, b in moved))
                continue
            change = f"source {name!r}'s transform: saved {saved_t[name]}, now {now_t[name]}"
        elif isinstance(saved_f.get(name), dict) and now_f.get(name) and saved_f[name] != now_f[name]:
            # the same description, another model at the same path (retrained): other token ids
            change = (f"source {name!r}'s transform: its model file changed in place ("
                      + "; ".join(f"{p}: saved sha256 {str(saved_f[name].get(p))[:12]}, now {d[:12]}"
                                  for p, d in now_f[name].items()) + ")")
        if change is not None:
            if strict:
                raise ConfigError(f"this state was saved with another transform ({change}{why}); its samples would "
                                  f"differ from those planned before. Resume with the saved transform, or pass "
                                  f"load_state_dict(state, strict=False) if the change is intended")
            changes.append(change)
    return step, job, dict(theirs), changes


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
        if planner[key] != json.loads(json.dumps(config.get(key))):
            raise _bad(f"job.planner.{key}", f"is {planner[key]!r:.80}, but the state's config has "
                                             f"{config.get(key)!r:.80}")
    if "batches" in planner:
        _check_batches(planner["batches"], planner["global_batch"], planned)
    drawn_at_most = batch_bound(planner, step)
    for key, prim in _of(planner["primitives"], dict, "job.planner.primitives").items():
        _check_mix(key, prim, step, drawn_at_most)
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


def _check_batches(history, batch: int, step: int) -> None:
    """The global batch history an elastic resume wrote: ``[[0, b0], [s1, b1], ...]``, steps increasing
    up to ``step``, ending with the current ``batch``."""
    where = "job.planner.batches"
    _of(history, list, where)
    starts = [_count(_of(h, list, f"{where}[{i}]")[0] if len(h) == 2 else -1, f"{where}[{i}][0]")
              for i, h in enumerate(history)]
    for i, h in enumerate(history):
        _count(h[1], f"{where}[{i}][1]", at_least=1)
    if not history or starts[0] != 0 or starts != sorted(starts) or starts[-1] > step or history[-1][1] != batch:
        raise _bad(where, f"is {history!r:.80}: not [[0, batch], [step, batch], ...] up to step {step} ending with the "
                          f"global batch {batch}")


def _check_mix(key: str, prim, step: int, drawn_at_most: int) -> None:
    """A mixer draws one global batch of samples per planned step: ``drawn_at_most`` over ``step`` steps."""
    where = f"job.planner.primitives[{key!r}]"
    _of(prim, dict, where)
    if not key.split("#")[0] == "mix" or "apportion" not in prim:
        return
    realised = _of(_of(prim["apportion"], dict, f"{where}.apportion").get("realised", {}), dict,
                   f"{where}.apportion.realised")
    drawn = sum(_count(v, f"{where}.apportion.realised[{k!r}]") for k, v in realised.items())
    if drawn > drawn_at_most:
        raise _bad(where, f"has drawn {drawn} samples, more than {step} steps ({drawn_at_most} samples) can: the "
                          f"planner's step and its mixer disagree")
