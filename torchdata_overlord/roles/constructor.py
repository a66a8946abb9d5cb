"""Data Constructor: turns one bucket's share of a step's Plan into what each trainer client receives.

One constructor serves one bucket of a plan (e.g. one DP group, paper section 3). Given the
step's :class:`~torchdata_overlord.plane.plan.Plan`, the bucket index and the staged samples
(the records the Source Loaders produced, keyed by :class:`SampleKey`), :meth:`DataConstructor.build`
applies the *microbatch transforms* (packing with ``cu_seqlens``/``position_ids``, padding,
labels) and the *parallelism transforms* (zig-zag context-parallel split, pipeline-stage and
tensor-parallel trimming). Everything in and out is plain data (dicts, lists, ints, strs and
torch tensors), so the same call can later run behind RPC.

A sample's *backbone sequence* is its image placeholders followed by its text ids
(LLaVA-style): ``[image_token_id] * patches + input_ids`` (see :func:`sequence_of`). A Source
Loader reports :func:`sequence_length` as the sample's token count, so the plan's token caps
hold for the packed rows.

Each microbatch dict holds the :func:`~torchdata_overlord.transforms.pack` fields (``input_ids``,
``labels``, ``loss_mask``, ``position_ids``, ``segment_ids``, ``cu_seqlens``, ``cu_seqlens_padded``,
``max_seqlen``), with every sequence padded to a multiple of 2*cp and split per sequence by
:func:`~torchdata_overlord.transforms.split_packed` (adding ``cp_rank``, ``cp_size``, ``token_index``)
for the CP ranks of a ``distribute("DP")`` bucket; ``sample_keys`` (one ``"source:index"`` per
sequence, in order); ``spans`` (one dict per sequence that is a shard of a sequence spanning CP
ranks under ``distribute("CP")``: ``key``, ``shard``, ``nshards``, ``token_index`` (its global
positions, also its ``position_ids``), ``tokens``, ``piece``, ``npieces``, ``segment``, ``offset``,
``length``); and, when it holds images, ``image_keys``, ``image_grid`` (n, 2), ``image_segments``
(n,), ``image_positions`` (n, 2) = (start, length) of the image's placeholder run in the packed row
before any CP split (for a CP span: in that sequence's own positions), ``image_patch_offsets`` (n,)
(first patch of the run, > 0 only where a piece boundary cuts an image), and ``pixels`` (list of
uint8 tensors) or, with an encoder module, ``image_encoder_rank`` (n,). ``torchdata_overlord.batch``
is the full contract (dtypes, shapes, padding values).

Tensors are shared, not copied, between the clients of one bucket (a pipeline stage's metadata
is the same ``position_ids`` tensor as stage 0's), and the per-token tensors of one build are views
of one array per field (all its microbatches are packed, and CP-split, in one pass): treat the
outputs as read-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, islice
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import ConfigError, OverlordError, OversizeSampleError
from ..plane.plan import Plan, PlanItem, row_cp
from ..plane.records import SampleKey, make_key
from ..transforms.cp_split import _zigzag_chunks, zigzag_indices
from ..transforms.packing import PER_TOKEN_FIELDS, _cumulative, _entries, _pack_chunks, _row_length

__all__ = ["DataConstructor", "MissingSampleError", "sequence_length", "sequence_of", "record_images",
           "image_key", "bucket_inputs", "receives_nothing"]

# packed-row fields that a pipeline stage > 0 keeps (labels/loss_mask only on the last stage)
_DROP_ON_METADATA = ("input_ids", "pixels")
_LAST_STAGE_ONLY = ("labels", "loss_mask")
# the packed-row fields that stay whole on a context-parallel rank (it receives a zig-zag shard of the rest)
_ROW_FIELDS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")


class MissingSampleError(OverlordError, KeyError):
    """A planned sample is not among the staged samples given to the Data Constructor."""

    def __str__(self) -> str:  # KeyError would print the message's repr
        return str(self.args[0])


# -- records ----------------------------------------------------------------------------------

def record_images(record: Mapping[str, Any]) -> list[tuple[torch.Tensor, tuple[int, int], int]]:
    """The images of a sample record as ``(pixels 3xHxW uint8, (gh, gw), patches)``, in sequence order.

    ``pixels`` is one ``3xHxW`` tensor (``grid`` a pair, as :class:`~torchdata_overlord.transforms.ImageText`
    gives) or a list of them (``grid`` a list of pairs); per-image patch counts come from
    ``image_patches`` (else ``patches`` for one image, else ``gh * gw``). No ``pixels``: no images.
    """
    px = record.get("pixels")
    if px is None:
        return []
    if isinstance(px, torch.Tensor):
        pixels, grids = [px], [record["grid"]]
    else:
        pixels, grids = list(px), list(record["grid"])
    grids = [(int(g[0]), int(g[1])) for g in grids]
    patches = record.get("image_patches")
    if patches is None:
        patches = [record["patches"]] if isinstance(px, torch.Tensor) and "patches" in record else \
            [gh * gw for gh, gw in grids]
    patches = [int(p) for p in patches]
    if not len(pixels) == len(grids) == len(patches):
        raise ConfigError(f"sample record has {len(pixels)} images but {len(grids)} grids and "
                          f"{len(patches)} patch counts; they must match one to one")
    return list(zip(pixels, grids, patches))


def _text_ids(record: Mapping[str, Any]) -> np.ndarray:
    """A record's text ids as int64 numpy (a view of its tensor where it is one)."""
    ids = record["input_ids"]
    if type(ids) is torch.Tensor and ids.dtype is torch.int64:   # what Tokenize gives
        out = ids.numpy()
        if out.ndim == 1:
            return out
    return torch.as_tensor(ids).reshape(-1).numpy().astype(np.int64, copy=False)


