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
