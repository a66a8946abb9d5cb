"""Microbatch transforms: pack token sequences into one row with varlen/THD attention metadata.

A packed row holds several samples ("sequences") back to back. Attention must not cross sequences
and the next-token target of a sequence's last token is not the next sequence's first token, so
``pack`` emits per-sequence ``labels``/``position_ids`` and the cumulative lengths that varlen
kernels (``flash_attn_varlen_func``, TransformerEngine's THD format) take instead of a dense mask.

Conventions (TransformerEngine THD; all per-token fields have length L):

* entry ``k`` of the row is ``sequences[k]``, padded to its padded length (``sequence_multiple``:
  2*cp for a context-parallel split, see :func:`~torchdata_overlord.transforms.split_packed`);
  ``cu_seqlens_padded[k]:cu_seqlens_padded[k+1]`` is where it sits in the row and
  ``cu_seqlens[k+1] - cu_seqlens[k]`` is its real length (its real tokens come first);
* padding up to L is one extra trailing entry of real length 0, so both ``cu_seqlens`` hold one
  entry per sequence (+ that one) and padding is never attended; ``max_seqlen`` is the longest
  real sequence. On every padding token ``segment_ids == -1``, ``labels == ignore_index`` and
  ``loss_mask == False``; ``position_ids`` count on through a sequence's padding and restart at 0
  on the trailing entry. Without per-sequence padding ``cu_seqlens`` equals ``cu_seqlens_padded``
  except for the trailing entry, so a plain varlen kernel can take ``cu_seqlens`` as offsets.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError, OversizeSampleError

__all__ = ["PER_TOKEN_FIELDS", "pack", "unpack", "attention_mask_from_segments"]

#: Fields of a pack() output that have one entry per token (the rest describe the whole row).
PER_TOKEN_FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "segment_ids")


def _as_tokens(seq, k: int) -> torch.Tensor:
    """Check one sequence is a 1-D integer tensor and return it as int64."""
    t = torch.as_tensor(seq)
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ConfigError(f"pack: sequences[{k}] must be a 1-D integer tensor of token ids, "
                          f"got dtype {t.dtype} and shape {tuple(t.shape)}")
    return t.to(torch.int64)


def _padded_lengths(lengths: list[int], sequence_multiple: int, padded_lengths) -> list[int]:
    """Each sequence's length in the row: ``padded_lengths`` as given, else rounded up to the multiple."""
    if sequence_multiple < 1:
        raise ConfigError(f"pack: sequence_multiple must be >= 1, got {sequence_multiple}")
    if padded_lengths is None:
        return [-(-n // sequence_multiple) * sequence_multiple for n in lengths]
    padded = [int(p) for p in padded_lengths]
    if len(padded) != len(lengths):
        raise ConfigError(f"pack: padded_lengths has {len(padded)} entries for {len(lengths)} sequences")
    for k, (n, p) in enumerate(zip(lengths, padded)):
        if p < n:
            raise ConfigError(f"pack: padded_lengths[{k}]={p} is shorter than sequences[{k}] ({n} tokens)")
    return padded


def pack(sequences: list[torch.Tensor], seq_len: int | None, pad_id: int = 0, ignore_index: int = -100,
         pad_to_multiple: int = 1, sequence_multiple: int = 1,
         padded_lengths: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Concatenate ``sequences`` into one packed row of ``seq_len`` tokens (or the padding-free length).

    Each sequence is padded to a multiple of ``sequence_multiple`` (or to ``padded_lengths[k]``).
    ``seq_len=None`` packs without a fixed length: L = the padded sequences' total rounded up to
    ``pad_to_multiple``. With ``seq_len`` set, L = seq_len, which must hold every padded sequence
    and be a multiple of ``pad_to_multiple``. An empty list gives a row that is all padding
    (length 0 when ``seq_len`` is None). Returns ``input_ids``, ``labels``, ``loss_mask``,
    ``position_ids``, ``segment_ids`` (length L), ``cu_seqlens`` and ``cu_seqlens_padded`` (int32)
    and ``max_seqlen`` (0-d int32), as the module docstring describes.
    """
    if pad_to_multiple < 1:
        raise ConfigError(f"pack: pad_to_multiple must be >= 1, got {pad_to_multiple}")
    seqs = [_as_tokens(s, k) for k, s in enumerate(sequences)]
    device = seqs[0].device if seqs else torch.device("cpu")
    lengths = [int(s.numel()) for s in seqs]
    padded = _padded_lengths(lengths, sequence_multiple, padded_lengths)
    total = sum(padded)
    if seq_len is None:
        length = -(-total // pad_to_multiple) * pad_to_multiple
    else:
        if seq_len < 0 or seq_len % pad_to_multiple:
            raise ConfigError(f"pack: seq_len={seq_len} must be >= 0 and a multiple of "
                              f"pad_to_multiple={pad_to_multiple}")
        if total > seq_len:
            extra = f" ({sum(lengths)} before padding each to its padded length)" if total != sum(lengths) else ""
            raise OversizeSampleError(f"pack: {len(seqs)} sequences hold {total} tokens{extra}, more than "
                                      f"seq_len={seq_len}; pack fewer sequences or raise seq_len")
        length = seq_len
    pad = length - total
    real, spans = lengths + ([0] if pad else []), padded + ([pad] if pad else [])

    def cumulative(values: list[int]) -> torch.Tensor:
        cu = torch.zeros(len(values) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(torch.tensor(values, dtype=torch.int64, device=device), 0)
        return cu

    cu_seqlens, cu_padded = cumulative(real), cumulative(spans)
    # the row as pieces: each sequence's real tokens, then its padding (views of one padding block)
    fill = torch.full((max(p - n for p, n in zip(spans, real)) if spans else 0,), pad_id, dtype=torch.int64,
                      device=device)
    pieces, piece_ids, piece_lens = [], [], []
    for k, (n, p) in enumerate(zip(real, spans)):
        if n:
            pieces.append(seqs[k])
            piece_ids.append(k)
            piece_lens.append(n)
        if p > n:
            pieces.append(fill[:p - n])
            piece_ids.append(-1)
            piece_lens.append(p - n)
    ids = torch.cat(pieces) if pieces else fill[:0].clone()
    segment_ids = torch.repeat_interleave(torch.tensor(piece_ids, dtype=torch.int64, device=device),
                                          torch.tensor(piece_lens, dtype=torch.int64, device=device),
                                          output_size=length)
    starts = torch.repeat_interleave(cu_padded[:-1].to(torch.int64),
                                     torch.tensor(spans, dtype=torch.int64, device=device), output_size=length)
    position_ids = torch.arange(length, device=device) - starts

    # A label is valid when the next token exists, is in the same sequence, and is real.
    loss_mask = torch.zeros(length, dtype=torch.bool, device=device)
    loss_mask[:-1] = (segment_ids[:-1] == segment_ids[1:]) & (segment_ids[:-1] >= 0)
    labels = torch.full((length,), ignore_index, dtype=torch.int64, device=device)
    labels[:-1] = torch.where(loss_mask[:-1], ids[1:], labels[:-1])
    return {
        "input_ids": ids, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
        "segment_ids": segment_ids, "cu_seqlens": cu_seqlens, "cu_seqlens_padded": cu_padded,
        "max_seqlen": torch.tensor(max(lengths, default=0), dtype=torch.int32, device=device),
    }


def unpack(packed: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Recover the sequences given to :func:`pack`: each entry's real tokens; the trailing padding
    entry (the last one, real length 0 and padded length > 0) is dropped."""
    ids, cu, cu_p = packed["input_ids"], packed["cu_seqlens"].tolist(), packed["cu_seqlens_padded"].tolist()
    out = []
    for j, (start, n) in enumerate(zip(cu_p[:-1], (b - a for a, b in zip(cu, cu[1:])))):
        if j == len(cu) - 2 and n == 0 and cu_p[j + 1] > start:
            continue  # trailing padding
        out.append(ids[start:start + n].clone())
    return out


def attention_mask_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Dense (L, L) bool mask, True where query i may attend key j: same segment and j <= i.

    For tests and for attention implementations without varlen kernels. Real tokens never attend
    padding (-1); padding attends earlier padding, so that no query row is empty (an empty row
    makes softmax NaN), and its outputs are never trained on.
    """
    if segment_ids.dim() != 1:
        raise ConfigError(f"attention_mask_from_segments: segment_ids must be 1-D, got shape "
                          f"{tuple(segment_ids.shape)}")
    same = segment_ids[:, None] == segment_ids[None, :]
    n = segment_ids.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=segment_ids.device).tril()
    return same & causal
