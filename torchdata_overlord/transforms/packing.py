"""Microbatch transforms: pack token sequences into one row with flash-attention varlen metadata.

A packed row holds several samples ("segments") back to back. Attention must not cross segments
and the next-token target of a segment's last token is not the next segment's first token, so
``pack`` emits per-segment ``labels``/``position_ids`` and the ``cu_seqlens`` that varlen kernels
(``flash_attn_varlen_func``, TransformerEngine THD) take instead of a dense mask.

Conventions (all per-token fields have length L):

* segment ``k`` is ``sequences[k]``: ``segment_ids == k`` on it and ``cu_seqlens[k]:cu_seqlens[k+1]``
  spans it; an empty sequence is a zero-length entry of ``cu_seqlens`` (varlen kernels accept those);
* padding is one extra trailing segment in ``cu_seqlens`` with ``segment_ids == -1``, positions
  ``0, 1, ...``, ``labels == ignore_index`` and ``loss_mask == False``; ``max_seqlen`` covers it too,
  since the kernel attends over it like any other segment.
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


def pack(sequences: list[torch.Tensor], seq_len: int | None, pad_id: int = 0, ignore_index: int = -100,
         pad_to_multiple: int = 1) -> dict[str, torch.Tensor]:
    """Concatenate ``sequences`` into one packed row of ``seq_len`` tokens (or the padding-free length).

    ``seq_len=None`` packs without a fixed length: L = total tokens rounded up to ``pad_to_multiple``.
    With ``seq_len`` set, L = seq_len, which must hold every token and be a multiple of
    ``pad_to_multiple``. An empty list gives a row that is all padding (length 0 when ``seq_len`` is None).
    Returns ``input_ids``, ``labels``, ``loss_mask``, ``position_ids``, ``segment_ids`` (length L),
    ``cu_seqlens`` (int32) and ``max_seqlen`` (0-d int32).
    """
    if pad_to_multiple < 1:
        raise ConfigError(f"pack: pad_to_multiple must be >= 1, got {pad_to_multiple}")
    seqs = [_as_tokens(s, k) for k, s in enumerate(sequences)]
    device = seqs[0].device if seqs else torch.device("cpu")
    lengths = [int(s.numel()) for s in seqs]
    total = sum(lengths)
    if seq_len is None:
        length = -(-total // pad_to_multiple) * pad_to_multiple
    else:
        if seq_len < 0 or seq_len % pad_to_multiple:
            raise ConfigError(f"pack: seq_len={seq_len} must be >= 0 and a multiple of "
                              f"pad_to_multiple={pad_to_multiple}")
        if total > seq_len:
            raise OversizeSampleError(f"pack: {len(seqs)} sequences hold {total} tokens, more than "
                                      f"seq_len={seq_len}; pack fewer sequences or raise seq_len")
        length = seq_len
    pad = length - total
    seg_lens = lengths + ([pad] if pad else [])

    lens_t = torch.tensor(seg_lens, dtype=torch.int64, device=device)
    cu_seqlens = torch.zeros(len(seg_lens) + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = torch.cumsum(lens_t, 0)
    ids = torch.full((length,), pad_id, dtype=torch.int64, device=device)
    if total:
        ids[:total] = torch.cat(seqs)
    seg_numbers = torch.arange(len(seg_lens), device=device)
    if pad:
        seg_numbers[-1] = -1
    segment_ids = torch.repeat_interleave(seg_numbers, lens_t, output_size=length)
    starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), lens_t, output_size=length)
    position_ids = torch.arange(length, device=device) - starts

    # A label is valid when the next token exists, is in the same segment, and that segment is real.
    loss_mask = torch.zeros(length, dtype=torch.bool, device=device)
    loss_mask[:-1] = (segment_ids[:-1] == segment_ids[1:]) & (segment_ids[:-1] >= 0)
    labels = torch.full((length,), ignore_index, dtype=torch.int64, device=device)
    labels[:-1] = torch.where(loss_mask[:-1], ids[1:], labels[:-1])
    return {
        "input_ids": ids, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
        "segment_ids": segment_ids, "cu_seqlens": cu_seqlens,
        "max_seqlen": torch.tensor(max(seg_lens, default=0), dtype=torch.int32, device=device),
    }


def unpack(packed: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Recover the sequences given to :func:`pack` (the trailing padding segment is dropped)."""
    ids, seg, cu = packed["input_ids"], packed["segment_ids"], packed["cu_seqlens"].tolist()
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        if a < b and int(seg[a]) < 0:
            continue  # padding segment
        out.append(ids[a:b].clone())
    return out


def attention_mask_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Dense (L, L) bool mask, True where query i may attend key j: same segment and j <= i.

    For tests and for attention implementations without varlen kernels; padding (-1) attends
    causally within the padding block, as a varlen kernel given ``cu_seqlens`` would.
    """
    if segment_ids.dim() != 1:
        raise ConfigError(f"attention_mask_from_segments: segment_ids must be 1-D, got shape "
                          f"{tuple(segment_ids.shape)}")
    same = segment_ids[:, None] == segment_ids[None, :]
    n = segment_ids.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=segment_ids.device).tril()
    return same & causal
