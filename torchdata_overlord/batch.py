"""The batch contract: what ``OverlordLoader`` yields each step, key by key, with dtypes, shapes and padding.

``for batch in OverlordLoader(..., rank=r)`` gives one :class:`Batch` per training step;
``rank=None`` gives ``{rank: Batch}`` for every rank of the mesh. ``batch["delivery"]`` says what
this rank receives (from the step's plan):

* ``"data"``: every microbatch in full (pipeline stage 0, or no pipeline);
* ``"metadata"``: pipeline stages > 0, which get activations from the previous stage: no
  ``input_ids`` and no ``pixels``, and ``labels``/``loss_mask`` on the last stage only;
* ``"none"``: ranks > 0 along a ``broadcast_at`` axis (e.g. TP): ``microbatches`` is None, the
  trainer broadcasts the data from rank 0 of that axis.

Every delivery has the same keys. With an encoder module in the plan (``plan(encoder=...)``),
``batch["encoder"]`` holds the images this rank's encoder bucket embeds (:class:`EncoderPart`; its lists
empty when the bucket embeds no image this step), whatever its backbone delivery; it is None on a rank
whose encoder delivery is ``"none"`` (a ``broadcast_at`` receiver of the encoder module), and without an
encoder module. The encoder embeds exactly the images the backbone rows hold: none of a sample the
backbone's ``balance(oversize="drop")`` dropped, none whose placeholder run ``oversize="truncate"`` cut off
entirely (an image cut in part is embedded whole; the row holds its first patches).

A sample is named ``"source:index"`` (``sample_keys``, ``key``, ``image_keys``): ``index`` is what the
source's ``next_raw`` gave, unique over the run. For ``ParquetSource`` and ``FileSource`` it is ``epoch *
num_rows + key``, where ``key`` is the row's dense place over the source's sorted files (the same in every
epoch): ``index % num_rows`` finds the row again, ``index // num_rows`` is the epoch. For ``NodeSource`` it is
the item's place in the node's stream.

Each microbatch is one packed row (:class:`Microbatch`) in TransformerEngine's THD layout: its
sequences back to back, ``cu_seqlens`` (real lengths, what attention covers) and
``cu_seqlens_padded`` (where each sequence sits), one entry per sequence plus one trailing
padding entry of real length 0 when the row is padded, so padding is never attended. On a mesh
with cp > 1 under ``distribute("DP")`` every sequence is padded to a multiple of 2*cp and CP rank
r holds chunks r and 2*cp-1-r of every sequence (``token_index`` says which row positions); the
``cu_seqlens`` stay global, as ring-attention kernels take them.

``max_tokens`` and ``seq_len``: ``balance(max_tokens=)`` caps the tokens the Planner puts in one
(bucket, microbatch): under ``distribute("DP")`` a DP group's packed row before the CP split, each
sequence counted at its padded length (so ``max_tokens`` >= 2*cp); under ``distribute("CP")`` one
rank's row (a longer sequence spans CP ranks). ``OverlordLoader(seq_len=)`` is the length every
row is padded to: choose ``seq_len >= max_tokens`` (a multiple of 2*cp), or a row that does not
fit raises ``OversizeSampleError`` naming the step and microbatch; ``seq_len=None`` makes each row
as long as its content (rounded up to 2*cp). A CP rank of a ``distribute("DP")`` bucket then
holds ``seq_len / cp`` tokens.

The classes are ``TypedDict`` s for type checkers; each key's annotation carries a :class:`Field`
(``typing.get_type_hints(Microbatch, include_extras=True)``, or :func:`fields`) describing it.
Symbols in shapes: ``T`` tokens this rank holds, ``E`` entries of the row (sequences, + 1 trailing
padding entry when padded), ``I`` images, ``N`` tokens of a span shard, ``H``/``W`` pixels.
"""

import typing
from dataclasses import dataclass
from typing import Annotated, Literal, NotRequired, TypedDict

import torch

__all__ = ["Batch", "Microbatch", "Span", "EncoderPart", "Field", "fields"]


@dataclass(frozen=True)
class Field:
    """One key of the contract: its Python type, tensor dtype and shape, value on padding, and when present."""

    type: type
    dtype: torch.dtype | None = None
    shape: tuple | None = None            # per tensor (for a list: per element); symbols as in the module doc
    pad: object = None                    # value on padding tokens (segment_ids == -1)
    when: str = "always"
    doc: str = ""


Tensor = torch.Tensor
_TOKEN = ("T",)


class Span(TypedDict):
    """A shard of a sequence spanning ``nshards`` CP ranks (``distribute("CP")``), in this rank's row."""

    key: Annotated[str, Field(str, doc="the sample, 'source:index'")]
    shard: Annotated[int, Field(int, doc="this rank's shard, 0..nshards-1 (zig-zag chunks shard, 2*nshards-1-shard)")]
    nshards: Annotated[int, Field(int, doc="CP ranks the sequence spans")]
    token_index: Annotated[Tensor, Field(Tensor, torch.int64, ("N",), doc="the shard's positions in its sequence")]
    tokens: Annotated[int, Field(int, doc="real tokens of the whole sequence (piece)")]
    piece: Annotated[int, Field(int, doc="piece of an oversize='split' sample, 0..npieces-1")]
    npieces: Annotated[int, Field(int, doc="pieces of the sample")]
    segment: Annotated[int, Field(int, doc="its entry in the row (index into sample_keys and the cu_seqlens)")]
    offset: Annotated[int, Field(int, doc="where the shard starts in the row")]
    length: Annotated[int, Field(int, doc="the shard's tokens in the row, its padding included (N)")]


