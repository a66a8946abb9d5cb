"""What one RPC call carries: its Python objects pickled, every CPU tensor in it packed into one buffer.

TensorPipe sends each tensor of a message as a payload of its own, at a fixed cost per tensor (tens
of microseconds on each side, measured here): a step's output is dozens of small tensors (per
microbatch ``input_ids``, ``labels``, ``position_ids``, ...). :func:`pack` pickles an object with
every plain CPU tensor replaced by a place in one ``uint8`` tensor, so a message is one pickle and
at most one tensor; :func:`unpack` rebuilds the tensors as views of that buffer (no copy on the
receiving side; they share its storage). A tensor whose elements fill one block in another order (an
image permuted from HWC to CHW) travels as that block with its strides: no copy to contiguous first
(a strided uint8 copy of one image costs about a millisecond). Tensors that need grad, tensor
subclasses and tensors on other devices are pickled as torch pickles them.

Between processes of one host the buffer is written into shared memory instead, and the message
carries a reference to it (:mod:`.shm`: ``pack(obj, peer=...)``); :func:`unpack` takes either.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import threading

import numpy as np
import torch

from . import shm

__all__ = ["pack", "unpack", "discard"]

_ALIGN = 16            # every tensor starts at a multiple of 16 bytes of the buffer
_LOCAL = threading.local()     # the buffer being unpacked on this thread
_DTYPES: dict[str, np.dtype] = {}


def _tensor(offset: int, nbytes: int, dtype, shape: tuple, stride: tuple | None = None) -> torch.Tensor:
    """A tensor of the message being unpacked: a view of its buffer (with the sender's strides, if given)."""
    raw = _LOCAL.buffer[offset:offset + nbytes]
    if isinstance(dtype, str):
        np_dtype = _DTYPES.get(dtype) or _DTYPES.setdefault(dtype, np.dtype(dtype))
        t = torch.from_numpy(raw.view(np_dtype))
    elif not nbytes:                     # an empty tensor of a dtype numpy lacks: nothing to view
        return torch.empty(shape, dtype=dtype)
    else:
        t = torch.from_numpy(raw).view(dtype)
    return t.reshape(shape) if stride is None else t.as_strided(shape, stride)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory in some order (e.g. an HWC image permuted to CHW)."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


class _Packer(pickle.Pickler):
    """A pickler that takes out plain CPU tensors (looked up by exact type: other objects cost nothing)."""

    def __init__(self, f):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.parts: list[tuple[int, np.ndarray]] = []
        self.size = 0
        self.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: self._reduce_tensor}

    def _reduce_tensor(self, t: torch.Tensor):
        if t.requires_grad or t.device.type != "cpu" or t.layout != torch.strided:
            return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        shape, stride = tuple(t.shape), None
        if not t.is_contiguous():        # a permuted block travels as it lies, strides and all (no copy)
            if t.numel() and _dense(t):
                stride, t = t.stride(), t.as_strided((t.numel(),), (1,))
            else:
                t = t.contiguous()
        try:
            a = t.numpy()                                # numpy knows the dtype: a view, no torch op
            dtype = a.dtype.str
        except TypeError:                                # bfloat16, float8, ...: its bytes
            a, dtype = t.reshape(-1).view(torch.uint8).numpy(), t.dtype
        offset = self.size
        self.parts.append((offset, a))
        self.size += -(-a.nbytes // _ALIGN) * _ALIGN
        return _tensor, (offset, a.nbytes, dtype, shape) if stride is None else (offset, a.nbytes, dtype, shape, stride)


def pack(obj, peer: str | None = None) -> tuple[bytes, torch.Tensor | tuple | None]:
    """``obj`` as (pickle, one uint8 tensor holding its CPU tensors, or None when it has none). With
    ``peer`` (the RPC worker it goes to), the buffer goes into this process's shared memory when
    ``peer`` shares the host (:func:`.shm.peer_ready`), and its reference takes the tensor's place."""
    f = io.BytesIO()
    p = _Packer(f)
    p.dump(obj)
    if not p.parts:
        return f.getvalue(), None
    got = shm.alloc(p.size) if peer is not None and shm.peer_ready(peer) else None
    if got is None:
        buffer, out = np.empty(p.size, np.uint8), None
    else:
        out, buffer = got
    for offset, a in p.parts:
        buffer[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
    return f.getvalue(), torch.from_numpy(buffer) if out is None else out


def discard(buffer) -> None:
    """A packed message that was never sent: give its shared memory back (nothing to do for a tensor)."""
    if isinstance(buffer, tuple):
        shm.free(buffer)


def unpack(data: bytes, buffer: torch.Tensor | tuple | None):
    """The object :func:`pack` gave ``(data, buffer)`` for; its tensors are views of ``buffer`` (of the
    sender's shared memory, when ``buffer`` is a reference to it)."""
    previous = getattr(_LOCAL, "buffer", None)
    _LOCAL.buffer = (None if buffer is None else shm.receive(buffer) if isinstance(buffer, tuple)
                     else buffer.numpy())
    try:
        return pickle.loads(data)
    finally:
        _LOCAL.buffer = previous
