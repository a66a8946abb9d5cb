"""Zig-zag context-parallel split, per sequence: exact inverse, right chunks per rank, every CP
rank an equal share of every sequence, balanced causal work.

Held positions and work are recomputed with plain Python loops, never with the code under test.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_overlord.transforms import (PER_TOKEN_FIELDS, causal_work, merge_packed, pack, packed_indices,
                                           pad_for_cp, split_packed, unpack, zigzag_merge, zigzag_split)

SETTINGS = settings(max_examples=50, deadline=None)
DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float32, torch.float16, torch.bfloat16,
          torch.float64]


def expected_positions(length, cp, rank, start=0):
    """Chunks rank and 2*cp-1-rank of 2*cp equal chunks of [start, start + length), in that order."""
    c = length // (2 * cp)
    return [start + rank * c + j for j in range(c)] + [start + (2 * cp - 1 - rank) * c + j for j in range(c)]


def row_positions(segs, seq_len, cp, rank):
    """What CP rank holds of a row packed with every sequence padded to a multiple of 2*cp (and the
    trailing padding entry): for each entry in order, its chunks rank and 2*cp-1-rank."""
    m = 2 * cp
    lengths = [-(-len(s) // m) * m for s in segs]
    total = sum(lengths)
    if seq_len is not None and seq_len > total:
        lengths.append(seq_len - total)
    out, start = [], 0
    for n in lengths:
        out += expected_positions(n, cp, rank, start)
        start += n
    return out


def random_tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
        if t.numel():
            t.view(-1)[0] = float("nan")  # bit-identical means NaNs too
        return t
    return torch.randint(0, 200, shape, generator=g).to(dtype)


def bits(t):
    """A view whose equality is bit equality (NaN-safe)."""
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


@st.composite
def packed_case(draw):
    segs = draw(st.lists(st.lists(st.integers(0, 1000), max_size=40), max_size=6))
    cp = draw(st.integers(1, 8))
    m = 2 * cp
    need = sum(-(-len(s) // m) * m for s in segs)
    seq_len = None if draw(st.booleans()) else need + m * draw(st.integers(0, 3))
    return segs, seq_len, cp


def packed_for(segs, seq_len, cp):
    """A row ready for a CP split: every sequence and the row padded to multiples of 2*cp."""
    return pack([torch.tensor(s, dtype=torch.int64) for s in segs], seq_len, pad_to_multiple=2 * cp,
                sequence_multiple=2 * cp)


@SETTINGS
@given(st.integers(1, 8), st.integers(0, 5), st.sampled_from(DTYPES), st.integers(0, 2**16),
       st.sampled_from([((), -1), ((3,), 1), ((), 0), ((2, 4), -2)]))
def test_merge_of_all_splits_is_bit_identical(cp, chunk, dtype, seed, layout):
    lead, dim = layout
    length = 2 * cp * chunk
    shape = (*lead, length) if dim in (-1, 1) or not lead else (lead[0], length, lead[1])
    t = random_tensor(shape, dtype, seed)
    shards = [zigzag_split(t, cp, r, dim=dim) for r in range(cp)]
    for r, s in enumerate(shards):
        assert s.dtype == dtype and s.shape[dim] == length // cp
        assert torch.equal(bits(s), bits(t.index_select(dim, torch.tensor(expected_positions(length, cp, r),
                                                                         dtype=torch.long))))
    merged = zigzag_merge(shards, dim=dim)
    assert merged.shape == t.shape and torch.equal(bits(merged), bits(t))


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 1000), max_size=20), max_size=6), st.integers(1, 8), st.integers(0, 9))
def test_pad_for_cp_repacks_every_sequence_to_a_multiple_of_2cp(segs, cp, extra):
    seq_len = sum(map(len, segs)) + extra
    p = pad_for_cp(pack([torch.tensor(s, dtype=torch.int64) for s in segs], seq_len), cp)
    m = 2 * cp
    cu, cu_p = p["cu_seqlens"].tolist(), p["cu_seqlens_padded"].tolist()
    assert all((b - a) % m == 0 for a, b in zip(cu_p, cu_p[1:]))
    assert [b - a for a, b in zip(cu, cu[1:])][:len(segs)] == [len(s) for s in segs]
    need = sum(-(-len(s) // m) * m for s in segs)
    assert len(p["input_ids"]) == -(-max(seq_len, need) // m) * m          # keeps at least the row's length
    assert [t.tolist() for t in unpack(p)] == segs
    assert p["loss_mask"].sum() == sum(max(len(s) - 1, 0) for s in segs)
    # the row splits over cp ranks, each holding its chunks of every entry
    for r in range(cp):
        assert split_packed(p, cp, r)["token_index"].tolist() == row_positions(segs, len(p["input_ids"]), cp, r)


@SETTINGS
@given(packed_case())
def test_split_packed_holds_the_zigzag_chunks_of_every_sequence_and_merges_back(case):
    segs, seq_len, cp = case
    p = packed_for(*case)
    n = len(p["input_ids"])
    shards = [split_packed(p, cp, r) for r in range(cp)]
    seen = []
    for r, s in enumerate(shards):
        want = row_positions(segs, n, cp, r)
        assert s["token_index"].tolist() == want
        assert int(s["cp_rank"]) == r and int(s["cp_size"]) == cp
        for k in PER_TOKEN_FIELDS:
            assert len(s[k]) == n // cp
            full = p[k].tolist()
            assert s[k].tolist() == [full[i] for i in want], k
        for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):       # stay global, as THD takes them
            assert s[k].tolist() == p[k].tolist()
        # positions in the shard are the per-sequence positions of the held tokens
        assert causal_work(s["token_index"], s["cu_seqlens_padded"]) == sum(x + 1 for x in s["position_ids"].tolist())
        seen += want
    assert sorted(seen) == list(range(n))
    merged = merge_packed(shards)
    assert set(merged) == set(p)
    for k in p:
        assert torch.equal(merged[k], p[k]) and merged[k].dtype == p[k].dtype, k


@SETTINGS
@given(packed_case())
def test_every_cp_rank_gets_an_equal_share_of_every_sequence(case):
    """The regression of issue 11 item 12: with the whole padded row zig-zagged, a CP rank could get
    nothing but padding. Per sequence, the real tokens (and trained labels) of any two CP ranks
    differ by at most 2*cp-1, the padding that sequence needed."""
    segs, _, cp = case
    p = packed_for(*case)
    shards = [split_packed(p, cp, r) for r in range(cp)]
    for k, s in enumerate(segs):
        real = [int((sh["segment_ids"] == k).sum()) for sh in shards]
        trained = [int(((sh["segment_ids"] == k) & sh["loss_mask"]).sum()) for sh in shards]
        assert sum(real) == len(s) and sum(trained) == max(len(s) - 1, 0)
        assert max(real) - min(real) <= 2 * cp - 1, (k, real)
        assert max(trained) - min(trained) <= 2 * cp, (k, trained)
        if len(s) >= 2 * cp:
            assert min(real) > 0            # a sequence of at least 2*cp tokens reaches every rank


@SETTINGS
@given(st.integers(2, 8), st.integers(1, 64))
def test_zigzag_balances_causal_work_single_segment(cp, chunk):
    length = 2 * cp * chunk
    per_rank = length // cp

    def work(positions):
        return sum(i + 1 for i in positions)

    zig = [causal_work(split_packed(pack([torch.arange(length)], None), cp, r)["token_index"]) for r in range(cp)]
    assert packed_indices(torch.tensor([0, length]), cp, 0).tolist() == expected_positions(length, cp, 0)
    assert zig == [work(expected_positions(length, cp, r)) for r in range(cp)]
    naive = [causal_work(torch.arange(r * per_rank, (r + 1) * per_rank)) for r in range(cp)]
    assert naive == [work(range(r * per_rank, (r + 1) * per_rank)) for r in range(cp)]
    zig_spread, naive_spread = max(zig) - min(zig), max(naive) - min(naive)
    assert zig_spread <= chunk
    assert naive_spread >= (cp - 1) * per_rank * per_rank  # last rank's extra (cp-1)*s per token
    assert max(naive) >= 2 * min(naive) and naive_spread > zig_spread


def test_causal_work_restarts_per_segment_and_skips_padding():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)  # an empty segment in the middle
    assert causal_work(torch.arange(7), cu) == (1 + 2 + 3) + (1 + 2 + 3 + 4)
    assert causal_work(torch.tensor([2, 3]), cu) == 3 + 1
    real = torch.tensor([0, 2, 2, 5], dtype=torch.int32)  # 1 padding token after each sequence
    assert causal_work(torch.arange(7), cu, real) == (1 + 2) + (1 + 2 + 3)


@SETTINGS
@given(st.lists(st.integers(1, 200), min_size=1, max_size=6), st.integers(2, 4))
def test_per_sequence_zigzag_balances_causal_work_of_a_packed_row(lengths, cp):
    """Each rank's causal work on every sequence is within one chunk's worth of the others'."""
    p = packed_for([[1] * n for n in lengths], None, cp)
    works = [causal_work(split_packed(p, cp, r)["token_index"], p["cu_seqlens_padded"], p["cu_seqlens"])
             for r in range(cp)]
    assert sum(works) == sum(n * (n + 1) // 2 for n in lengths)
    # bound, from the layout: per sequence of padded length P (chunk c = P / 2cp) every rank's work
    # would be c^2 (2cp - 1) + c (c + 1); padding removes at most 2*cp-1 positions of <= P each
    slack = sum((2 * cp - 1) * (-(-n // (2 * cp)) * 2 * cp) for n in lengths)
    assert max(works) - min(works) <= slack


@pytest.mark.parametrize("cp,rank", [(0, 0), (-1, 0), (2, 2), (2, -1), (3, 5)])
def test_bad_cp_or_rank_raise(cp, rank):
    t = torch.arange(24)
    with pytest.raises(ValueError, match="cp"):
        zigzag_split(t, cp, rank)
    with pytest.raises(ValueError):
        split_packed(pack([t], None), cp, rank)


def test_indivisible_length_says_pad_for_cp():
    p = pack([torch.arange(10)], None)
    with pytest.raises(ValueError, match="pad_for_cp"):
        split_packed(p, 3, 0)
    with pytest.raises(ValueError, match="pad_for_cp"):
        zigzag_split(torch.zeros(2, 10), 2, 0, dim=1)
    assert len(split_packed(pad_for_cp(p, 3), 3, 0)["input_ids"]) == 4
    with pytest.raises(ValueError):
        pad_for_cp(p, 0)
    # a row of the right length whose sequences are not padded to 2*cp: the entry is named
    q = pack([torch.arange(3), torch.arange(5)], None)
    with pytest.raises(ValueError, match=r"entry 0 .* 3 tokens long, not a multiple of 2\*cp=4.*sequence_multiple=4"):
        split_packed(q, 2, 0)


def test_merge_rejects_bad_shards():
    with pytest.raises(ValueError):
        zigzag_merge([])
    with pytest.raises(ValueError):
        zigzag_merge([torch.zeros(4), torch.zeros(6)])
    p = pack([torch.arange(8)], None)
    with pytest.raises(ValueError, match="ordered"):
        merge_packed([split_packed(p, 2, 1), split_packed(p, 2, 0)])


@SETTINGS
@given(st.integers(1, 5), st.lists(st.lists(st.integers(0, 12), max_size=6), max_size=4), st.integers(0, 3))
def test_zigzag_chunks_lay_out_every_rows_shards_rank_by_rank(cp, rows, start_chunks):
    """The constructor splits all rows of a build for all CP ranks at once by ``_zigzag_chunks``: row
    by row, rank r's run of it must be exactly rank r's held positions of that row (recomputed per
    sequence with plain loops), and one row's positions are ``packed_indices``."""
    import numpy as np

    from torchdata_overlord.transforms.cp_split import _zigzag_chunks

    lengths = [2 * cp * c for chunks in rows for c in chunks]
    row = [i for i, chunks in enumerate(rows) for _ in chunks]
    entry, start, size = _zigzag_chunks(np.asarray(lengths, np.int64), np.asarray(row, np.int64), cp, np.arange(cp))
    got = [(int(e), int(a), int(z)) for e, a, z in zip(entry, start, size)]
    want, first = [], 0
    for chunks in rows:
        for r in range(cp):
            for j in range(first, first + len(chunks)):
                c = lengths[j] // (2 * cp)
                want += [(j, r * c, c), (j, (2 * cp - 1 - r) * c, c)]
        first += len(chunks)
    assert got == want
    cu = [2 * cp * start_chunks]
    for c in (rows[0] if rows else []):
        cu.append(cu[-1] + 2 * cp * c)
    for r in range(cp):
        expected = [p for a, b in zip(cu, cu[1:]) for p in expected_positions(b - a, cp, r, start=a)]
        assert packed_indices(torch.tensor(cu), cp, r).tolist() == expected
