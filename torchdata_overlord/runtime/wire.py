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
carries a reference to it (:mod:`.shm`: ``pack(obj, peer=...)``); :func:`unpack` takes either. A
tensor that already lies in this process's shared memory (:func:`hold` put it there ahead of time)
is not copied at all: the message carries its place, and the receiver's tensor is a view of it. A
record :func:`hold` made (a :class:`HeldRecord`), unchanged since, is not even walked: the message
carries the pickle ``hold`` made of it, its tensors as places.
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

__all__ = ["pack", "unpack", "discard", "hold", "HeldRecord", "HOLD_MIN_BYTES"]

_ALIGN = 16            # every tensor starts at a multiple of 16 bytes of the buffer
_STRIDED = torch.strided
_DTYPES: dict[torch.dtype, tuple[str, int, bool] | None] = {}   # dtype -> (name in torch, bytes, complex?)
_LOCAL = threading.local()     # the message being unpacked on this thread: its tensors, by dtype group
# tensor id -> its _Place, for the tensors :func:`hold` made (dropped as each goes; not an attribute of the tensor,
# which would travel in its pickle, torch.save or deepcopy and fail there: a place names this process's arena)
_PLACES: dict[int, "_Place"] = {}
HOLD_MIN_BYTES = 256 << 10     # :func:`hold` holds a record whose tensors hold at least this many bytes


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


