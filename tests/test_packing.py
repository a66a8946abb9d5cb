"""pack/unpack/attention masks: labels stay inside segments, positions restart, padding is ignored.

Expected values come from plain Python loops over the input lists, never from the code under test.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_overlord.errors import ConfigError, OversizeSampleError
from torchdata_overlord.transforms import attention_mask_from_segments, pack, unpack

IGN = -100
PAD = 7
SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def pack_case(draw):
    """Random segments (empty ones included), a per-sequence multiple, and a seq_len/pad_to_multiple
    pair that fits them."""
    segs = draw(st.lists(st.lists(st.integers(0, 50_000), max_size=24), max_size=8))
    smult = draw(st.sampled_from([1, 1, 2, 4, 6]))
    total = sum(-(-len(s) // smult) * smult for s in segs)
    mult = draw(st.integers(1, 8))
    if draw(st.booleans()):
        seq_len = None
    else:
        seq_len = -(-(total + draw(st.integers(0, 12))) // mult) * mult
    return segs, seq_len, mult, smult


def reference(segs, seq_len, mult, smult=1):
    """pack()'s contract, token by token: each sequence padded to a multiple of smult, then the row."""
    padded = [-(-len(s) // smult) * smult for s in segs]
    total = sum(padded)
    length = seq_len if seq_len is not None else -(-total // mult) * mult
    ids, labels, mask, pos, seg_ids, cu, cu_p = [], [], [], [], [], [0], [0]
    for k, (s, p) in enumerate(zip(segs, padded)):
        for j in range(p):
            real = j < len(s)
            ids.append(s[j] if real else PAD)
            labels.append(s[j + 1] if j + 1 < len(s) else IGN)
            mask.append(j + 1 < len(s))
            pos.append(j)
            seg_ids.append(k if real else -1)
        cu.append(cu[-1] + len(s))
        cu_p.append(cu_p[-1] + p)
    pad = length - total
    for j in range(pad):
        ids.append(PAD), labels.append(IGN), mask.append(False), pos.append(j), seg_ids.append(-1)
    if pad:                         # the trailing padding entry: real length 0
        cu.append(cu[-1])
        cu_p.append(length)
    return dict(input_ids=ids, labels=labels, loss_mask=mask, position_ids=pos, segment_ids=seg_ids,
                cu_seqlens=cu, cu_seqlens_padded=cu_p, max_seqlen=max(map(len, segs), default=0))


def run_pack(segs, seq_len, mult, smult=1):
    return pack([torch.tensor(s, dtype=torch.int64) for s in segs], seq_len, pad_id=PAD, ignore_index=IGN,
                pad_to_multiple=mult, sequence_multiple=smult)


@SETTINGS
@given(pack_case())
def test_pack_matches_reference(case):
    segs, seq_len, mult, smult = case
    out = run_pack(*case)
    ref = reference(*case)
    assert set(out) == set(ref)
    for k, v in ref.items():
        assert out[k].tolist() == v, k
    assert out["cu_seqlens"].dtype == out["cu_seqlens_padded"].dtype == torch.int32 and out["max_seqlen"].dim() == 0
    assert out["loss_mask"].dtype == torch.bool and out["input_ids"].dtype == torch.int64
    length = len(ref["input_ids"])
    assert length % mult == 0 and (seq_len is None or length == seq_len)
    if seq_len is None:
        assert length - sum(-(-len(s) // smult) * smult for s in segs) < mult  # padding-free up to the multiple


@SETTINGS
@given(pack_case())
def test_labels_never_cross_segments_and_positions_restart(case):
    out = run_pack(*case)
    ids, lab, m = out["input_ids"].tolist(), out["labels"].tolist(), out["loss_mask"].tolist()
    seg, pos = out["segment_ids"].tolist(), out["position_ids"].tolist()
    n = len(ids)
    for i in range(n):
        if m[i]:
            assert i + 1 < n and seg[i] == seg[i + 1] and seg[i] >= 0 and lab[i] == ids[i + 1]
        else:
            assert lab[i] == IGN
        last_of_segment = i + 1 == n or seg[i + 1] != seg[i]
        if last_of_segment:
            assert not m[i] and lab[i] == IGN
        if seg[i] < 0:  # padding: never trained on
            assert not m[i] and lab[i] == IGN and ids[i] == PAD
    # positions restart at every entry of the row and count on through a sequence's own padding
    cu_p = out["cu_seqlens_padded"].tolist()
    assert pos == [i - a for a, b in zip(cu_p, cu_p[1:]) for i in range(a, b)]


@SETTINGS
@given(pack_case())
def test_cu_seqlens_consistent_with_segment_ids(case):
    segs = case[0]
    out = run_pack(*case)
    cu, cu_p, seg = out["cu_seqlens"].tolist(), out["cu_seqlens_padded"].tolist(), out["segment_ids"].tolist()
    assert cu_p[0] == cu[0] == 0 and cu_p[-1] == len(seg) and all(a <= b for a, b in zip(cu_p, cu_p[1:]))
    assert len(cu) == len(cu_p) and len(cu) - 1 in (len(segs), len(segs) + 1)
    padded = len(cu) - 1 == len(segs) + 1
    for k, (a, b) in enumerate(zip(cu_p, cu_p[1:])):
        n = cu[k + 1] - cu[k]                  # real tokens first, then this entry's padding
        want = -1 if padded and k == len(segs) else k
        assert 0 <= n <= b - a and all(seg[i] == want for i in range(a, a + n))
        assert all(seg[i] == -1 for i in range(a + n, b))
    if padded:
        assert cu_p[-1] > cu_p[-2] and cu[-1] == cu[-2]  # a padding entry only with padding; never attended
    assert cu[-1] == sum(map(len, segs)) == sum(s >= 0 for s in seg)
    assert int(out["max_seqlen"]) == max((b - a for a, b in zip(cu, cu[1:])), default=0)


@SETTINGS
@given(pack_case())
def test_unpack_inverts_pack(case):
    segs = case[0]
    assert [t.tolist() for t in unpack(run_pack(*case))] == segs


@SETTINGS
@given(pack_case().filter(lambda c: sum(map(len, c[0])) <= 40))
def test_block_diagonal_mask(case):
    out = run_pack(*case)
    seg = out["segment_ids"].tolist()
    mask = attention_mask_from_segments(out["segment_ids"])
    assert mask.dtype == torch.bool and mask.shape == (len(seg), len(seg))
    got = mask.tolist()
    for i in range(len(seg)):
        for j in range(len(seg)):
            assert got[i][j] == (seg[i] == seg[j] and j <= i)


@SETTINGS
@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), st.integers(1, 30))
def test_seq_len_overflow_names_total_and_seq_len(lengths, short_by):
    total = sum(lengths)
    seq_len = max(total - short_by, 0)
    with pytest.raises(OversizeSampleError, match=rf"\b{total} tokens.*seq_len={seq_len}\b"):
        pack([torch.ones(n, dtype=torch.int64) for n in lengths], seq_len)
    assert issubclass(OversizeSampleError, ValueError)


def test_empty_input():
    out = pack([], None)
    assert {k: v.tolist() for k, v in out.items()} == dict(
        input_ids=[], labels=[], loss_mask=[], position_ids=[], segment_ids=[], cu_seqlens=[0],
        cu_seqlens_padded=[0], max_seqlen=0)
    out = pack([], 4, pad_id=3, ignore_index=-1)
    assert {k: v.tolist() for k, v in out.items()} == dict(
        input_ids=[3] * 4, labels=[-1] * 4, loss_mask=[False] * 4, position_ids=[0, 1, 2, 3],
        segment_ids=[-1] * 4, cu_seqlens=[0, 0], cu_seqlens_padded=[0, 4], max_seqlen=0)
    assert unpack(out) == []
    assert pack([], None, pad_to_multiple=8)["input_ids"].numel() == 0


def test_exact_fit_has_no_padding_entry_and_other_int_dtypes_are_accepted():
    out = pack([torch.tensor([5, 6], dtype=torch.int32), torch.tensor([9], dtype=torch.int16)], 3)
    assert out["cu_seqlens"].tolist() == out["cu_seqlens_padded"].tolist() == [0, 2, 3]
    assert out["labels"].tolist() == [6, -100, -100]
    assert out["input_ids"].dtype == torch.int64


@pytest.mark.parametrize("kwargs", [dict(seq_len=6, pad_to_multiple=4), dict(seq_len=None, pad_to_multiple=0),
                                    dict(seq_len=-1), dict(seq_len=None, sequence_multiple=0),
                                    dict(seq_len=None, padded_lengths=[1]), dict(seq_len=None, padded_lengths=[2, 2])])
def test_bad_lengths_raise(kwargs):
    with pytest.raises(ConfigError):
        pack([torch.tensor([1, 2])], **kwargs)


@pytest.mark.parametrize("bad", [torch.tensor([1.0, 2.0]), torch.ones(2, 2, dtype=torch.int64),
                                 torch.tensor([True, False])])
def test_non_token_tensors_raise(bad):
    with pytest.raises(ConfigError, match=r"sequences\[1\]"):
        pack([torch.tensor([1]), bad], None)


def test_padding_is_never_attended_and_max_seqlen_is_the_longest_real_sequence():
    """The padding of a packed row is no sequence of its own: a varlen kernel given cu_seqlens and
    max_seqlen does no work on it (before, cu_seqlens [0, 3, 16] and max_seqlen 13 for 3 real tokens)."""
    out = pack([torch.tensor([5, 6, 7])], 16)
    assert out["cu_seqlens"].tolist() == [0, 3, 3] and out["cu_seqlens_padded"].tolist() == [0, 3, 16]
    assert int(out["max_seqlen"]) == 3
    out = pack([torch.tensor([5, 6, 7]), torch.tensor([8])], 16, sequence_multiple=4)
    assert out["cu_seqlens"].tolist() == [0, 3, 4, 4] and out["cu_seqlens_padded"].tolist() == [0, 4, 8, 16]
    assert out["input_ids"].tolist()[:8] == [5, 6, 7, 0, 8, 0, 0, 0]
    assert out["segment_ids"].tolist()[:8] == [0, 0, 0, -1, 1, -1, -1, -1]
    assert out["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3] + list(range(8))
    assert int(out["max_seqlen"]) == 3


def test_padded_lengths_place_each_sequence():
    out = pack([torch.tensor([1, 2]), torch.tensor([3])], None, padded_lengths=[3, 1])
    assert out["input_ids"].tolist() == [1, 2, 0, 3] and out["cu_seqlens_padded"].tolist() == [0, 3, 4]
    assert out["cu_seqlens"].tolist() == [0, 2, 3] and out["labels"].tolist() == [2, -100, -100, -100]
    assert [t.tolist() for t in unpack(out)] == [[1, 2], [3]]


def test_a_pack_is_not_changed_by_later_packs_on_this_or_another_thread():
    """pack reuses per-thread scratch arrays for its intermediates (tokens and next-token labels): its outputs
    must never be views of them, or the next call (a larger one that grows the scratch, or a smaller one that
    does not) would overwrite a row already handed out."""
    import threading

    first = pack([torch.arange(1, 6), torch.arange(10, 13)], None, pad_id=0, sequence_multiple=4)
    kept = {k: v.clone() for k, v in first.items()}
    pack([torch.arange(100, 130)], 64, pad_id=7)                  # larger: grows the scratch
    pack([torch.arange(50, 52)], None, pad_id=9)                    # smaller: reuses it
    t = threading.Thread(target=pack, args=([torch.arange(200, 240)], None))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    for k, v in kept.items():
        assert torch.equal(first[k], v), k
    assert first["input_ids"].tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 10, 11, 12, 0]
    assert first["labels"].tolist() == [2, 3, 4, 5, -100, -100, -100, -100, 11, 12, -100, -100]
