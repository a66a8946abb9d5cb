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
is the same ``position_ids`` tensor as stage 0's): treat the outputs as read-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import ConfigError, OverlordError, OversizeSampleError
from ..plane.plan import Plan, PlanItem, row_cp
from ..plane.records import SampleKey
from ..transforms.cp_split import _cp_order, zigzag_indices
from ..transforms.packing import PER_TOKEN_FIELDS, _pack_arrays, _row_length

__all__ = ["DataConstructor", "MissingSampleError", "sequence_length", "sequence_of", "record_images",
           "image_key", "bucket_inputs", "receives_nothing"]

# packed-row fields that a pipeline stage > 0 keeps (labels/loss_mask only on the last stage)
_DROP_ON_METADATA = ("input_ids", "pixels")
_LAST_STAGE_ONLY = ("labels", "loss_mask")
# the packed-row fields a context-parallel rank receives as its zig-zag shard (the cu_seqlens stay whole)
_SPLIT_FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "segment_ids", "cu_seqlens",
                 "cu_seqlens_padded", "max_seqlen")


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
    if type(ids) is torch.Tensor and ids.dtype == torch.int64 and ids.dim() == 1:   # what Tokenize gives
        return ids.numpy()
    return torch.as_tensor(ids).reshape(-1).numpy().astype(np.int64, copy=False)


def sequence_length(record: Mapping[str, Any], image_token_id: int | None) -> int:
    """Backbone tokens of a record: its text tokens, plus its patches when it has pixels and
    ``image_token_id`` is not None (the token count a Source Loader reports to the Planner)."""
    n = len(_text_ids(record))
    if image_token_id is not None:
        n += sum(p for _, _, p in record_images(record))
    return n


def sequence_of(record: Mapping[str, Any], image_token_id: int | None) -> torch.Tensor:
    """The backbone sequence (int64, 1-D): ``[image_token_id] * patches`` per image, then the text ids."""
    return torch.from_numpy(_sequence(record, image_token_id, record_images(record)))


def _sequence(record: Mapping[str, Any], image_token_id: int | None, images: list) -> np.ndarray:
    """:func:`sequence_of` as numpy, given the record's :func:`record_images`."""
    ids = _text_ids(record)
    n = sum(p for _, _, p in images) if image_token_id is not None else 0
    return np.concatenate([np.full(n, int(image_token_id), np.int64), ids]) if n else ids


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