def _int64(values: list | int, pairs: bool = False) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64)`` (a list or a scalar), through numpy (about a third of the
    cost for a short list, and torch.tensor lets other threads take the GIL); ``pairs``: shaped (n, 2)."""
    out = np.array(values, np.int64)
    return torch.from_numpy(out.reshape(-1, 2) if pairs else out)


def sequence_length(record: Mapping[str, Any], image_token_id: int | None) -> int:
    """Backbone tokens of a record: its text tokens, plus its patches when it has pixels and
    ``image_token_id`` is not None (the token count a Source Loader reports to the Planner)."""
    return _sequence_length(record, image_token_id, _text_ids(record))


def _sequence_length(record: Mapping[str, Any], image_token_id: int | None, ids: np.ndarray) -> int:
    """:func:`sequence_length` given the record's :func:`_text_ids` (a caller that has them already)."""
    n = len(ids)
    if image_token_id is not None:
        n += sum(p for _, _, p in record_images(record))
    return n


def sequence_of(record: Mapping[str, Any], image_token_id: int | None) -> torch.Tensor:
    """The backbone sequence (int64, 1-D): ``[image_token_id] * patches`` per image, then the text ids."""
    ids = _text_ids(record)
    n = _placeholders(record_images(record), image_token_id)
    return torch.from_numpy(_backbone(ids, image_token_id, n, 0, n + len(ids)))


def _placeholders(images: list, image_token_id: int | None) -> int:
    """How many image placeholders lead a record's backbone sequence, given its :func:`record_images`."""
    return sum(p for _, _, p in images) if image_token_id is not None else 0


def _backbone(ids: np.ndarray, image_token_id: int | None, n: int, a: int, b: int) -> np.ndarray:
    """Tokens ``a:b`` of the backbone sequence ``[image_token_id] * n`` then ``ids``, without building
    the rest of it (a view of ``ids`` where they hold them all)."""
    if a >= n:
        return ids[a - n:b - n]
    if b <= n:
        return np.full(b - a, image_token_id, np.int64)
    out = np.empty(b - a, np.int64)
    out[:n - a] = image_token_id
    out[n - a:] = ids[:b - n]
    return out


def image_key(key: SampleKey, i: int, n: int) -> str:
    """Name of image ``i`` of ``n`` of a sample: ``"source:index"``, or ``"source:index#i"`` when n > 1."""
    return str(key) if n == 1 else f"{key}#{i}"


