"""Source Loader role (paper section 3): one source's read buffer, its metadata, and hand-over.

It reads rows from its source, transforms them on a small worker pool (a slow image source gets
more workers than a text source: the paper's "worker parallel"), keeps them in a FIFO read
buffer, reports the buffer's metadata to the Planner (never the bytes), and hands over exactly
the samples a plan names. As a ``torchdata.nodes.BaseNode`` its ``next()`` yields the buffered
samples' stream, and its state is the source position of the oldest sample still buffered plus
the samples taken out of order after it, so ``reset(state)`` rebuilds the identical buffer by
re-reading, and no sample bytes ever go into a checkpoint. Over a source that reports read-order
keys (``last_order``, ``owns``: :class:`~torchdata_overlord.ParquetSource` and its kin) the buffer's
metadata carries them and a taken sample is kept with its key, so the data-parallel parts of one
source (:mod:`.loader_parts`) merge into the buffer and state one loader would have.
"""

from __future__ import annotations

import logging
import operator
from collections import OrderedDict
from typing import Any, Iterable

import numpy as np
import torch
from torchdata.nodes import BaseNode

from ..errors import ConfigError
from ..plane.records import BufferMeta
from ..sources.base import SKIPPED, SourceReadError, positions
from .constructor import _sequence_length, _text_ids, sequence_length
from .meta_slots import MetaSlots
from .transform_pool import TransformPool

__all__ = ["SourceLoader", "record_bytes"]

log = logging.getLogger("torchdata_overlord")


_PLACE = object()       # a buffered row's record while a catch-up holds its place only (see catch_up)
_SLOT = operator.itemgetter(3)     # a buffer entry's metadata slot


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.nbytes


def _dict_bytes(d: dict) -> int:
    return _values_bytes(d.values())


def _seq_bytes(s) -> int:
    return _values_bytes(s)


_LEAVES = frozenset((int, float, bool, type(None)))


def _values_bytes(values) -> int:
    """:func:`record_bytes` of each value, summed; a record's usual values (a tensor, a number) inline, without
    the calls (a delivery sizes every sample it sends: the calls were most of it)."""
    n = 0
    for v in values:
        t = type(v)
        if t is torch.Tensor:
            n += v.nbytes
        elif t in _LEAVES:
            n += 8
        else:
            n += record_bytes(v)
    return n


def _leaf_bytes(_) -> int:
    return 8


def _sizer(value: Any):
    """How :func:`record_bytes` sizes ``value``: tensor storage, the sum over a container, a length, or 8."""
    if isinstance(value, torch.Tensor):
        return _tensor_bytes
    if isinstance(value, dict):
        return _dict_bytes
    if isinstance(value, (list, tuple)):
        return _seq_bytes
    if isinstance(value, (bytes, bytearray, str)):
        return len
    return _leaf_bytes


# the usual exact types, sized without the isinstance chain (isinstance(x, torch.Tensor) costs ~0.3 us)
_SIZERS = {type(v): _sizer(v) for v in (torch.empty(0), {}, [], (), "", b"", bytearray(), 0, 0.0, False, None)}


def record_bytes(record: Any) -> int:
    """Approximate bytes of a sample record (tensor storage, strings, 8 per other leaf)."""
    return (_SIZERS.get(type(record)) or _sizer(record))(record)