@dataclass
class _Segment:
    item: PlanItem
    ids: torch.Tensor                             # the real tokens (a span shard: the real ones it holds)
    padded: int | None = None                     # a span shard's length in the row, its padding included
    span: dict | None = None                      # for a shard of a sequence spanning CP ranks
    overrides: dict = field(default_factory=dict)  # labels / loss_mask / position_ids of a span shard
    images: list = field(default_factory=list)


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
        built = [self._microbatch(plan, bucket, m, items, samples, cp, enc_rank)
                 for m, items in enumerate(plan.bucket_microbatches(bucket))]
        scalars = {**{r: torch.tensor(r) for r in range(cp)}, "size": torch.tensor(cp)} if cp > 1 else {}
        pp_last = plan.mesh.sizes.get("pp", 1) - 1
        out: dict[int, object] = {}
        enc_cache: dict[int, dict] = {}
        splits: dict[int, list[dict]] = {}            # microbatch -> every CP rank's zig-zag shard, shared by PP stages
        for r in plan.buckets[bucket]:
            delivery = plan.delivery(r)
            if delivery == "none":
                mbs = None
            else:
                c = plan.mesh.coords(r)
                cp_rank = c.get("cp", 0)
                mbs = []
                for m, (row, arrays) in enumerate(built):
                    if cp > 1 and m not in splits:
                        splits[m] = self._split(row, arrays, cp, scalars)
                    mbs.append(self._client_view(row, splits[m][cp_rank] if cp > 1 else None, delivery == "metadata",
                                                 c.get("pp", 0) == pp_last))
            out[r] = {"delivery": delivery, "microbatches": mbs,
                      "encoder": None if encoder is None else self._encoder_part(encoder, r, samples, enc_cache)}
        return out

    # -- samples -----------------------------------------------------------------------------------
    @staticmethod
    def _sample(samples: Mapping[SampleKey, dict], key: SampleKey, step: int, bucket, where: str) -> dict:
        try:
            return samples[key]
        except KeyError:
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

    def _segment(self, plan: Plan, item: PlanItem, record: dict) -> _Segment:
        imgs = record_images(record)
        full = _sequence(record, self.image_token_id, imgs)
        a, b = self._bounds(plan, item, len(full))
        piece = full[a:b]
        seg = _Segment(item, piece)
        # where each image's placeholder run sits in the full sequence
        runs, pos = [], 0
        for i, (px, grid, p) in enumerate(imgs):
            runs.append((image_key(item.key, i, len(imgs)), px, grid, pos, p))
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
            seg.span = {"key": str(item.key), "shard": item.shard, "nshards": k, "token_index": torch.from_numpy(idx),
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
    def _microbatch(self, plan: Plan, bucket: int, m: int, items: list[PlanItem], samples, cp: int,
                    enc_rank) -> tuple[dict, dict]:
        segs = [self._segment(plan, it, self._sample(samples, it.key, plan.step, bucket, f"microbatch {m}"))
                for it in items]
        mult = 2 * cp if cp > 1 else 1                 # every sequence padded to a multiple of 2*cp (THD with CP)
        seq_len = self.seq_len if self.seq_len is not None or segs else mult   # an empty microbatch: padding
        ids = [s.ids for s in segs]
        lengths = [len(x) for x in ids]
        padded = [s.padded if s.padded is not None else -(-n // mult) * mult for s, n in zip(segs, lengths)]
        try:
            length = _row_length(lengths, padded, seq_len, mult)
        except OversizeSampleError as e:
            names = [str(s.item.key) for s in segs[:6]] + (["..."] if len(segs) > 6 else [])
            raise OversizeSampleError(
                f"step {plan.step}: microbatch {m} of bucket {bucket} holds {sum(padded)} tokens, more than seq_len="
                f"{self.seq_len} ({len(segs)} sequences: {', '.join(names)}); plan with max_tokens <= seq_len "
                f"(with cp > 1 every sequence takes a multiple of 2*cp tokens; a sequence spanning k CP ranks takes "
                f"2*ceil(n / 2k) tokens per rank)") from e
        arrays = _pack_arrays(ids, lengths, padded, length, self.pad_id, self.ignore_index)   # pack(), in numpy
        cu = arrays["cu_seqlens_padded"].tolist()         # where each sequence sits in the row
        spans = []
        for j, s in enumerate(segs):
            if s.span is None:
                continue
            lo, hi = cu[j], cu[j + 1]
            for k, v in s.overrides.items():
                arrays[k][lo:hi] = v
            spans.append({**s.span, "segment": j, "offset": lo, "length": hi - lo})
        row: dict = {k: torch.from_numpy(v) for k, v in arrays.items()}
        row["sample_keys"] = [str(s.item.key) for s in segs]
        row["spans"] = spans
        images = [(j, im) for j, s in enumerate(segs) for im in s.images]
        if images:
            row["image_keys"] = [im.key for _, im in images]
            row["image_grid"] = torch.tensor([im.grid for _, im in images], dtype=torch.int64).reshape(-1, 2)
            row["image_segments"] = torch.tensor([j for j, _ in images], dtype=torch.int64)
            if self.image_token_id is not None:
                # start in the packed row (before any CP split); for a CP span, in its sequence's coordinates
                row["image_positions"] = torch.tensor(
                    [(im.start if segs[j].span is not None else cu[j] + im.start, im.length) for j, im in images],
                    dtype=torch.int64).reshape(-1, 2)
                row["image_patch_offsets"] = torch.tensor([im.patch_offset for _, im in images], dtype=torch.int64)
            if enc_rank is None:
                row["pixels"] = [im.pixels for _, im in images]
            else:
                row["image_encoder_rank"] = torch.tensor(
                    [self._encoder_rank_of(enc_rank, segs[j].item.key, plan.step) for j, _ in images],
                    dtype=torch.int64)
        return row, arrays

    @staticmethod
    def _split(row: dict, arrays: dict, cp: int, scalars: dict) -> list[dict]:
        """Every CP rank's zig-zag shard of a packed row, as :func:`~torchdata_overlord.transforms.split_packed`
        gives it, taken from the row's numpy arrays: one gather per field in rank-major order, each rank's
        shard a view of it (the 0-d ``cp_rank``/``cp_size`` shared by its rows)."""
        order = _cp_order(arrays["cu_seqlens_padded"], cp)
        n = len(order) // cp
        gathered = {k: arrays[k][order] for k in PER_TOKEN_FIELDS}
        out = []
        for r in range(cp):
            lo, hi = r * n, (r + 1) * n
            shard = {k: (torch.from_numpy(gathered[k][lo:hi]) if k in gathered else row[k]) for k in _SPLIT_FIELDS}
            shard["cp_rank"], shard["cp_size"], shard["token_index"] = \
                scalars[r], scalars["size"], torch.from_numpy(order[lo:hi])
            out.append(shard)
        return out

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

    def _encoder_part(self, encoder: Plan, rank: int, samples, cache: dict) -> dict | None:
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
                for i, (px, grid, _) in enumerate(imgs):
                    pixels.append(px)
                    grids.append(grid)
                    keys.append(image_key(it.key, i, len(imgs)))
                    mbs.append(m)
        cache[eb] = {"pixels": pixels, "image_grid": torch.tensor(grids, dtype=torch.int64).reshape(-1, 2),
                     "image_keys": keys, "image_microbatch": torch.tensor(mbs, dtype=torch.int64),
                     "bucket": eb}
        return cache[eb]