def receives_nothing(plan: Plan, rank: int) -> tuple[bool, object]:
    """``(True, what build gives rank)`` when ``rank`` gets no data and no metadata this step (a
    ``broadcast_at`` receiver, also in the encoder module), so a client need not ask; else ``(False, None)``."""
    encoder = plan.modules.get("encoder")
    if plan.delivery(rank) != "none" or (encoder is not None and encoder.delivery(rank) != "none"):
        return False, None
    return True, {"delivery": "none", "microbatches": None, "encoder": None}


def bucket_inputs(plan: Plan, bucket: int) -> dict[str, set[int]]:
    """source -> sample indices that :meth:`DataConstructor.build` reads for ``bucket``: its
    backbone entries, and the encoder-bucket entries of its ranks when the plan has an encoder module."""
    def rows_of(p: Plan, mask) -> dict[str, set[int]]:
        recs, rows = p.records, p.entries["row"][mask]
        out: dict[str, set[int]] = {}
        for sid, idx in zip(recs.source_id[rows].tolist(), recs.index[rows].tolist()):
            out.setdefault(recs.sources[sid], set()).add(int(idx))
        return out

    need = rows_of(plan, plan.entries["bucket"] == bucket)
    encoder = plan.modules.get("encoder")
    if encoder is not None:
        ebs = {encoder.bucket_of(r) for r in plan.buckets[bucket] if encoder.delivery(r) != "none"}
        e = encoder.entries
        first = (e["piece"] == 0) & (e["shard"] == 0)
        for src, idx in rows_of(encoder, first & np.isin(e["bucket"], list(ebs))).items():
            need.setdefault(src, set()).update(idx)
    return need


# -- one microbatch ---------------------------------------------------------------------------

@dataclass
class _Image:
    key: str
    pixels: torch.Tensor
    grid: tuple[int, int]
    start: int | None        # in the segment's coordinates (the piece for a CP span); None: no placeholders
    length: int
    patch_offset: int


class _Segment:
    """What one microbatch places of one planned item (a plain slotted class: a build makes one per sample)."""

    __slots__ = ("key", "ids", "padded", "span", "overrides", "images")

    def __init__(self, key: SampleKey, ids: np.ndarray):
        self.key = key
        self.ids = ids              # the real tokens (a span shard: the real ones it holds)
        self.padded = None          # a span shard's length in the row, its padding included
        self.span = None            # for a shard of a sequence spanning CP ranks
        self.overrides = _NO_OVERRIDES   # labels / loss_mask / position_ids of a span shard (replaced, never mutated)
        self.images = _NO_IMAGES    # _Image of the images it holds (a list of its own once it has one)


_NO_OVERRIDES: Mapping = {}
_NO_IMAGES: tuple = ()


