"""Data-parallel Source Loaders (paper 5.1, "data parallel"): one source read by ``k`` loaders (parts).

Part ``j`` of ``k`` reads the units (row groups) at positions ``j, j+k, ...`` of each epoch's order
(:meth:`~torchdata_overlord.ParquetSource.shard`) into a buffer of its own. The Planner merges the
parts' buffers by read order and keeps the first ``buffer_size`` (:meth:`~..plane.records.BufferMeta.merge`),
and merges their states with :func:`merge_states`: both are exactly what one loader reading the
whole source would have, so the stream is a function of the seed, the configuration, the feedback
and the consumed position, never of ``k``. A merged state loads into any number of parts (each
keeps the units it reads), which is how a source is resharded live and resumed under another
placement.
"""

from __future__ import annotations

from .source_loader import SourceLoader

__all__ = ["part_key", "part_keys", "merge_states"]


def part_key(source: str, j: int, k: int) -> str:
    """The loader key of part ``j`` of ``k`` (the source's own name when it is not split)."""
    return source if k == 1 else f"{source}@{j}"


def part_keys(source: str, k: int) -> list[str]:
    return [part_key(source, j, k) for j in range(k)]


def merge_states(states: list[dict]) -> dict:
    """The state of one loader over the whole source, from the states of its parts ``0..k-1`` (in
    order): the earliest part's position, every unit a later part passed (whole, or the rows it read
    of the unit it stands in) as ``ahead``, and every part's out-of-order takes."""
    k = len(states)
    if k == 1:
        return states[0]
    S, T, E = SourceLoader.SOURCE_STATE, SourceLoader.TAKEN, SourceLoader.EPOCH_LOG
    srcs = [st[S] for st in states]
    n = int(srcs[0]["units"])
    pos = [(int(s["epoch"]) * n + int(s["unit"]), int(s["row"])) for s in srcs]
    m = min(range(k), key=lambda j: pos[j])
    g0, r0 = pos[m]
    ahead: dict[int, int] = {}

    def passed(g: int, rows: int) -> None:
        cur = ahead.get(g, 0)
        ahead[g] = -1 if rows < 0 or cur < 0 else max(cur, rows)

    for j, (src, (g, r)) in enumerate(zip(srcs, pos)):
        for ga, ra in src.get("ahead") or []:
            if ga >= g0:
                passed(int(ga), int(ra))
        if j == m:
            continue
        for u in range(g0 + 1, g):              # part j's own units before its position: all passed
            if u % n % k == j:
                passed(u, -1)
        if r:
            passed(g, r)
    floor = (g0 << 32) | r0
    taken = sorted({(int(i), int(o)) for st in states for i, o in st[T] if o < 0 or o >= floor})
    return {S: {**srcs[m], "ahead": [[g, r] for g, r in sorted(ahead.items())]},
            T: [list(t) for t in taken], E: sorted({e for st in states for e in st[E]})}
