"""Shared helpers for the data-plane tests: buffers, graphs and independent reference computations.

Nothing here calls the code under test to compute an expected value: costs, bounds and
coordinates are recomputed from first principles.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np

import torchdata_overlord as ol
from torchdata_overlord.plane.dgraph import PlanContext

AXES = ("pp", "dp", "cp", "tp")


def make_buffers(tokens_by_source: dict, images_by_source: dict | None = None) -> list[ol.BufferMeta]:
    """One BufferMeta per source; sample indices start at 1000 * (source number) to keep keys distinct."""
    out = []
    for i, (name, toks) in enumerate(tokens_by_source.items()):
        toks = np.asarray(toks, np.int64)
        idx = 1000 * i + np.arange(len(toks))
        if images_by_source and name in images_by_source:
            per = np.asarray(images_by_source[name], np.int64).reshape(len(toks), -1)
            out.append(ol.BufferMeta(name, idx, toks, num_images=(per > 0).sum(1), patches=per.sum(1),
                                     patches_sq=(per.astype(np.float64) ** 2).sum(1)))
        else:
            out.append(ol.BufferMeta(name, idx, toks))
    return out


def graph(mesh, tokens_by_source: dict, step: int = 0, seed: int = 0, global_batch: int | None = None,
          images_by_source: dict | None = None) -> ol.DGraph:
    """A DGraph over the given buffers, as the Planner would build it (no mix: every row is sampled)."""
    ctx = PlanContext(mesh, step=step, seed=seed, global_batch=global_batch)
    return ol.DGraph.from_buffers(make_buffers(tokens_by_source, images_by_source), ctx)


def tokens_of(kind: str, n: int, seed: int) -> np.ndarray:
    """Token counts drawn from a named distribution (test-side generator, independent of sim/)."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.integers(1, 4000, n)
    if kind == "pareto":          # heavy tail: most short, a few very long
        return np.minimum((256 * (rng.pareto(1.1, n) + 1)).astype(np.int64), 200_000)
    if kind == "constant":
        return np.full(n, 777, np.int64)
    if kind == "bimodal":
        return np.where(rng.random(n) < 0.1, rng.integers(20_000, 60_000, n), rng.integers(1, 300, n))
    if kind == "with_zeros":
        t = rng.integers(0, 3000, n)
        t[rng.random(n) < 0.3] = 0
        return t
    raise ValueError(kind)


def flops(tokens, hidden: int = 4096, ffn_mult: float = 4.0) -> np.ndarray:
    """AttentionFlops written out by hand: 4 h L^2 + 2 L (4 + 2 f) h^2."""
    L = np.asarray(tokens, np.float64)
    return 4.0 * hidden * L * L + 2.0 * L * (4.0 + 2.0 * ffn_mult) * hidden * hidden


def brute_coords(sizes: dict, order: tuple) -> list[dict]:
    """Coordinates of every rank, row-major over ``order`` (outermost first), by enumeration."""
    return [dict(zip(order, c)) for c in itertools.product(*(range(sizes[a]) for a in order))]


def entry_frame(plan) -> list[dict]:
    """Every plan entry as a dict (key, bucket, mb, tokens, cost, piece, npieces, shard, nshards)."""
    e = plan.entries
    keys = plan.records.keys(e["row"])
    cols = ("bucket", "mb", "tokens", "cost", "piece", "npieces", "shard", "nshards")
    return [dict(key=k, **{c: e[c][i].item() for c in cols}) for i, k in enumerate(keys)]


def per_bin(plan, values_of_entry) -> np.ndarray:
    """(microbatch, bucket) sums of a per-entry value, accumulated entry by entry in Python."""
    out = np.zeros((plan.n_microbatches, len(plan.buckets)))
    for ent, v in zip(entry_frame(plan), values_of_entry):
        out[ent["mb"], ent["bucket"]] += v
    return out


def lockstep(bins: np.ndarray) -> float:
    """Lockstep step cost: every microbatch index waits for its slowest bucket."""
    return float(sum(max(row) for row in bins.tolist())) if bins.size else 0.0


def assert_valid_permutation(plan, dropped=()) -> None:
    """Every sampled key, minus the dropped ones, is planned exactly once (first piece, first shard)."""
    expected = Counter(plan.sampled_keys())
    for k in dropped:
        expected[k] -= 1
        assert expected[k] == 0, f"dropped key {k} was not sampled exactly once"
        del expected[k]
    assert plan.planned_keys() == expected
    assert all(c == 1 for c in plan.planned_keys().values())


def assert_pieces_complete(plan) -> None:
    """Each (sample, piece) has shards 0..nshards-1 exactly once; each sample pieces 0..npieces-1."""
    pieces: dict = {}
    shards: dict = {}
    for ent in entry_frame(plan):
        pieces.setdefault(ent["key"], set()).add((ent["piece"], ent["npieces"]))
        shards.setdefault((ent["key"], ent["piece"]), []).append((ent["shard"], ent["nshards"]))
    for key, ps in pieces.items():
        npieces = {n for _, n in ps}
        assert len(npieces) == 1, f"{key}: inconsistent npieces {npieces}"
        assert sorted(p for p, _ in ps) == list(range(npieces.pop())), f"{key}: pieces {sorted(ps)}"
    for kp, ss in shards.items():
        ns = {n for _, n in ss}
        assert len(ns) == 1, f"{kp}: inconsistent nshards {ns}"
        assert sorted(s for s, _ in ss) == list(range(ns.pop())), f"{kp}: shards {sorted(ss)}"


def parse_key(text: str) -> ol.SampleKey:
    """``"source:index"`` (as in ``stats["oversize"]["dropped_keys"]``) back to a SampleKey."""
    source, index = text.rsplit(":", 1)
    return ol.SampleKey(source, int(index))


def dropped_keys(plan) -> list:
    return [parse_key(k) for k in plan.stats["oversize"]["dropped_keys"]]


def floor_ceil(n: int, b: int) -> set:
    return {n // b, math.ceil(n / b)}


def zigzag_bins(costs: np.ndarray, n_bins: int) -> np.ndarray:
    """Zig-Zag: items by cost, largest first, dealt over the bins in snake order 0..k-1, k-1..0, ..."""
    order = np.argsort(-np.asarray(costs), kind="stable")
    pos = np.arange(len(order))
    row, col = pos // n_bins, pos % n_bins
    bins = np.empty(len(order), np.int64)
    bins[order] = np.where(row % 2 == 0, col, n_bins - 1 - col)
    return bins


def numbered_parquet(d, seed: int, rows: tuple[int, int], row_groups: tuple[int, int], files: int = 3) -> str:
    """``files`` Parquet files in ``d`` of one int column ``n`` numbering every row across them, each of
    ``rows`` rows and row groups of ``row_groups`` rows (random ranges, uneven); their glob."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng, n = np.random.default_rng(seed), 0
    for f in range(files):
        k = int(rng.integers(*rows))
        pq.write_table(pa.table({"n": np.arange(n, n + k)}), d / f"f{f}.parquet", row_group_size=int(rng.integers(*row_groups)))
        n += k
    return str(d / "*.parquet")
