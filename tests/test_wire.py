"""The RPC wire format (runtime/wire.py): a call's objects pickled, its CPU tensors in one buffer."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torchdata_overlord.runtime.wire import pack, unpack

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    t = (torch.rand(shape, generator=gen) * 100).to(dtype) if shape != (0,) else torch.empty(0, dtype=dtype)
    how = draw(st.sampled_from(["plain", "transposed", "permuted", "slice"]))
    if how == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1)                      # not contiguous
    elif how == "permuted" and t.dim() >= 2:
        t = t.permute(draw(st.permutations(range(t.dim()))))   # one dense block in another order
    elif how == "slice" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1:]                                  # a view at an offset into a larger storage
    return t


payloads = st.recursive(st.one_of(tensors(), st.integers(), st.text(max_size=5), st.none()),
                        lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                st.dictionaries(st.text(max_size=3), inner, max_size=4)),
                        max_leaves=12)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and (b.is_contiguous() or b.stride() == a.stride())
                and torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b.view(torch.uint8)
                                if b.dtype == torch.bool else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@settings(max_examples=150, deadline=None)
@given(payloads)
def test_pack_then_unpack_gives_back_every_object_and_tensor(obj):
    data, buffer = pack(obj)
    assert same(unpack(data, buffer), obj)


def test_every_tensor_travels_in_one_buffer_and_comes_back_as_a_view_of_it():
    obj = {"mb": [{"input_ids": torch.arange(7), "mask": torch.ones(3, dtype=torch.bool),
                   "pos": torch.arange(12, dtype=torch.int32).reshape(3, 4).t()}, torch.tensor(5)], "keys": ["a:1"]}
    data, buffer = pack(obj)
    assert buffer is not None and buffer.dtype == torch.uint8 and buffer.dim() == 1
    # only the tensors' bytes travel (aligned), not a view's whole storage or pickled tensor objects
    assert buffer.numel() <= sum(-(-t.numel() * t.element_size() // 16) * 16
                                 for t in (obj["mb"][0]["input_ids"], obj["mb"][0]["mask"], obj["mb"][0]["pos"],
                                           obj["mb"][1]))
    assert len(data) < 1000
    back = unpack(data, buffer)
    assert same(back, obj)
    lo = buffer.data_ptr()
    for t in (back["mb"][0]["input_ids"], back["mb"][0]["mask"], back["mb"][0]["pos"], back["mb"][1]):
        assert lo <= t.data_ptr() < lo + buffer.numel()       # a view of the buffer: no copy on receipt
        assert t.data_ptr() % 16 == lo % 16


def test_a_permuted_image_travels_as_it_lies_in_memory_with_its_strides():
    hwc = torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8)
    chw = hwc.permute(2, 0, 1)                                  # what image transforms hand over
    bf16 = torch.randn(4, 6).to(torch.bfloat16).t()             # a dtype numpy lacks
    gap = torch.arange(24).reshape(4, 6)[:, ::2]                # not one block: copied to contiguous
    data, buffer = pack([chw, bf16, gap])
    assert buffer.numel() == sum(-(-t.numel() * t.element_size() // 16) * 16 for t in (chw, bf16, gap))
    back = unpack(data, buffer)
    assert back[0].stride() == chw.stride() and torch.equal(back[0], chw)
    assert back[1].stride() == bf16.stride() and torch.equal(back[1], bf16)
    assert back[2].is_contiguous() and torch.equal(back[2], gap)
    assert torch.equal(back[0].permute(1, 2, 0), hwc)


def test_an_object_without_tensors_has_no_buffer_and_other_tensors_pickle_as_torch_does():
    data, buffer = pack({"step": 3, "state": {"a": [1, 2]}})
    assert buffer is None and unpack(data, None) == {"step": 3, "state": {"a": [1, 2]}}
    grad = torch.ones(3, requires_grad=True)
    data, buffer = pack([grad, torch.nn.Parameter(torch.zeros(2))])
    back = unpack(data, buffer)
    assert back[0].requires_grad and torch.equal(back[0].detach(), grad.detach())
    assert isinstance(back[1], torch.nn.Parameter)


def test_a_packed_message_keeps_nothing_of_the_sender_alive():
    t = torch.arange(1000)
    ref = weakref.ref(t)
    data, buffer = pack({"t": t})
    del t
    gc.collect()
    assert ref() is None                                      # the buffer is a copy of the bytes
    assert torch.equal(unpack(data, buffer)["t"], torch.arange(1000))


def test_unpickling_errors_surface():
    with pytest.raises(Exception):
        unpack(b"not a pickle", None)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as bytes in its logical order (compares dtypes torch.equal cannot, e.g. float8)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def _views_of(buffer: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` lies in ``buffer``'s memory, 16-aligned, and shares it (a write to one shows in the other)."""
    lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    if not t.numel():
        return True
    end = t.data_ptr() + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
    if not (lo <= t.data_ptr() and end <= hi and (t.data_ptr() - lo) % 16 == 0):
        return False
    at = t.data_ptr() - lo
    before = int(buffer[at])
    buffer[at] = before ^ 0xFF
    first = t.as_strided((1,), (1,)).view(torch.uint8)[0]     # element 0's first byte: the lowest address
    shared = int(first) == before ^ 0xFF
    buffer[at] = before
    return shared