class _Place:
    """Where :func:`hold` put a tensor: its region of this process's arena (where the region's bytes start and
    end, from the arena's start), its first element counted from there, and its shape and strides."""

    __slots__ = ("arena", "region", "first", "end", "ptr", "dtype", "shape", "stride", "args")

    def __init__(self, arena, region: int, first: int, end: int, t: torch.Tensor, name: str, at: int, plain: bool):
        self.arena, self.region, self.first, self.end, self.ptr = arena, region, first, end, t.data_ptr()
        self.dtype, self.shape, self.stride = t.dtype, t.shape, t.stride()
        self.args = (name, at, t.numel(), None if plain else tuple(self.shape), None if plain else self.stride)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (the tensor placed here) still lies here as it was held: not moved (``set_``, ``.data``),
        resized, restrided or viewed as another dtype (``.data = t.view(dtype)``) since."""
        return t.data_ptr() == self.ptr and t.dtype is self.dtype and t.shape == self.shape and t.stride() == self.stride


def _held_tensor(region: int, name: str, at: int, count: int, shape: tuple | None, stride: tuple | None) -> torch.Tensor:
    """A held tensor of the message being unpacked, in the ``region``-th region it names (:func:`_in_region`)."""
    return _in_region(_LOCAL.held[region], name, at, count, shape, stride)


def _in_region(region, name: str, at: int, count: int, shape: tuple | None, stride: tuple | None) -> torch.Tensor:
    """The ``count`` elements of dtype ``name`` from byte ``at`` of ``region`` (a received region's array), with
    their shape and strides (None: 1-D): a storage of its own over those bytes, which keeps the region's array
    alive (its slot is freed once the last is gone), so torch.save writes those bytes only."""
    dtype = _TORCH_DTYPES.get(name) or _TORCH_DTYPES.setdefault(name, getattr(torch, name))
    t = torch.frombuffer(region, dtype=dtype, count=count, offset=at)
    return t if shape is None else t.as_strided(shape, stride)


_TORCH_DTYPES: dict[str, torch.dtype] = {}


class _Held:
    """A message's held tensors (:func:`hold`): the regions they lie in, and per region one slot claimed, which
    the receiver's views of that region free (each region on its own)."""

    __slots__ = ("arena", "regions")

    def __init__(self, arena):
        self.arena = arena
        self.regions: dict[int, tuple[int, int, int, int]] = {}    # region start -> (index, first, end, slot word)

    def place(self, t: torch.Tensor, h: _Place):
        """``t`` pickled as its place (``h``), or None (it is copied): ``t`` moved since (``set_``, an in-place
        resize), another group's arena, or its region's slots all taken."""
        if h.arena is not self.arena or not h.holds(t):
            return None
        k = self.claim(h)
        return None if k is None else (_held_tensor, (k, *h.args))

    def claim(self, h: _Place) -> int | None:
        """The index in this message of ``h``'s region (a slot of it claimed the first time); None when all its
        slots are taken."""
        got = self.regions.get(h.region)
        if got is None:
            slot = self.arena.claim(h.region)
            if slot is None:
                return None
            got = self.regions[h.region] = (len(self.regions), h.first, h.end, slot)
        return got[0]

    def ref(self, start: int = -1, nbytes: int = 0) -> tuple:
        """The message's :data:`.shm.ShmRef`: its buffer's region (``start`` -1: none), and per held region
        its bytes and the slot its receiver frees."""
        a = self.arena
        return "shm", a.pid, a.fd, a.token, start, nbytes, tuple((f, e, s) for _, f, e, s in self.regions.values())


class HeldRecord(dict):
    """A record :func:`hold` put into shared memory, with its pickle made there too (its tensors as places in
    its region): a put to a peer of this host sends that pickle as it is, instead of walking the record and
    placing its tensors one by one during the step. To any other reader it is the dict it holds; pickled any
    other way (or copied), a plain dict. Changed since it was held (a key set or removed, a list's item, a
    tensor changed in place, resized, ``set_``, given other ``.data`` or ``requires_grad``), it is sent as a
    plain dict would be."""

    __slots__ = ("_seal",)

    def __reduce__(self):
        return dict, (dict(self),)


class _Seal:
    """What :func:`hold` pickled of a record: the pickle, its region's place, and what it saw (the values by
    identity, the items of its lists, each tensor's version counter and place) to tell whether it still holds."""

    __slots__ = ("place", "blob", "items", "seqs", "tensors")

    def __init__(self, record: dict, tensors: list[torch.Tensor]):
        self.place, self.items = _PLACES[id(tensors[0])], tuple(record.items())
        self.seqs = tuple((v, tuple(v)) for v in record.values() if type(v) is list)
        self.tensors = tuple((t, t._version, _PLACES[id(t)]) for t in tensors)
        f = io.BytesIO()
        _Sealer(f, pickle.HIGHEST_PROTOCOL).dump(record)
        self.blob = f.getvalue()

    def holds(self, record: dict) -> bool:
        """Whether ``record`` is still what was pickled."""
        if len(record) != len(self.items):
            return False
        get = record.get
        for k, v in self.items:
            if get(k, _MISSING) is not v:
                return False
        for seq, items in self.seqs:
            if len(seq) != len(items) or any(a is not b for a, b in zip(seq, items)):
                return False
        return all(t._version == v and h.holds(t) and not t.requires_grad for t, v, h in self.tensors)


_MISSING = object()
_ATOMS = frozenset({str, int, float, bool, bytes, type(None)})    # values a sealed record may hold besides tensors


def _sealed_reduce(t: torch.Tensor):
    return _sealed_tensor, _PLACES[id(t)].args


class _Sealer(pickle.Pickler):
    """Pickles a held record with its tensors as their places in its region."""

    dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _sealed_reduce}


def _seal(record: dict, tensors: list[torch.Tensor]) -> dict:
    """``record`` (all its tensors held in one region: ``tensors``) as a :class:`HeldRecord` carrying its pickle;
    ``record`` itself when a value is neither a tensor, an immutable scalar or string, nor a list or tuple of
    those (a mutable value could change unseen after the pickle was made)."""
    for k, v in record.items():
        if type(k) not in _ATOMS:
            return record
        if type(v) is list or type(v) is tuple:
            if not all(type(x) in _ATOMS or type(x) is torch.Tensor for x in v):
                return record
        elif type(v) not in _ATOMS and type(v) is not torch.Tensor:
            return record
    out = HeldRecord(record)
    out._seal = _Seal(record, tensors)
    return out


