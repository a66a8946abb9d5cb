"""Source profiling (paper 5.1): a source's per-sample transform cost P and memory M, measured on the
source itself before the job starts, leaving its position exactly as it was.

Times are CPU seconds of the profiling thread (``time.thread_time``), not wall time: sources are
profiled in parallel threads, and under the GIL a wall clock would charge one source's transform with
the others'. CPU seconds are also the unit the partitioner budgets (cores). Work a transform or a
reader hands to other threads (pyarrow's decode pool, torch intra-op threads) is not counted.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable

from ..roles.source_loader import record_bytes
from ..sources.base import SKIPPED
from ..sources.parquet import ParquetSource

__all__ = ["SourceProfile", "profile_source", "profile_sources", "source_key", "METHOD_VERSION"]

log = logging.getLogger("torchdata_overlord")

METHOD_VERSION = 2     # bump when what a profile measures changes: older journal entries then miss
                       # (2: P is the mean, not the median: a heavy tail of long texts is most of the cost)
MIN_ROWS = 4           # rows profiled even past the time limit: one row is no estimate
ROWS_PER_JOB = 4096    # rows profiled over all of a job's unjournaled sources: 128 each up to 32 sources,
ROWS_FLOOR = 16        # fewer for more (300 sources: 16 each), so a first start-up stays seconds long


@dataclass(frozen=True)
class SourceProfile:
    """What partitioning needs to know about one source (times in seconds, sizes in bytes).

    ``transform_s`` (P): mean CPU time of the transform per sample, the first call (which loads the
    transform's models) left out; ``read_s``: CPU time per raw row
    read, a row group's decode spread over its rows; ``sample_bytes``: mean bytes of a transformed
    sample; ``group_bytes`` (M): decoded Arrow bytes of one row group of the projected columns;
    ``rows``: rows per epoch (None: unknown); ``units``: row groups, what data-parallel actors split;
    ``splittable``: whether it can be split into actors by row groups; ``measured_rows``: rows read;
    ``skipped``: of those, rows whose transform failed; ``key``: the journal key (None: not journaled).
    """

    name: str
    transform_s: float
    read_s: float
    sample_bytes: int
    group_bytes: int
    rows: int | None
    units: int
    splittable: bool
    measured_rows: int
    key: str | None = None
    skipped: int = 0

    @property
    def cost_s(self) -> float:
        """CPU seconds one sample costs its loader: read plus transform."""
        return self.transform_s + self.read_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SourceProfile":
        """The profile ``to_dict`` wrote; KeyError/TypeError on anything else."""
        if not isinstance(d, dict):
            raise TypeError(f"a SourceProfile dict is a dict, got {type(d).__name__}")
        return cls(**{f.name: d[f.name] for f in fields(cls)})


def source_key(source) -> str | None:
    """The journal key: a hash of the source's file fingerprint (name, seed, columns, [path, bytes, rows]
    per file), its transform (type and ``repr``, memory addresses removed) and :data:`METHOD_VERSION`.
    None for a source without a fingerprint (a NodeSource: nothing tells when its data changed)."""
    fingerprint = source.state_dict().get("fingerprint")
    if fingerprint is None:
        return None
    t = getattr(source, "transform", None)
    transform = [f"{type(t).__module__}.{type(t).__qualname__}", re.sub(r" at 0x[0-9a-fA-F]+", "", repr(t))]
    blob = json.dumps({"fingerprint": fingerprint, "transform": transform, "method": METHOD_VERSION},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _layout(source) -> tuple[int, int]:
    """(units a data-parallel split can share out, bytes of a row group when known without reading it:
    0, the profile measures it). A source that cannot be split is one unit."""
    return (max(int(source.units), 1), 0) if isinstance(source, ParquetSource) else (1, 0)


def profile_source(source, rows: int = 128, time_limit: float = 2.0) -> SourceProfile:
    """Read and transform up to ``rows`` rows of ``source`` (stopping after ``time_limit`` seconds once
    :data:`MIN_ROWS` are done), then put it back where it was (its state and ``rows_passed``).

    A row whose transform fails counts as skipped; a read error ends the profile (the loader raises it
    when it reads there)."""
    state, passed = copy.deepcopy(source.state_dict()), source.rows_passed
    counts_decodes = hasattr(source, "reads")            # ParquetSource/FileSource count row-group decodes
    read_plain, plain_calls, read_decode, decodes, group_bytes = 0.0, 0, 0.0, 0, 0
    apply_times, ok_times, sizes = [], [], []
    deadline = time.perf_counter() + time_limit
    try:
        while len(apply_times) < rows and (len(apply_times) < MIN_ROWS or time.perf_counter() < deadline):
            reads, t0 = getattr(source, "reads", 0), time.thread_time()
            try:
                _, row, where = source.next_raw()
            except StopIteration:
                break
            except Exception as e:  # noqa: BLE001 - a read error is the source's to raise when it is read
                log.debug("source %r: profiling stopped at a read error (%s)", source.name, e)
                break
            t1 = time.thread_time()
            if counts_decodes and source.reads > reads:
                read_decode, decodes = read_decode + t1 - t0, decodes + source.reads - reads
                group_bytes = max(group_bytes, source.buffer_bytes)
            else:
                read_plain, plain_calls = read_plain + t1 - t0, plain_calls + 1
            t1 = time.thread_time()
            try:
                out = source.apply(row, where)
            except Exception:  # noqa: BLE001 - a failing row is skipped here, as under on_error="skip"
                out = SKIPPED
            t2 = time.thread_time()
            apply_times.append(t2 - t1)
            if out is not SKIPPED:
                ok_times.append(t2 - t1)
                sizes.append(record_bytes(out))
    finally:
        source.load_state_dict(state)
        source.rows_passed = passed
    units, known_bytes = _layout(source)
    total_rows = getattr(source, "num_rows", None)
    group_rows = total_rows / units if total_rows else 1
    read_s = read_plain / max(plain_calls, 1) + (read_decode / decodes / group_rows if decodes else 0.0)
    return SourceProfile(
        name=source.name, transform_s=_per_sample(ok_times or apply_times), read_s=read_s,
        sample_bytes=int(statistics.fmean(sizes)) if sizes else 0, group_bytes=int(group_bytes or known_bytes),
        rows=total_rows, units=units, splittable=isinstance(source, ParquetSource), measured_rows=len(apply_times),
        key=source_key(source), skipped=len(apply_times) - len(ok_times))


def _per_sample(times: list[float]) -> float:
    """Mean CPU seconds per sample after the first call (a tokenizer or decoder loads then, once). The
    mean, not the median: what a loader spends per step is the sum, and with heavy-tailed text lengths
    the median sample costs a fraction of the mean one."""
    times = times[1:] if len(times) > 1 else times
    return statistics.fmean(times) if times else 0.0


def profile_sources(sources: Iterable[Any], journal=None, rows: int | None = None, time_limit: float = 2.0,
                    threads: int | None = None) -> dict[str, SourceProfile]:
    """Every source's profile, by name in the given order: the journal's where its key matches, else
    measured (in parallel, ``threads`` defaulting to min(8, sources)) and written to the journal.
    ``rows`` per source defaults to :data:`ROWS_PER_JOB` shared out (between :data:`ROWS_FLOOR` and 128)."""
    sources = list(sources)
    if rows is None:
        rows = max(ROWS_FLOOR, min(128, ROWS_PER_JOB // max(len(sources), 1)))

    def one(source) -> SourceProfile:
        found = journal.get(source) if journal is not None else None
        if found is not None:
            return found
        profile = profile_source(source, rows, time_limit)
        if journal is not None:
            journal.put(profile)
        return profile

    if not sources:
        return {}
    with ThreadPoolExecutor(threads or min(8, len(sources)), thread_name_prefix="overlord-profile") as pool:
        return {p.name: p for p in pool.map(one, sources)}