def test_every_layout_and_dtype_comes_back_equal_and_a_view_of_the_buffer():
    big = torch.arange(40, dtype=torch.int64)
    img = torch.randint(0, 256, (4, 5, 3), dtype=torch.uint8)
    cases = {
        "1d": torch.arange(7),                                  # 56 bytes: padded to 64
        "1d_even": torch.arange(8),                             # no padding
        "scalar": torch.tensor(5),                              # 0-d
        "scalar_f": torch.tensor(2.5, dtype=torch.float64),
        "zeros_1d": torch.empty(0, dtype=torch.int64),
        "zeros_nd": torch.empty(3, 0, 2, dtype=torch.float32),
        "offset_view": big[3:10],                               # storage offset 3: only its 7 elements travel
        "offset_2d": big[5:35].reshape(5, 6)[1:, 2:4],          # offset, not one block: made contiguous
        "permuted": img.permute(2, 0, 1),                       # one block in another order: strides travel
        "transposed": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
        "stepped": torch.arange(20)[::3],                       # 1-D, not one block
        "contiguous_3d": torch.randn(2, 3, 4),
        "bool3": torch.tensor([True, False, True]),
        "bf16": torch.randn(9).to(torch.bfloat16),
        "bf16_t": torch.randn(3, 5).to(torch.bfloat16).t(),
        "f8": torch.randn(6).to(torch.float8_e4m3fn),
        "f16_scalar": torch.tensor(1.5, dtype=torch.float16),
        "c64": torch.randn(3, dtype=torch.complex64),
        "c128": torch.randn(2, 2, dtype=torch.complex128),
        "size1_odd_stride": torch.arange(10)[4:5].as_strided((1, 1), (7, 3)),
    }
    obj = {"cases": cases, "again": cases["1d"], "text": "x"}
    data, buffer = pack(obj)
    back = unpack(data, buffer)
    assert back["again"] is back["cases"]["1d"]            # one tensor twice is one tensor, as pickle does
    assert back["text"] == "x"
    for name, a in cases.items():
        b = back["cases"][name]
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert torch.equal(_bytes(b), _bytes(a)), name
        if a.numel() > 1 and (a.is_contiguous() or name in ("permuted", "transposed", "bf16_t")):
            assert b.stride() == a.stride(), name              # dense layouts keep their strides
        assert b.is_contiguous() or b.stride() == a.stride(), name
        assert _views_of(buffer, b), name
    # only the tensors' own bytes travel (each padded to 16), not a view's whole storage
    assert buffer.numel() == sum(-(-a.numel() * a.element_size() // 16) * 16 for a in cases.values())


@pytest.mark.filterwarnings("ignore::UserWarning")     # quantized tensors are deprecated; still pickled
def test_lazy_conjugate_and_negative_views_travel_as_their_values_and_quantized_tensors_as_torch_pickles_them():
    z = torch.randn(4, dtype=torch.complex64)
    q = torch.quantize_per_tensor(torch.rand(5), 0.1, 10, torch.quint8)
    obj = [z.conj(), z.conj().imag, torch._neg_view(torch.arange(3.0)), q]
    assert obj[0].is_conj() and obj[1].is_neg() and obj[2].is_neg()
    back = unpack(*pack(obj))
    assert not back[0].is_conj() and torch.equal(back[0], z.conj())
    assert torch.equal(back[1], -z.imag) and torch.equal(back[2], -torch.arange(3.0))
    assert back[3].is_quantized and back[3].q_scale() == q.q_scale() and torch.equal(back[3].int_repr(), q.int_repr())


def test_a_buffer_with_a_storage_offset_unpacks_too():
    obj = {"a": torch.arange(5), "b": torch.randn(3, 2).t(), "s": torch.tensor(1.0, dtype=torch.bfloat16)}
    data, buffer = pack(obj)
    shifted = torch.empty(buffer.numel() + 3, dtype=torch.uint8)[3:]     # its bytes start at an odd offset
    shifted.copy_(buffer)
    back = unpack(data, shifted)
    assert same(back, obj) and back["b"].stride() == obj["b"].stride()
    assert all(_views_of(shifted, t) for t in back.values())


def test_the_received_tensors_keep_the_buffer_alive_until_the_last_is_gone(monkeypatch):
    """As for a shared-memory region: a finalizer on the numpy array unpack views must run only once every
    tensor made from it (1-D pieces, reshaped ones, padding cut off) is gone, and then without a GC pass."""
    from torchdata_overlord.runtime import wire

    obj = {"ids": torch.arange(5), "img": torch.randint(0, 256, (2, 3, 3), dtype=torch.uint8).permute(2, 0, 1),
           "x": torch.tensor(3.0)}
    data, buffer = pack(obj)
    array = buffer.numpy().copy()
    freed = []
    weakref.finalize(array, freed.append, True)
    monkeypatch.setattr(wire.shm, "receive", lambda ref: (array, None))
    ref = ("shm", 0, 0, "", 0, len(array), ())
    back = unpack(data, ref)
    del array, buffer
    gc.disable()
    try:
        ids, img, x = back["ids"], back["img"], back["x"]
        del back
        assert not freed
        del ids, img
        assert not freed
        assert x.item() == 3.0
        del x
        assert freed == [True]
    finally:
        gc.enable()


def test_pack_frees_the_senders_tensors_when_it_returns_without_a_gc_pass():
    t = torch.arange(1000)
    ref = weakref.ref(t)
    gc.disable()
    try:
        data, buffer = pack({"t": t, "u": torch.ones(3, dtype=torch.bfloat16)})
        del t
        assert ref() is None                          # nothing of the pack (its pickler, its parts) in a cycle
    finally:
        gc.enable()
    assert torch.equal(unpack(data, buffer)["t"], torch.arange(1000))


def test_a_received_message_of_several_dtypes_saves_with_torch_save(tmp_path):
    """torch.save refuses one storage viewed as several types: a trainer saving a received batch (ids,
    masks, images, bf16) must not meet that; each dtype's tensors share a storage of that dtype only."""
    obj = {"ids": torch.arange(9), "mask": torch.tensor([True, False]), "img": torch.randint(0, 256, (2, 3, 4), dtype=torch.uint8),
           "h": torch.randn(5).to(torch.bfloat16), "f": torch.randn(2, 3).t(), "ids2": torch.arange(4)}
    back = unpack(*pack(obj))
    torch.save(back, tmp_path / "batch.pt")
    again = torch.load(tmp_path / "batch.pt")
    assert same(again, obj)