def _reduce_record(held: _Held | None, record: HeldRecord):
    """A held record to a peer of this host, unchanged since: its pickle and its region; else a plain dict."""
    seal = getattr(record, "_seal", None)
    if held is not None and seal is not None and seal.place.arena is held.arena and seal.holds(record):
        k = held.claim(seal.place)
        if k is not None:
            return _unseal, (k, seal.blob)
    return dict, (dict(record),)


def _unseal(region: int, blob: bytes) -> dict:
    """A sealed record of the message being unpacked: its pickle, its tensors in the ``region``-th region."""
    previous = getattr(_LOCAL, "region", None)
    _LOCAL.region = _LOCAL.held[region]
    try:
        return pickle.loads(blob)
    finally:
        _LOCAL.region = previous


def _sealed_tensor(name: str, at: int, count: int, shape: tuple | None, stride: tuple | None) -> torch.Tensor:
    """A tensor of the sealed record being unpacked (:func:`_in_region`)."""
    return _in_region(_LOCAL.region, name, at, count, shape, stride)


class _Packer(pickle.Pickler):
    """A pickler that takes out plain CPU tensors (looked up by exact type: other objects cost nothing)."""

    def __init__(self, f, held: _Held | None = None):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.groups: dict[torch.dtype, _Group] = {}
        # not a bound method: no reference cycle, so a packer (and the tensors it holds) goes when pack returns
        self.dispatch_table = {**copyreg.dispatch_table,
                               torch.Tensor: functools.partial(_reduce_tensor, self.groups, held),
                               HeldRecord: functools.partial(_reduce_record, held)}