def _same_state(a: Any, b: Any) -> bool:
    """Equal states, lists and tuples alike (a state that travelled may have either)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


class _StrayPlaceholder(Exception):
    """A record's text ids hold the image placeholder: its text has the placeholder piece (e.g. ``<image>``)
    literally, so its row would carry a placeholder with no image behind it, which shifts or breaks a model
    that fills placeholders with image features in order (:meth:`named` says which sample, for the user).
    Under the source's ``on_error="skip"`` the row is skipped as a row its transform failed on
    (:meth:`reason` is what the skip records)."""

    def __init__(self, ids: np.ndarray, image_token_id: int):
        hit = (ids == image_token_id).nonzero()[0]
        super().__init__(int(hit[0]), len(hit), image_token_id)

    def reason(self) -> ValueError:
        """The error a skip of its row records (and logs) beside the file and row."""
        at_token, count, tid = self.args
        return ValueError(f"its text has the image placeholder id {tid} at token {at_token} ({count} in all) but no "
                          f"image there: the text holds the placeholder piece literally (e.g. '<image>')")

    def named(self, source: str, index: int, where) -> SourceReadError:
        at_token, count, tid = self.args
        at = f"{where[0]} row {where[1]}" if isinstance(where, tuple) and len(where) >= 2 else f"item {where}"
        return SourceReadError(
            f"source {source!r}: sample {index} ({at}) has the image placeholder id {tid} in its text at token "
            f"{at_token} ({count} in all) but no image there: its text holds the placeholder piece literally (e.g. "
            f"'<image>'); remove or escape it in the text (in the transform), use a placeholder that cannot occur in "
            f"text, or pass on_error='skip' to the source to skip such rows")


class SourceLoader(BaseNode[tuple]):
    """``SourceLoader(source, buffer_size, workers=0)`` over any :class:`~torchdata_overlord.Source`.

    A sample's index is the one the source's ``next_raw`` gives: unique over the whole run, so a
    sample seen again in a later epoch is a different planned item. ``image_token_id`` makes reported
    token counts include image placeholder tokens, as the Data Constructor packs them.
    """

    SOURCE_STATE = "source"          # source position before the oldest buffered sample
    TAKEN = "taken"                  # indices consumed after that position (out-of-order takes)
    EPOCH_LOG = "epochs_started"
    EPOCHS_KEPT = 16                 # the epochs_started a state and stats() list: the latest (a source cycled for
                                     # a million steps would otherwise carry thousands in every state)
    POOL_STOP_WAIT = 5.0             # seconds close() waits for the transform threads (a stuck one is left: see TransformPool)

    def __init__(self, source, buffer_size: int, workers: int = 0, image_token_id: int | None = None):
        super().__init__()
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ConfigError(f"source {source.name!r}: buffer_size must be an integer >= 1, got {buffer_size!r}")
        if not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"source {source.name!r}: workers must be an integer >= 0, got {workers!r}")
        self.source, self.name = source, source.name
        self.buffer_size, self.workers, self.image_token_id = buffer_size, workers, image_token_id
        self._pool = TransformPool(workers, f"overlord-{self.name}") if workers else None
        # index -> (record, source position before reading it, read sequence number, slot of its metadata row in
        # self._meta, read-order key or -1), oldest first
        self._buffer: OrderedDict[int, tuple[Any, Any, int, int, int]] = OrderedDict()
        self._meta = MetaSlots(buffer_size)
        self._reported: tuple | None = None       # ((its buffer's version, ordered), the last metadata() report)
        self.ordered = hasattr(source, "last_order") and hasattr(source, "owns")
        # where the source stands, kept per buffered row: its position (a small tuple) where it has one
        # (a state made from it only for a checkpoint), else its state
        self._here, self._state_at = positions(source)
        self._seq = 0
        self._ahead: set[int] = set()    # indices a catch-up will take: read, but not transformed
        self._initial = {self.SOURCE_STATE: source.state_dict(), self.TAKEN: [], self.EPOCH_LOG: [source.epoch]}
        self.served = 0
        self.reset(None)

    # -- BaseNode contract ---------------------------------------------------------------------
    def reset(self, initial_state: dict | None = None) -> None:
        """Back to ``initial_state`` (or to where the source stood when this loader was made)."""
        super().reset(initial_state)
        state = self._initial if initial_state is None else initial_state
        self._buffer.clear()
        self._meta.clear()
        self.exhausted = False
        self.source.load_state_dict(state[self.SOURCE_STATE])
        # index -> (read seq, None until read again; read-order key, -1 if the source has none)
        self._taken: dict[int, tuple[int | None, int]] = {}
        for t in state[self.TAKEN]:
            i, order = (int(t[0]), int(t[1])) if isinstance(t, (list, tuple)) else (int(t), -1)
            if order < 0 or self.source.owns(order):       # a part keeps only its own units' takes
                self._taken[i] = (None, order)
        self.epochs_started = list(state[self.EPOCH_LOG])[-self.EPOCHS_KEPT:]
        self._base = self._here()
        self._productive_at = self.source.rows_passed   # where the last read round buffered something

    def holds(self, state: dict) -> bool:
        """Whether the buffer is already what ``reset(state)`` would rebuild by re-reading (``state`` is
        this loader's own, nothing taken since): a start that loads the state the warm-up filled from
        keeps the buffer instead of reading and transforming it again."""
        return bool(self._buffer) and _same_state(state, self.get_state())

    def next(self) -> tuple[int, Any]:
        """The oldest buffered sample, taken out of the buffer (stream use of the node)."""
        self.fill()
        if not self._buffer:
            raise StopIteration
        index = next(iter(self._buffer))
        return index, self.take([index])[index]

    def get_state(self) -> dict:
        taken = [[i, o] for i, (_, o) in sorted(self._taken.items())] if self.ordered else sorted(self._taken)
        return {self.SOURCE_STATE: self._state_at(self._base), self.TAKEN: taken,
                self.EPOCH_LOG: list(self.epochs_started)}

    # -- role API ------------------------------------------------------------------------------
    def fill(self) -> None:
        """Top the buffer up to ``buffer_size`` samples (fewer only when the source is exhausted): rows
        skipped under ``on_error="skip"`` are replaced by reading on."""
        while len(self._buffer) < self.buffer_size and not self.exhausted:
            before = len(self._buffer)
            self._read(self.buffer_size - before)
            if len(self._buffer) > before:
                self._productive_at = self.source.rows_passed
            else:                       # everything read was skipped: fail rather than cycle forever
                self.source.check_progress(self._productive_at)

    def _read(self, want: int) -> None:
        """Read ``want`` rows not taken yet, transform them (on the pool) and buffer what is not skipped."""
        raws = []
        while len(raws) < want:
            before = self._here()
            try:
                index, row, where = self.source.next_raw()
            except StopIteration:
                self.exhausted = True
                log.info("source %r: exhausted after epoch %d", self.name, self.source.epoch - 1)
                break
            if self.source.epoch > max(self.epochs_started):     # (a rebuild re-reads epochs already logged)
                self.epochs_started = self.epochs_started[1 - self.EPOCHS_KEPT:] + [self.source.epoch]
                log.info("source %r: starting epoch %d with a new order", self.name, self.source.epoch)
            self._seq += 1
            order = self.source.last_order if self.ordered else -1
            if index in self._taken:          # consumed before the last checkpoint: skip on rebuild
                self._taken[index] = (self._seq, order)
                self._productive_at += 1      # (a row taken is not a row skipped)
                continue
            raws.append((index, row, where, before, self._seq, order))
        apply, ahead = self.source.apply, self._ahead
        work = [r for r in raws if r[0] not in ahead]     # (a row a catch-up takes is delivered already)
        if self._pool is not None and len(work) > 1:
            done = list(self._pool.map(lambda r: apply(r[1], r[2]), work))
        else:
            done = [apply(r[1], r[2]) for r in work]
        records = dict(zip([r[0] for r in work], done))
        # what was not skipped; a row a catch-up takes later keeps its place only (_PLACE), not its bytes
        kept = [(index, records.get(index, _PLACE), before, seq, order) for index, _, _, before, seq, order in raws
                if records.get(index) is not SKIPPED]
        rows: list[tuple] = []
        held: list[tuple] = []          # the entries of ``rows``
        known = self._text_meta_rows([e[1] for e in kept])
        try:
            for e, row in zip(kept, known):
                try:
                    rows.append(row if row is not None else (0, 0, 0, 0.0) if e[1] is _PLACE else self._meta_row(e[1]))
                except _StrayPlaceholder as stray:
                    where = next((r[2] for r in raws if r[0] == e[0]), None)
                    if not self._skips(stray, where):
                        raise stray.named(self.name, e[0], where) from None
                    continue                # skipped as a row the transform failed on: read on
                held.append(e)
        finally:        # (the rows before one whose metadata raised are buffered, as when each was at once)
            slots = self._meta.put(rows, [e[4] for e in held])
            for (index, rec, before, seq, order), slot in zip(held, slots):
                self._buffer[index] = (rec, before, seq, slot, order)
        if not self._buffer:            # nothing buffered: the state moves past what was read
            self._base, self._taken = self._here(), {}

    def _skips(self, stray: _StrayPlaceholder, where) -> bool:
        """Whether the source skips the row at ``where`` whose text holds the image placeholder (its
        ``on_error="skip"``): then it is counted and logged as a row the transform failed on."""
        source = self.source
        if getattr(source, "on_error", "raise") != "skip" or not hasattr(source, "skip_sample"):
            return False
        source.skip_sample(where, stray.reason())
        return True

    def _text_meta_rows(self, records: list) -> list:
        """:meth:`_meta_row` of each text record as Tokenize gives it (most rows), None for the others (left to
        :meth:`_meta_row`): their ids are scanned for the image placeholder in one pass, not one per record
        (numpy's per-call cost was most of a row's bookkeeping). A hit leaves every row to :meth:`_meta_row`,
        which raises for the first stray one in order, as before."""
        tid, tensor = self.image_token_id, torch.Tensor
        out, arrays = [], []
        for record in records:
            row = None
            if type(record) is dict and "pixels" not in record and "image_patches" not in record:
                ids = record.get("input_ids")
                if type(ids) is tensor and ids.dim() == 1:
                    if tid is None:
                        row = (ids.shape[0], 0, 0, 0.0)
                    else:
                        a = ids.numpy()
                        arrays.append(a)
                        row = (len(a), 0, 0, 0.0)
            out.append(row)
        if arrays and (np.concatenate(arrays) == tid).any():
            return [None] * len(records)
        return out

    def _meta_row(self, record) -> tuple[int, int, int, float]:
        """(tokens with image placeholders, images, patches, sum of squared patches), computed once."""
        # a text record as Tokenize gives it (most rows): sequence_length's answer is its ids' length, read here
        # without the image walk and _text_ids' numpy view (1.1 vs 4.0 us a row)
        tid = self.image_token_id
        if type(record) is dict and "pixels" not in record and "image_patches" not in record:
            ids = record.get("input_ids")
            if type(ids) is torch.Tensor and ids.dim() == 1:
                if tid is not None and (ids.numpy() == tid).any():
                    raise _StrayPlaceholder(ids.numpy(), tid)
                return len(ids), 0, 0, 0.0
        ids = None
        if tid is not None and isinstance(record, dict) and "input_ids" in record:
            ids = _text_ids(record)
            if (ids == tid).any():
                raise _StrayPlaceholder(ids, tid)
        patches = list(record.get("image_patches", ())) if isinstance(record, dict) else []
        tokens = sequence_length(record, tid) if ids is None else _sequence_length(record, tid, ids)
        return tokens, len(patches), sum(patches), float(sum(x * x for x in patches))

    def metadata(self) -> BufferMeta:
        """What the Planner sees: keys, token counts (with image placeholders), image patch counts. A buffer
        unchanged since the last report (no sample taken or read: most sources of a mixture of hundreds, at
        most steps) gets that report again, read-only, instead of being gathered and checked anew."""
        self.fill()
        key = (self._meta.version, self.ordered)
        if self._reported is not None and self._reported[0] == key:
            return self._reported[1]
        n = len(self._buffer)
        idx = np.fromiter(self._buffer.keys(), np.int64, n)
        rows, order = self._meta.gather(np.fromiter(map(_SLOT, self._buffer.values()), np.int64, n))
        order = order if self.ordered else None
        meta = BufferMeta(self.name, idx, rows[:, 0].astype(np.int64), num_images=rows[:, 1].astype(np.int64),
                          patches=rows[:, 2].astype(np.int64), patches_sq=rows[:, 3], order=order)
        for column in (meta.index, meta.tokens, meta.num_images, meta.patches, meta.patches_sq, meta.order):
            if column is not None:
                column.flags.writeable = False
        self._reported = (key, meta)
        return meta

    def take(self, indices: Iterable[int]) -> dict[int, Any]:
        """Hand over (and forget) exactly these buffered samples."""
        out = {}
        for i in indices:
            i = int(i)
            if i not in self._buffer:
                raise ConfigError(f"source {self.name!r}: sample {i} is not in the read buffer; a plan may only "
                                  f"name samples from the metadata this loader reported")
            rec, _, seq, slot, order = self._buffer.pop(i)
            self._meta.free(slot)
            out[i] = rec
            self._taken[i] = (seq, order)
        self.served += len(out)
        # the state moves forward to the oldest sample still buffered; takes read after it are remembered
        if self._buffer:
            _, before, oldest, _, _ = next(iter(self._buffer.values()))
            self._base = before
            self._taken = {i: t for i, t in self._taken.items() if t[0] is None or t[0] > oldest}
        else:
            self._base = self._here()
            self._taken = {}
        return out

    def replay(self, snapshot: dict, consumed: Iterable[Iterable[int]]) -> dict:
        """Differential restore: back to ``snapshot`` (a :meth:`get_state`), then redo each later
        step's consumption (fill the buffer, take that step's indices, in order). The result is the
        state those steps left, because filling and taking are deterministic; returns it. A
        data-parallel part takes the indices it holds (a step's own ones are all in its buffer)."""
        self.reset(snapshot)
        return self.catch_up(consumed)

    def catch_up(self, consumed: Iterable[Iterable[int]]) -> dict:
        """Redo each later step's consumption from where this loader is now (no reset): fill the
        buffer, take that step's indices, in order; returns the state those steps left. A loader
        started at a state and caught up this way holds what :meth:`replay` would rebuild (filling
        is deterministic and a full buffer fills no further, so when it filled does not matter). A row
        these steps take is read but not transformed: only its place in the read order matters here.
        A data-parallel part takes the indices it holds (a step's own ones are all in its buffer)."""
        part = getattr(self.source, "part", (0, 1))[1] > 1
        consumed = [[int(i) for i in indices] for indices in consumed]
        # every row these steps take was delivered (transformed, not skipped) when they were served: it is
        # read again for its place in the order, and not transformed again (a catch-up reads, not decodes)
        self._ahead = {i for indices in consumed for i in indices}
        try:
            for indices in consumed:
                self.fill()
                self.take([i for i in indices if i in self._buffer] if part else indices)   # a part: its own ones
        finally:
            self._ahead = set()
        left = [i for i, entry in self._buffer.items() if entry[0] is _PLACE]
        if left:
            raise ConfigError(f"source {self.name!r}: a catch-up left samples {left[:5]} in the buffer untransformed; "
                              f"the consumption it replayed is not this source's")
        return self.get_state()

    def stats(self) -> dict:
        """Buffer size and bytes, samples served, row groups read, the latest epochs started (:data:`EPOCHS_KEPT`),
        exhaustion, and the exact skip counts since this loader started (``skipped``: files/rows skipped, once per
        epoch; ``skipped_distinct``: how many files/rows; ``skipped_files``: the files skipped whole)."""
        return {"buffered": len(self._buffer), "buffer_bytes": self.buffer_bytes, "served": self.served,
                "row_groups_read": getattr(self.source, "reads", None),
                "epochs_started": list(self.epochs_started), "exhausted": self.exhausted, **self.skip_stats()}

    NO_SKIPS = {"skipped": 0, "skipped_distinct": 0, "skipped_files": {}}

    def skip_stats(self) -> dict:
        """The source's skip counts (its ``skips`` log's); a source without one (the member is optional in
        the :class:`~torchdata_overlord.Source` protocol) skips nothing it counts: zeros, the same keys."""
        skips = getattr(self.source, "skips", None)
        return dict(self.NO_SKIPS, skipped_files={}) if skips is None else skips.stats()

    @property
    def buffer_bytes(self) -> int:
        """Bytes of buffered records plus the Arrow row group the source holds."""
        return sum(record_bytes(entry[0]) for entry in self._buffer.values()) + self.source.buffer_bytes

    def close(self) -> None:
        self._buffer.clear()
        self._meta.clear()
        if self._pool is not None:          # (a thread stuck in a transform is left, said, and does not block exit)
            self._pool.shutdown(self.POOL_STOP_WAIT)
            self._pool = None
        self.source.close()

    def __len__(self) -> int:
        return len(self._buffer)