class DataConstructor:
    """Builds, for each client of one bucket of a plan, what it receives this step.

    ``seq_len``: fixed packed-row length (``None``: padding-free rows, rounded up to ``2*cp``
    where rows are CP-split). ``pad_id`` / ``ignore_index``: padding token and ignored label.
    ``image_token_id``: the placeholder id of image patches in the backbone sequence (``None``:
    text-only rows; images still ride along, without ``image_positions``).
    """

    def __init__(self, seq_len: int | None, pad_id: int = 0, ignore_index: int = -100,
                 image_token_id: int | None = None):
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
            raise ConfigError(f"DataConstructor: seq_len must be None or an integer >= 1, got {seq_len!r}")
        self.seq_len, self.pad_id, self.ignore_index = seq_len, int(pad_id), int(ignore_index)
        self.image_token_id = None if image_token_id is None else int(image_token_id)

    def __repr__(self) -> str:
        return (f"DataConstructor(seq_len={self.seq_len}, pad_id={self.pad_id}, ignore_index={self.ignore_index}, "
                f"image_token_id={self.image_token_id})")

    # -- public ----------------------------------------------------------------------------------
    def build(self, plan: Plan, bucket: int, samples: Mapping[SampleKey, dict]) -> dict[int, object]:
        """rank -> what that client receives this step, for every rank in ``plan.buckets[bucket]``:
        always ``{"delivery", "microbatches", "encoder"}`` (:class:`~torchdata_overlord.batch.Batch`
        without its ``step``). ``microbatches`` is None for the ``"none"`` delivery, else one dict per
        microbatch (``"metadata"`` for pipeline stages > 0: no ``input_ids`` and pixels,
        ``labels``/``loss_mask`` on the last stage only); ``encoder`` holds the images this rank's
        encoder bucket embeds (None without ``plan.modules["encoder"]``, or when it embeds none).
        """
        if isinstance(bucket, bool) or not isinstance(bucket, int) or not 0 <= bucket < len(plan.buckets):
            raise ConfigError(f"step {plan.step}: bucket {bucket!r} is outside 0..{len(plan.buckets) - 1} "
                              f"(the plan has {len(plan.buckets)} buckets along {plan.axis!r})")
        cp = row_cp(plan.mesh, plan.axis)
        if cp > 1 and self.seq_len is not None and self.seq_len % (2 * cp):
            raise ConfigError(f"DataConstructor: seq_len={self.seq_len} must be a multiple of 2*cp={2 * cp} to split "
                              f"packed rows over {cp} CP ranks; choose seq_len={-(-self.seq_len // (2 * cp)) * 2 * cp}")
        encoder = plan.modules.get("encoder")
        enc_rank = self._encoder_ranks(encoder) if encoder is not None else None
        segs = self._segments(plan, bucket, samples)
        layouts = [self._layout(plan, bucket, m, ss, cp) for m, ss in enumerate(segs)]
        rows = [self._row(plan, ss, lay, enc_rank) for ss, lay in zip(segs, layouts)]
        splits = self._fill(rows, segs, layouts, cp)      # microbatch -> every CP rank's shard, shared by PP stages
        pp_last = plan.mesh.sizes.get("pp", 1) - 1
        out: dict[int, object] = {}
        enc_cache: dict[int, dict] = {}
        kept = self._truncated(plan) if encoder is not None else None
        for r in plan.buckets[bucket]:
            delivery = plan.delivery(r)
            if delivery == "none":
                mbs = None
            else:
                c = plan.mesh.coords(r)
                cp_rank = c.get("cp", 0)
                mbs = [self._client_view(row, splits[m][cp_rank] if cp > 1 else None, delivery == "metadata",
                                         c.get("pp", 0) == pp_last) for m, row in enumerate(rows)]
            out[r] = {"delivery": delivery, "microbatches": mbs,
                      "encoder": None if encoder is None else self._encoder_part(encoder, r, samples, enc_cache, kept)}
        return out

    # -- samples -----------------------------------------------------------------------------------
    @staticmethod
    def _sample(samples: Mapping[SampleKey, dict], key: SampleKey, step: int, bucket, where: str | int) -> dict:
        """The staged record of ``key``, planned for ``where`` (a backbone microbatch's index, or a phrase)."""
        try:
            return samples[key]
        except KeyError:
            where = f"microbatch {where}" if isinstance(where, int) else where
            raise MissingSampleError(
                f"step {step}: sample {key} is planned for {where} of bucket {bucket} but is not among the "
                f"{len(samples)} staged samples; the Source Loaders must stage every planned sample of the step "
                f"(keyed by SampleKey(source, index))") from None

    def _bounds(self, plan: Plan, item: PlanItem, full: int) -> tuple[int, int]:
        """[a, b): the tokens of the full sequence this item places (a piece, a truncation or all)."""
        if item.npieces > 1:
            limit = plan.stats.get("oversize", {}).get("limit")
            if not limit:
                raise ConfigError(f"step {plan.step}: sample {item.key} is split into {item.npieces} pieces but "
                                  f"the plan's stats carry no oversize limit")
            a = item.piece * int(limit)
        else:
            a = 0
        b = a + item.tokens
        if b > full or (item.npieces > 1 and item.piece == item.npieces - 1 and b != full):
            hint = "" if self.image_token_id is not None else \
                " (if the Source Loader counted image patches, pass image_token_id to the DataConstructor)"
            raise ConfigError(f"step {plan.step}: sample {item.key} has {full} backbone tokens but the plan places "
                              f"tokens {a}..{b} of it (piece {item.piece} of {item.npieces}); the staged record does "
                              f"not match the metadata the plan was made from{hint}")
        return a, b

    def _segments(self, plan: Plan, bucket: int, samples) -> list[list[_Segment]]:
        """Every microbatch's :class:`_Segment` of ``bucket``, from the plan's columns: a whole text sample
        (most of them) takes :meth:`_segment`'s first return inline, without a :class:`PlanItem` or a call
        (per-sample Python was a third of a build's cost)."""
        bounds, cols = plan.bucket_columns(bucket)
        out: list[list[_Segment]] = []
        entries = zip(*cols)
        tensor, int64 = torch.Tensor, torch.int64
        for m in range(len(bounds) - 1):
            segs: list[_Segment] = []
            for entry in islice(entries, bounds[m + 1] - bounds[m]):
                source, index, tokens, piece, npieces, shard, nshards = entry
                key = make_key((source, index))
                try:
                    record = samples[key]
                except KeyError:
                    record = self._sample(samples, key, plan.step, bucket, m)    # (raises, naming the sample)
                ids = record["input_ids"]
                if npieces == nshards == 1 and type(ids) is tensor and ids.dtype is int64 and ids.dim() == 1:
                    ids = ids.numpy()
                    if record.get("pixels") is None:
                        if len(ids) == tokens:
                            segs.append(_Segment(key, ids))
                            continue
                    elif self.image_token_id is not None:
                        seg = self._whole_image_sample(key, record, ids, tokens)
                        if seg is not None:
                            segs.append(seg)
                            continue
                segs.append(self._segment(plan, bucket, m, PlanItem(*entry), samples))
            out.append(segs)
        return out

    def _whole_image_sample(self, key: SampleKey, record: Mapping[str, Any], ids: np.ndarray,
                            tokens: int) -> _Segment | None:
        """:meth:`_segment` of a whole (one piece, no CP span) sample with one image and its placeholders, as
        ImageText gives it: placeholders then text ids, the image's run first. None for anything else (the
        plan truncates it, no patch), which :meth:`_segment` handles."""
        imgs = record_images(record)
        if len(imgs) != 1:
            return None
        px, grid, p = imgs[0]
        if p <= 0 or tokens != p + len(ids):
            return None
        seg = _Segment(key, _backbone(ids, self.image_token_id, p, 0, tokens))
        seg.images = [_Image(str(key), px, grid, 0, p, 0)]
        return seg

    def _segment(self, plan: Plan, bucket: int, m: int, item: PlanItem, samples) -> _Segment:
        """What microbatch ``m`` places of ``item``'s staged record: its tokens, images and CP span."""
        key = item.key
        record = self._sample(samples, key, plan.step, bucket, m)
        ids = _text_ids(record)
        if item.tokens == len(ids) and item.npieces == item.nshards == 1 and record.get("pixels") is None:
            return _Segment(key, ids)     # a whole text sample (most of them): its ids as they are
        imgs = record_images(record)
        n = _placeholders(imgs, self.image_token_id)
        a, b = self._bounds(plan, item, n + len(ids))
        piece = _backbone(ids, self.image_token_id, n, a, b)
        seg = _Segment(key, piece)
        seg.images = []
        if not imgs and item.nshards == 1:      # plain text
            return seg
        # where each image's placeholder run sits in the full sequence
        runs, pos = [], 0
        for i, (px, grid, p) in enumerate(imgs):
            runs.append((image_key(key, i, len(imgs)), px, grid, pos, p))
            pos += p
        if item.nshards > 1:
            k, T = item.nshards, b - a
            padded_len = -(-T // (2 * k)) * 2 * k
            idx = zigzag_indices(padded_len, k, item.shard).numpy()
            padded = np.full(padded_len, self.pad_id, np.int64)
            padded[:T] = piece
            labels = np.full(padded_len, self.ignore_index, np.int64)
            labels[:T - 1] = piece[1:]
            mask = np.zeros(padded_len, bool)
            mask[:T - 1] = True
            seg.ids = padded[idx[idx < T]]         # the shard's real tokens come first (padding ends the piece)
            seg.padded = len(idx)
            seg.overrides = {"labels": labels[idx], "loss_mask": mask[idx], "position_ids": idx.copy()}
            seg.span = {"key": str(key), "shard": item.shard, "nshards": k, "token_index": torch.from_numpy(idx),
                        "tokens": T, "piece": item.piece, "npieces": item.npieces}
            for ik, px, grid, s, p in runs:        # images whose placeholders this shard holds
                lo, hi = max(a, s) - a, min(b, s + p) - a
                if self.image_token_id is None:
                    if item.piece == 0 and item.shard == 0:
                        seg.images.append(_Image(ik, px, grid, None, p, 0))
                elif lo < hi and bool(((idx >= lo) & (idx < hi)).any()):
                    seg.images.append(_Image(ik, px, grid, lo, hi - lo, max(a, s) - s))
            return seg
        for ik, px, grid, s, p in runs:
            if self.image_token_id is None:
                if item.piece == 0:
                    seg.images.append(_Image(ik, px, grid, None, p, 0))
                continue
            lo, hi = max(a, s), min(b, s + p)
            if lo < hi:
                seg.images.append(_Image(ik, px, grid, lo - a, hi - lo, lo - s))
        return seg

    # -- packing -----------------------------------------------------------------------------------
    def _layout(self, plan: Plan, bucket: int, m: int, segs: list[_Segment], cp: int) -> tuple[list[int], list[int]]:
        """Real and padded lengths of a microbatch's entries in its packed row (the trailing padding entry included)."""
        mult = 2 * cp if cp > 1 else 1                 # every sequence padded to a multiple of 2*cp (THD with CP)
        lengths = [len(s.ids) for s in segs]
        padded = [s.padded if s.padded is not None else -(-n // mult) * mult for s, n in zip(segs, lengths)]
        # a microbatch with no token (none planned, or only empty samples): one padding row, never length 0
        seq_len = self.seq_len if self.seq_len is not None or sum(padded) else mult
        try:
            length = _row_length(lengths, padded, seq_len, mult)
        except OversizeSampleError as e:
            names = [str(s.key) for s in segs[:6]] + (["..."] if len(segs) > 6 else [])
            raise OversizeSampleError(
                f"step {plan.step}: microbatch {m} of bucket {bucket} holds {sum(padded)} tokens, more than seq_len="
                f"{self.seq_len} ({len(segs)} sequences: {', '.join(names)}); plan with max_tokens <= seq_len "
                f"(with cp > 1 every sequence takes a multiple of 2*cp tokens; a sequence spanning k CP ranks takes "
                f"2*ceil(n / 2k) tokens per rank)") from e
        return _entries(lengths, padded, length)

    def _row(self, plan: Plan, segs: list[_Segment], layout: tuple[list[int], list[int]], enc_rank) -> dict:
        """A microbatch's dict, its per-token fields None until :meth:`_fill` gives them."""
        real, padded = layout
        cu_padded = _cumulative(padded)
        cu = cu_padded.tolist()                          # where each sequence sits in the row
        row: dict = dict.fromkeys(PER_TOKEN_FIELDS)
        row["cu_seqlens"] = torch.from_numpy(_cumulative(real))
        row["cu_seqlens_padded"] = torch.from_numpy(cu_padded)
        row["max_seqlen"] = torch.from_numpy(np.array(max(real[:len(segs)], default=0), np.int32))
        row["sample_keys"] = [str(s.key) for s in segs]
        row["spans"] = [{**s.span, "segment": j, "offset": cu[j], "length": cu[j + 1] - cu[j]}
                        for j, s in enumerate(segs) if s.span is not None]
        images = [(j, im) for j, s in enumerate(segs) for im in s.images]
        if images:
            row["image_keys"] = [im.key for _, im in images]
            row["image_grid"] = _int64([im.grid for _, im in images], pairs=True)
            row["image_segments"] = _int64([j for j, _ in images])
            if self.image_token_id is not None:
                # start in the packed row (before any CP split); for a CP span, in its sequence's coordinates
                row["image_positions"] = _int64(
                    [(im.start if segs[j].span is not None else cu[j] + im.start, im.length) for j, im in images],
                    pairs=True)
                row["image_patch_offsets"] = _int64([im.patch_offset for _, im in images])
            if enc_rank is None:
                row["pixels"] = [im.pixels for _, im in images]
            else:
                row["image_encoder_rank"] = _int64(
                    [self._encoder_rank_of(enc_rank, segs[j].key, plan.step) for j, _ in images])
        return row

    def _fill(self, rows: list[dict], segs: list[list[_Segment]], layouts: list[tuple[list[int], list[int]]],
              cp: int) -> list[list[dict]]:
        """Packs every microbatch of the build in one :func:`~torchdata_overlord.transforms.packing._pack_chunks`
        pass (per-row numpy calls, not per-token work, dominated a row's cost). With cp == 1 it fills
        each row's per-token fields (views of the build's arrays) and returns ``[]``; with cp > 1 it
        returns every row's CP shards, laid out shard after shard, from :meth:`_shards`."""
        real, padded, segment, row_of, starts = [], [], [], [], []
        for m, (ss, (r, p)) in enumerate(zip(segs, layouts)):
            real += r
            padded += p
            segment += [*range(len(ss)), *[-1] * (len(p) - len(ss))]
            row_of += [m] * len(p)
            starts += accumulate(p[:-1], initial=0)         # each entry's start in its row
        sizes = np.asarray(padded, np.int64)
        if cp > 1:
            chunks = _zigzag_chunks(sizes, np.asarray(row_of, np.int64), cp, np.arange(cp))
            offset = np.asarray(starts, np.int64)
        else:
            chunks, offset = (np.arange(len(padded)), np.zeros(len(padded), np.int64), sizes), None
        arrays = _pack_chunks([s.ids for ss in segs for s in ss], np.asarray(real, np.int64),
                              np.asarray(segment, np.int64), *chunks, self.pad_id, self.ignore_index, offset)
        scalars = [_int64(r) for r in range(cp + 1)]           # cp_rank 0..cp-1, then cp_size
        splits, at = [], 0
        for row, ss, (_, p) in zip(rows, segs, layouts):
            length = sum(p)
            if cp > 1:
                splits.append(self._shards(row, arrays, at, length // cp, scalars))
            else:
                self._override_spans(arrays, at, ss, row["cu_seqlens_padded"].tolist())
                row.update({k: torch.from_numpy(arrays[k][at:at + length]) for k in PER_TOKEN_FIELDS})
            at += length
        if self.image_token_id is not None:
            self._no_placeholder_targets(arrays)
        return splits

    def _no_placeholder_targets(self, arrays: dict) -> None:
        """An image placeholder is never a target: where ``labels`` is ``image_token_id`` (the token before an
        image's run and every token of the run but its last), it becomes ``ignore_index`` and ``loss_mask`` False,
        as LLaVA-style trainers mask image positions (the rows' tensors are views of these arrays)."""
        labels = arrays["labels"]
        hit = labels == self.image_token_id
        if hit.any():
            labels[hit] = self.ignore_index
            np.greater(arrays["loss_mask"], hit, out=arrays["loss_mask"])   # mask & ~hit (a boolean-index write: 20x)

    @staticmethod
    def _shards(row: dict, arrays: dict, at: int, n: int, scalars: list) -> list[dict]:
        """Every CP rank's zig-zag shard of the row whose shards start at ``at`` of the build's arrays
        (``n`` tokens each), as :func:`~torchdata_overlord.transforms.split_packed` gives it (the 0-d
        ``cp_rank``/``cp_size`` of ``scalars`` shared by the build's rows)."""
        out = []
        for r in range(len(scalars) - 1):
            lo = at + r * n
            shard = {k: torch.from_numpy(arrays[k][lo:lo + n]) for k in PER_TOKEN_FIELDS}
            shard.update({k: row[k] for k in _ROW_FIELDS})
            shard["cp_rank"], shard["cp_size"], shard["token_index"] = \
                scalars[r], scalars[-1], torch.from_numpy(arrays["token_index"][lo:lo + n])
            out.append(shard)
        return out

    @staticmethod
    def _override_spans(arrays: dict, at: int, segs: list[_Segment], cu: list[int]) -> None:
        """Writes the labels / loss_mask / position_ids of each CP span shard's sequence into the row at ``at``."""
        for j, s in enumerate(segs):
            for k, v in s.overrides.items():
                arrays[k][at + cu[j]:at + cu[j + 1]] = v

    def _client_view(self, row: dict, split: dict | None, metadata: bool, last_stage: bool) -> dict:
        out = dict(row)
        if split is not None:
            out.update(split)
        if metadata:
            for k in _DROP_ON_METADATA:
                out.pop(k, None)
            if not last_stage:
                for k in _LAST_STAGE_ONLY:
                    out.pop(k, None)
        return out

    # -- encoder module ----------------------------------------------------------------------------
    @staticmethod
    def _encoder_ranks(encoder: Plan) -> dict[SampleKey, int]:
        """sample key -> first receiving rank of the encoder bucket that embeds its images."""
        e = encoder.entries
        first = (e["piece"] == 0) & (e["shard"] == 0)
        firsts = []
        for ranks in encoder.buckets:
            got = [r for r in ranks if encoder.delivery(r) != "none"]
            firsts.append(min(got) if got else -1)
        keys = encoder.records.keys(e["row"][first])
        return {k: firsts[int(b)] for k, b in zip(keys, e["bucket"][first])}

    @staticmethod
    def _encoder_rank_of(enc_rank: dict, key: SampleKey, step: int) -> int:
        r = enc_rank.get(key)
        if r is None or r < 0:
            raise ConfigError(f"step {step}: the images of sample {key} are in the backbone plan but no encoder bucket "
                              f"embeds them; plan the encoder graph over every image sample of the step "
                              f"(e.g. g.view('image').distribute('WORLD'))")
        return r

    def _truncated(self, plan: Plan) -> dict[SampleKey, int]:
        """sample key -> the backbone tokens the plan keeps of it, for each sample it truncates
        (``oversize="truncate"``; its sequence is cut after that many tokens). Empty without image_token_id:
        images then have no placeholders in the rows, and ride along with the sample's first entry."""
        if self.image_token_id is None:
            return {}
        e = plan.entries
        whole = (e["piece"] == 0) & (e["shard"] == 0) & (e["npieces"] == 1)
        cut = whole & (e["tokens"] < plan.records.tokens[e["row"]])
        if not cut.any():
            return {}
        return dict(zip(plan.records.keys(e["row"][cut]), e["tokens"][cut].tolist()))

    def _encoder_part(self, encoder: Plan, rank: int, samples, cache: dict, kept: dict) -> dict | None:
        """The images ``rank``'s encoder bucket embeds: every image of its samples (where a sample's first
        entry sits) that the backbone rows hold; an image whose placeholder run the backbone's truncation cut
        off entirely (``kept``, from :meth:`_truncated`) is not embedded. A run kept in part is: the rows
        hold its first patches (``image_patch_offsets`` 0, ``image_positions`` the shorter run)."""
        if encoder.delivery(rank) == "none":
            return None
        eb = encoder.bucket_of(rank)
        if eb in cache:
            return cache[eb]
        pixels, grids, keys, mbs = [], [], [], []
        for m, items in enumerate(encoder.bucket_microbatches(eb)):
            for it in items:
                if it.piece or it.shard:
                    continue  # every image of a sample is embedded once, where its first entry sits
                rec = self._sample(samples, it.key, encoder.step, eb, f"encoder microbatch {m}")
                imgs = record_images(rec)
                n, run = kept.get(it.key), 0        # n: the tokens the backbone keeps of a truncated sample
                for i, (px, grid, p) in enumerate(imgs):
                    held = n is None or min(n, run + p) > run     # its placeholder run [run, run + p), cut at n
                    run += p
                    if not held:
                        continue  # the truncation cut its whole placeholder run off: no row holds it
                    pixels.append(px)
                    grids.append(grid)
                    keys.append(image_key(it.key, i, len(imgs)))
                    mbs.append(m)
        cache[eb] = {"pixels": pixels, "image_grid": torch.tensor(grids, dtype=torch.int64).reshape(-1, 2),
                     "image_keys": keys, "image_microbatch": torch.tensor(mbs, dtype=torch.int64),
                     "bucket": eb}
        return cache[eb]