class Microbatch(TypedDict):
    """One packed row, as this rank receives it."""

    input_ids: NotRequired[Annotated[Tensor, Field(Tensor, torch.int64, _TOKEN, "pad_id", "data",
                                                   "token ids (image placeholders = image_token_id)")]]
    labels: NotRequired[Annotated[Tensor, Field(Tensor, torch.int64, _TOKEN, -100, "data; metadata on the last "
                                                "pipeline stage", "next token within the sequence, else -100 (also where that "
                                                "token is an image placeholder: never a target)")]]
    loss_mask: NotRequired[Annotated[Tensor, Field(Tensor, torch.bool, _TOKEN, False, "as labels",
                                                   "True where labels is a real target")]]
    position_ids: Annotated[Tensor, Field(Tensor, torch.int64, _TOKEN, "counting on", doc="position in its sequence")]
    segment_ids: Annotated[Tensor, Field(Tensor, torch.int64, _TOKEN, -1, doc="the token's entry, -1 on padding")]
    cu_seqlens: Annotated[Tensor, Field(Tensor, torch.int32, ("E+1",), doc="cumulative real lengths (global)")]
    cu_seqlens_padded: Annotated[Tensor, Field(Tensor, torch.int32, ("E+1",),
                                               doc="cumulative padded lengths: entry offsets in the row (global)")]
    max_seqlen: Annotated[Tensor, Field(Tensor, torch.int32, (), doc="longest real sequence of the row")]
    sample_keys: Annotated[list, Field(list, doc="'source:index' per sequence, in row order (E without padding)")]
    spans: Annotated[list, Field(list, doc="a Span per sequence shard spanning CP ranks (distribute('CP'))")]
    cp_rank: NotRequired[Annotated[Tensor, Field(Tensor, torch.int64, (), when="cp > 1 under distribute('DP')",
                                                 doc="this rank's CP coordinate")]]
    cp_size: NotRequired[Annotated[Tensor, Field(Tensor, torch.int64, (), when="as cp_rank", doc="CP size")]]
    token_index: NotRequired[Annotated[Tensor, Field(Tensor, torch.int64, _TOKEN, when="as cp_rank",
                                                     doc="row positions held: chunks r, 2*cp-1-r of every entry")]]
    image_keys: NotRequired[Annotated[list, Field(list, when="images", doc="'source:index' (#i when several) each")]]
    image_grid: NotRequired[Annotated[Tensor, Field(Tensor, torch.int64, ("I", 2), when="images",
                                                    doc="patch rows, columns")]]
    image_segments: NotRequired[Annotated[Tensor, Field(Tensor, torch.int64, ("I",), when="images",
                                                        doc="the image's entry in the row")]]
    image_positions: NotRequired[Annotated[Tensor, Field(Tensor, torch.int64, ("I", 2), when="images and "
                                                         "image_token_id", doc="start, length of its placeholders "
                                                         "in the row before the CP split (a span: in its sequence)")]]
    image_patch_offsets: NotRequired[Annotated[Tensor, Field(Tensor, torch.int64, ("I",), when="as image_positions",
                                                             doc="first patch of the run (> 0 where a split cut it)")]]
    pixels: NotRequired[Annotated[list, Field(list, torch.uint8, (3, "H", "W"), when="images, data, no encoder "
                                              "module", doc="decoded images, one per image_keys")]]
    image_encoder_rank: NotRequired[Annotated[Tensor, Field(Tensor, torch.int64, ("I",), when="images, encoder "
                                                            "module", doc="rank that embeds the image")]]


class EncoderPart(TypedDict):
    """The images one encoder bucket embeds this step (the same object for every rank of the bucket)."""

    pixels: Annotated[list, Field(list, torch.uint8, (3, "H", "W"), doc="decoded images")]
    image_grid: Annotated[Tensor, Field(Tensor, torch.int64, ("I", 2), doc="patch rows, columns")]
    image_keys: Annotated[list, Field(list, doc="'source:index' (#i when several) each")]
    image_microbatch: Annotated[Tensor, Field(Tensor, torch.int64, ("I",), doc="encoder microbatch of each image")]
    bucket: Annotated[int, Field(int, doc="the encoder bucket")]


class Batch(TypedDict):
    """What one rank receives at one step."""

    step: Annotated[int, Field(int, doc="the training step, from 0")]
    delivery: Annotated[Literal["data", "metadata", "none"], Field(str, doc="see the module docstring")]
    microbatches: Annotated[list[Microbatch] | None, Field(list, when="delivery != 'none' (else None)",
                                                            doc="this rank's microbatches, in order")]
    encoder: Annotated[EncoderPart | None, Field(dict, when="encoder module, not a broadcast receiver of it "
                                                           "(else None); empty lists: no image this step",
                                                 doc="the images this rank's encoder bucket embeds")]


def fields(contract: type) -> dict[str, Field]:
    """key -> :class:`Field` of one of the contract's ``TypedDict`` s (e.g. ``fields(Microbatch)``)."""
    hints = typing.get_type_hints(contract, include_extras=True)
    out = {}
    for key, hint in hints.items():
        while typing.get_origin(hint) is NotRequired:
            hint = typing.get_args(hint)[0]
        out[key] = next(m for m in hint.__metadata__ if isinstance(m, Field))
    return out
