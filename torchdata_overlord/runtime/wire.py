"""What one RPC call carries: its Python objects pickled, every CPU tensor in it packed into one buffer.

TensorPipe sends each tensor of a message as a payload of its own, at a fixed cost per tensor (tens
of microseconds on each side, measured here): a step's output is dozens of small tensors (per
microbatch ``input_ids``, ``labels``, ``position_ids``, ...). :func:`pack` pickles an object with
every plain CPU tensor replaced by a place in one ``uint8`` tensor, so a message is one ``bytes``
(the pickle, after a short one saying where each dtype's tensors lie in the buffer) and at most one
tensor; :func:`unpack` rebuilds the tensors as views of that buffer (no copy on the receiving side;
they share its storage, and keep it alive). A tensor whose elements fill one block in another order
(an image permuted from HWC to CHW) travels as that block with its strides: no copy to contiguous
first (a strided uint8 copy of one image costs about a millisecond). Tensors that need grad, tensor
subclasses, quantized tensors and tensors on other devices are pickled as torch pickles them.

The cost is per tensor, a few microseconds on each side besides copying its bytes once: the sender
copies each tensor's block from its data pointer (no numpy array or torch op per tensor), and the
tensors of one dtype lie one after another, so the receiver cuts them out of the buffer with one
``split_with_sizes`` (only those not 1-D and contiguous take one more ``as_strided``).

Between processes of one host the buffer is written into shared memory instead, and the message
carries a reference to it (:mod:`.shm`: ``pack(obj, peer=...)``); :func:`unpack` takes either.
"""

from __future__ import annotations

import copyreg
import ctypes
import functools
import io
import operator
import pickle
import threading

import torch

from . import shm

__all__ = ["pack", "unpack", "discard"]

_ALIGN = 16            # every tensor starts at a multiple of 16 bytes of the buffer
_STRIDED = torch.strided
_DTYPES: dict[torch.dtype, tuple[str, int, bool] | None] = {}   # dtype -> (name in torch, bytes, complex?)
_LOCAL = threading.local()     # the message being unpacked on this thread: its tensors, by dtype group


def _dtype(dtype: torch.dtype) -> tuple[str, int, bool] | None:
    """``dtype``'s name in torch, the size of an element and whether it is complex; None for a quantized
    dtype (its tensors carry a scale: they pickle the torch way)."""
    got = _DTYPES.get(dtype)
    if got is None and dtype not in _DTYPES:
        name = str(dtype).removeprefix("torch.")
        got = _DTYPES[dtype] = None if name.startswith("q") else (name, dtype.itemsize, dtype.is_complex)
    return got


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory in some order (e.g. an HWC image permuted to CHW)."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


class _Group:
    """A message's tensors of one dtype: one block of the buffer, each tensor's bytes after the last's, and
    the padding after each (to a multiple of 16 bytes) a piece of its own. The receiver cuts the block into
    its pieces with one ``split_with_sizes`` before it reads the pickle, where each tensor is
    ``getitem(pieces, i)``: the pickler memoizes this stand-in for ``pieces``, so it is looked up once."""

    __slots__ = ("index", "name", "itemsize", "nbytes", "sizes", "fixes", "parts")

    def __init__(self, index: int, name: str, itemsize: int):
        self.index, self.name, self.itemsize, self.nbytes = index, name, itemsize, 0
        self.sizes: list[int] = []                          # pieces, in elements (tensors and padding)
        self.fixes: list[tuple[int, tuple, tuple]] = []     # (piece, shape, strides): all but 1-D contiguous
        self.parts: list[tuple[int, int, torch.Tensor]] = []   # (offset in the block, bytes, tensor)

    def __reduce__(self):
        return _received_group, (self.index,)


def _received_group(index: int) -> list[torch.Tensor]:
    """A group's pieces in the message being unpacked (cut out before its pickle is read)."""
    return _LOCAL.groups[index]


class _Packer(pickle.Pickler):
    """A pickler that takes out plain CPU tensors (looked up by exact type: other objects cost nothing)."""

    def __init__(self, f):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.groups: dict[torch.dtype, _Group] = {}
        # not a bound method: no reference cycle, so a packer (and the tensors it holds) goes when pack returns
        self.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: functools.partial(_reduce_tensor, self.groups)}