def _reduce_tensor(groups: dict[torch.dtype, _Group], held: _Held | None, t: torch.Tensor):
    """``t`` appended to its dtype's group in ``groups`` (a packer's), and pickled as ``pieces[i]`` of it;
    or, when it lies in a held region and ``held`` places it, pickled as that place."""
    if held is not None:
        h = _PLACES.get(id(t))
        if h is not None and not t.requires_grad:
            got = held.place(t, h)
            if got is not None:
                return got
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
    ``peer`` shares the host (:func:`.shm.peer_ready`), and its reference takes the tensor's place;
    held tensors (:func:`hold`) are then not copied, the reference names their places' slots.
    With a buffer or held tensors, the pickle is two: where each dtype's tensors lie in the buffer, then
    ``obj``."""
    if type(obj) in _ATOMS:                     # (most answers: None)
        return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), None
    near = peer is not None and shm.peer_ready(peer)
    arena = shm.current() if near else None
    held = _Held(arena) if arena is not None else None
    f = io.BytesIO()
    p = _Packer(f, held)
    p.dump(obj)
    by_place = held is not None and bool(held.regions)
    if not p.groups and not by_place:
        return f.getvalue(), None
    layout, size = [], 0
    for g in p.groups.values():
        layout.append((g.name, size, g.nbytes, g.sizes, g.fixes))
        size += g.nbytes
    if not p.groups:                            # every tensor held: no buffer at all
        shm.count_held(len(held.regions))
        return pickle.dumps(layout, pickle.HIGHEST_PROTOCOL) + f.getvalue(), held.ref()
    got = shm.alloc(size) if near else None
    if got is None:
        if by_place:                            # a full arena: the held tensors are copied too, into a tensor
            shm.free(held.ref())
            return pack(obj)
        out = torch.empty(size, dtype=torch.uint8)
        base = out.data_ptr()
    else:
        out, region = got
        base = region.ctypes.data
        if by_place:
            out = held.ref(out[4], out[5])
            shm.count_held(len(held.regions))
    memmove = ctypes.memmove                    # (each part is a CPU tensor that pack holds until copied)
    for (_, start, *_), g in zip(layout, p.groups.values()):
        for offset, nbytes, t in g.parts:       # its bytes: one block from data_ptr() on (strides are >= 0)
            if nbytes:
                memmove(base + start + offset, t.data_ptr(), nbytes)
    return pickle.dumps(layout, pickle.HIGHEST_PROTOCOL) + f.getvalue(), out


def _holdable(t) -> bool:
    """A tensor :func:`hold` moves: a plain CPU tensor whose elements fill one block (as :func:`pack` copies it)."""
    if type(t) is not torch.Tensor or t.layout is not _STRIDED or not t.is_cpu or t.requires_grad or not t.numel():
        return False
    kind = _DTYPES.get(t.dtype) or _dtype(t.dtype)
    return kind is not None and not t.is_neg() and not (kind[2] and t.is_conj()) and (t.is_contiguous() or _dense(t))


def hold(record, min_bytes: int = HOLD_MIN_BYTES):
    """``record`` (a sample record: a dict) with its plain CPU tensors, and those in its lists and tuples, moved
    into one region of this process's shared memory (:func:`.shm.hold`): a new dict whose tensors are views
    of that region, with the same values, dtypes, shapes and strides (tensors that shared memory no longer
    do). A message then carries such a tensor by place, not by copy (:func:`pack`). When every tensor of it
    moved and its other values are immutable (scalars, strings, lists and tuples of those and tensors), the
    new dict is a :class:`HeldRecord` with its pickle made here: a put sends that, not the record walked
    tensor by tensor. ``record`` itself when it is not a dict, its tensors hold fewer than ``min_bytes``
    bytes, or shared memory is off or full.

    Holding costs the copy a put would make, plus about 25 us of Python per record (its region, a storage per
    tensor, the pickle); it takes the copy and the walk off the step (a loader holds ahead of it). That pays
    for records of images (hundreds of KiB), not for tens of KiB of token ids, where a put's copy and walk
    cost less (measured in a job: holding every record cost samples/s): hence ``min_bytes``
    (:data:`HOLD_MIN_BYTES` by default; a Source Loader holds with the default)."""
    if type(record) is not dict:
        return record
    found: list = []                                    # (key, index in its list or -1, tensor)
    for k, v in record.items():
        if type(v) is torch.Tensor:
            found.append((k, -1, v))
        elif type(v) is list or type(v) is tuple:
            found += [(k, j, x) for j, x in enumerate(v) if type(x) is torch.Tensor]
    if sum(t.nbytes for _, _, t in found) < min_bytes:  # (sizes first: most records are not held)
        return record
    every = len(found)
    found = [f for f in found if _holdable(f[2])]
    if not found:
        return record
    offsets, size = [], 0
    for _, _, t in found:
        offsets.append(size)
        size += -(-t.nbytes // _ALIGN) * _ALIGN
    got = shm.hold(size)
    if got is None:
        return record
    arena, region, view = got
    base, memmove = view.ctypes.data, ctypes.memmove
    first = region + shm.HEADER                         # the region's bytes, from the arena's start
    end = first + len(view)
    out, seqs, held = dict(record), {}, []
    for (k, j, t), at in zip(found, offsets):
        memmove(base + at, t.data_ptr(), t.nbytes)      # its block, from data_ptr() on (strides are >= 0)
        # a storage of its own over its bytes (keeping the region's array, and so the region, alive)
        m = torch.frombuffer(view, dtype=t.dtype, count=t.numel(), offset=at)
        plain = t.dim() == 1 and t.is_contiguous()
        if not plain:
            m = m.as_strided(t.shape, t.stride())
        _PLACES[id(m)] = _Place(arena, region, first, end, m, _DTYPES[t.dtype][0], at, plain)
        shm.when_gone(m, _PLACES.pop, id(m), None)
        held.append(m)
        if j < 0:
            out[k] = m
        else:
            seqs.setdefault(k, list(record[k]))[j] = m
    for k, items in seqs.items():
        out[k] = items if type(record[k]) is list else tuple(items)
    return _seal(out, held) if len(found) == every else out     # (a tensor left out needs the buffer)


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
    raw, regions = shm.receive(buffer) if isinstance(buffer, tuple) else (buffer.numpy(), ())
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
    previous = getattr(_LOCAL, "groups", None), getattr(_LOCAL, "held", None)
    _LOCAL.groups, _LOCAL.held = groups, regions
    try:
        return pickle.load(f)
    finally:
        _LOCAL.groups, _LOCAL.held = previous
