"""Zig-zag context-parallel split: exact inverse, right chunks per rank, balanced causal work.

Held positions and work are recomputed with plain Python loops, never with the code under test.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_overlord.transforms import (PER_TOKEN_FIELDS, causal_work, merge_packed, pack, pad_for_cp,
                                           split_packed, unpack, zigzag_merge, zigzag_split)

SETTINGS = settings(max_examples=50, deadline=None)
DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float32, torch.float16, torch.bfloat16,
          torch.float64]


def expected_positions(length, cp, rank):
    """Chunks rank and 2*cp-1-rank of 2*cp equal chunks, in that order."""
    c = length // (2 * cp)
    return [rank * c + j for j in range(c)] + [(2 * cp - 1 - rank) * c + j for j in range(c)]


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
    segs = draw(st.lists(st.lists(st.integers(0, 1000), max_size=20), max_size=6))
    cp = draw(st.integers(1, 8))
    seq_len = None if draw(st.booleans()) else sum(map(len, segs)) + draw(st.integers(0, 9))
    return segs, seq_len, cp


def packed_for(segs, seq_len, cp):
    return pad_for_cp(pack([torch.tensor(s, dtype=torch.int64) for s in segs], seq_len), cp)


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
@given(packed_case())
def test_pad_for_cp_keeps_pack_contract(case):
    segs, seq_len, cp = case
    p = packed_for(*case)
    n = len(p["input_ids"])
    base = pack([torch.tensor(s, dtype=torch.int64) for s in segs], seq_len)
    n0 = len(base["input_ids"])
    assert n % (2 * cp) == 0 and n0 <= n < n0 + 2 * cp
    for k in PER_TOKEN_FIELDS:  # prefix untouched
        assert p[k][:n0].tolist() == base[k][:n0].tolist()
    assert p["loss_mask"][n0:].sum() == 0 and (p["labels"][n0:] == -100).all() and (p["segment_ids"][n0:] == -1).all()
    assert [t.tolist() for t in unpack(p)] == segs
    # same as packing straight to the padded length (one trailing padding segment, positions counting on)
    direct = pack([torch.tensor(s, dtype=torch.int64) for s in segs], n)
    assert {k: v.tolist() for k, v in p.items()} == {k: v.tolist() for k, v in direct.items()}


@SETTINGS
@given(packed_case())
def test_split_packed_holds_the_zigzag_chunks_and_merges_back(case):
    _, _, cp = case
    p = packed_for(*case)
    n = len(p["input_ids"])
    shards = [split_packed(p, cp, r) for r in range(cp)]
    seen = []
    for r, s in enumerate(shards):
        want = expected_positions(n, cp, r)
        assert s["token_index"].tolist() == want
        assert int(s["cp_rank"]) == r and int(s["cp_size"]) == cp
        for k in PER_TOKEN_FIELDS:
            assert len(s[k]) == n // cp
            full = p[k].tolist()
            assert s[k].tolist() == [full[i] for i in want], k
        assert s["cu_seqlens"].tolist() == p["cu_seqlens"].tolist() and int(s["max_seqlen"]) == int(p["max_seqlen"])
        # positions in the shard are the per-segment positions of the held global tokens
        assert causal_work(s["token_index"], s["cu_seqlens"]) == sum(x + 1 for x in s["position_ids"].tolist())
        seen += want
    assert sorted(seen) == list(range(n))
    merged = merge_packed(shards)
    assert set(merged) == set(p)
    for k in p:
        assert torch.equal(merged[k], p[k]) and merged[k].dtype == p[k].dtype, k
    for k in PER_TOKEN_FIELDS:
        assert torch.equal(zigzag_merge([s[k] for s in shards]), p[k])


@SETTINGS
@given(st.integers(2, 8), st.integers(1, 64))
def test_zigzag_balances_causal_work_single_segment(cp, chunk):
    length = 2 * cp * chunk
    per_rank = length // cp

    def work(positions):
        return sum(i + 1 for i in positions)

    zig = [causal_work(split_packed(pack([torch.arange(length)], None), cp, r)["token_index"]) for r in range(cp)]
    assert zig == [work(expected_positions(length, cp, r)) for r in range(cp)]
    naive = [causal_work(torch.arange(r * per_rank, (r + 1) * per_rank)) for r in range(cp)]
    assert naive == [work(range(r * per_rank, (r + 1) * per_rank)) for r in range(cp)]
    zig_spread, naive_spread = max(zig) - min(zig), max(naive) - min(naive)
    assert zig_spread <= chunk
    assert naive_spread >= (cp - 1) * per_rank * per_rank  # last rank's extra (cp-1)*s per token
    assert max(naive) >= 2 * min(naive) and naive_spread > zig_spread


def test_causal_work_restarts_per_segment():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)  # an empty segment in the middle
    assert causal_work(torch.arange(7), cu) == (1 + 2 + 3) + (1 + 2 + 3 + 4)
    assert causal_work(torch.tensor([2, 3]), cu) == 3 + 1


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


def test_merge_rejects_bad_shards():
    with pytest.raises(ValueError):
        zigzag_merge([])
    with pytest.raises(ValueError):
        zigzag_merge([torch.zeros(4), torch.zeros(6)])
    p = pack([torch.arange(8)], None)
    with pytest.raises(ValueError, match="ordered"):
        merge_packed([split_packed(p, 2, 1), split_packed(p, 2, 0)])