def _reduce_tensor(groups: dict[torch.dtype, _Group], t: torch.Tensor):
    """``t`` appended to its dtype's group in ``groups`` (a packer's), and pickled as ``pieces[i]`` of it."""
    dtype = t.dtype
    kind = _DTYPES.get(dtype) or _dtype(dtype)
    if kind is None or t.requires_grad or not t.is_cpu or t.layout is not _STRIDED:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    name, itemsize, is_complex = kind
    if t.is_neg() or (is_complex and t.is_conj()):     # lazy negated/conjugated views: their values
        t = t.resolve_conj().resolve_neg()
    # a permuted block travels as it lies, strides and all (no copy); other layouts are made one block
    contiguous = t.is_contiguous()
    if not contiguous and not (t.numel() and _dense(t)):
        t, contiguous = t.contiguous(), True
    group = groups.get(dtype)
    if group is None:
        group = groups[dtype] = _Group(len(groups), name, itemsize)
    sizes, piece, nbytes = group.sizes, len(group.sizes), t.nbytes
    pad = -nbytes % _ALIGN
    sizes.append(nbytes // itemsize)
    if pad:
        sizes.append(pad // itemsize)
    if not contiguous or t.dim() != 1:
        group.fixes.append((piece, tuple(t.shape), t.stride()))
    group.parts.append((group.nbytes, nbytes, t))
    group.nbytes += nbytes + pad
    return operator.getitem, (group, piece)


def pack(obj, peer: str | None = None) -> tuple[bytes, torch.Tensor | tuple | None]:
    """``obj`` as (pickle, one uint8 tensor holding its CPU tensors, or None when it has none). With
    ``peer`` (the RPC worker it goes to), the buffer goes into this process's shared memory when
    ``peer`` shares the host (:func:`.shm.peer_ready`), and its reference takes the tensor's place.
    With a buffer, the pickle is two: where each dtype's tensors lie in the buffer, then ``obj``."""
    f = io.BytesIO()
    p = _Packer(f)
    p.dump(obj)
    if not p.groups:
        return f.getvalue(), None
    layout, size = [], 0
    for g in p.groups.values():
        layout.append((g.name, size, g.nbytes, g.sizes, g.fixes))
        size += g.nbytes
    got = shm.alloc(size) if peer is not None and shm.peer_ready(peer) else None
    if got is None:
        out = torch.empty(size, dtype=torch.uint8)
        base = out.data_ptr()
    else:
        out, region = got
        base = region.ctypes.data
    memmove = ctypes.memmove                    # (each part is a CPU tensor that pack holds until copied)
    for (_, start, *_), g in zip(layout, p.groups.values()):
        for offset, nbytes, t in g.parts:       # its bytes: one block from data_ptr() on (strides are >= 0)
            if nbytes:
                memmove(base + start + offset, t.data_ptr(), nbytes)
    return pickle.dumps(layout, pickle.HIGHEST_PROTOCOL) + f.getvalue(), out


def discard(buffer) -> None:
    """A packed message that was never sent: give its shared memory back (nothing to do for a tensor)."""
    if isinstance(buffer, tuple):
        shm.free(buffer)


def unpack(data: bytes, buffer: torch.Tensor | tuple | None):
    """The object :func:`pack` gave ``(data, buffer)`` for; its tensors are views of ``buffer`` (of the
    sender's shared memory, when ``buffer`` is a reference to it)."""
    if buffer is None:
        return pickle.loads(data)
    f = io.BytesIO(data)
    layout = pickle.load(f)
    # each dtype's tensors are views of one storage of their own (torch.save refuses a storage viewed as
    # several types), made over the buffer's bytes: with a shared-memory region, every one keeps alive the
    # numpy array whose finalizer frees the region once the last view is gone
    raw = shm.receive(buffer) if isinstance(buffer, tuple) else buffer.numpy()
    groups = []
    for name, start, nbytes, sizes, fixes in layout:
        dtype = getattr(torch, name)
        block = torch.from_numpy(raw[start:start + nbytes]).view(dtype) if nbytes else torch.empty(0, dtype=dtype)
        pieces = block.split_with_sizes(sizes)
        if fixes:
            pieces = list(pieces)
            for i, shape, stride in fixes:             # the piece's offset, the tensor's shape and strides
                pieces[i] = pieces[i].as_strided(shape, stride)
        groups.append(pieces)
    previous = getattr(_LOCAL, "groups", None)
    _LOCAL.groups = groups
    try:
        return pickle.load(f)
    finally:
        _LOCAL.groups = previous
