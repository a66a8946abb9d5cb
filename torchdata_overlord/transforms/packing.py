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

import threading
from itertools import accumulate

import numpy as np
import torch

from ..errors import ConfigError, OversizeSampleError

__all__ = ["PER_TOKEN_FIELDS", "pack", "unpack", "attention_mask_from_segments"]

#: Fields of a pack() output that have one entry per token (the rest describe the whole row).
PER_TOKEN_FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "segment_ids")


def _as_tokens(seq, k: int) -> np.ndarray:
    """Check one sequence is a 1-D integer tensor (or array, or list) and return it as int64 numpy (a
    view where it already is one)."""
    t = torch.as_tensor(seq)
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ConfigError(f"pack: sequences[{k}] must be a 1-D integer tensor of token ids, "
                          f"got dtype {t.dtype} and shape {tuple(t.shape)}")
    return t.detach().cpu().numpy().astype(np.int64, copy=False)


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
    device = torch.as_tensor(sequences[0]).device if len(sequences) else torch.device("cpu")
    seqs = [_as_tokens(s, k) for k, s in enumerate(sequences)]
    lengths = [len(s) for s in seqs]
    padded = _padded_lengths(lengths, sequence_multiple, padded_lengths)
    row = _pack_arrays(seqs, lengths, padded, _row_length(lengths, padded, seq_len, pad_to_multiple), pad_id,
                       ignore_index)
    return {k: torch.from_numpy(v).to(device) for k, v in row.items()}


def _row_length(lengths: list[int], padded: list[int], seq_len: int | None, pad_to_multiple: int) -> int:
    """The row's length: ``seq_len`` (checked to hold the padded sequences), else their total rounded up."""
    total = sum(padded)
    if seq_len is None:
        return -(-total // pad_to_multiple) * pad_to_multiple
    if seq_len < 0 or seq_len % pad_to_multiple:
        raise ConfigError(f"pack: seq_len={seq_len} must be >= 0 and a multiple of pad_to_multiple={pad_to_multiple}")
    if total > seq_len:
        extra = f" ({sum(lengths)} before padding each to its padded length)" if total != sum(lengths) else ""
        raise OversizeSampleError(f"pack: {len(lengths)} sequences hold {total} tokens{extra}, more than "
                                  f"seq_len={seq_len}; pack fewer sequences or raise seq_len")
    return seq_len


def _pack_arrays(seqs: list[np.ndarray], lengths: list[int], padded: list[int], length: int, pad_id: int,
                 ignore_index: int) -> dict[str, np.ndarray]:
    """:func:`pack`'s row as numpy arrays (``length`` >= the padded total): a few whole-row numpy
    operations, whatever the number of sequences (torch's per-call cost, tens of microseconds on a
    small CPU, made a row of sequences cost milliseconds)."""
    real, spans = _entries(lengths, padded, length)
    n = len(spans)
    segment = np.arange(n, dtype=np.int64)
    segment[len(lengths):] = -1
    row = _pack_chunks(seqs, np.asarray(real, np.int64), segment, np.arange(n), np.zeros(n, np.int64),
                       np.asarray(spans, np.int64), pad_id, ignore_index)
    return {**row, "cu_seqlens": _cumulative(real), "cu_seqlens_padded": _cumulative(spans),
            "max_seqlen": np.array(max(lengths, default=0), np.int32)}


def _entries(lengths: list[int], padded: list[int], length: int) -> tuple[list[int], list[int]]:
    """Real and padded lengths of a row's entries: its sequences, then the trailing padding entry
    (real length 0) when they leave room in the row's ``length``."""
    pad = length - sum(padded)
    return (lengths + [0], padded + [pad]) if pad else (lengths, padded)


def _cumulative(lengths: list[int]) -> np.ndarray:
    """``cu_seqlens`` of entry lengths: int32, a leading 0 then the running total."""
    return np.array(list(accumulate(lengths, initial=0)), np.int32)


def _pack_chunks(seqs: list[np.ndarray], real: np.ndarray, segment: np.ndarray, entry: np.ndarray,
                 start: np.ndarray, size: np.ndarray, pad_id: int, ignore_index: int,
                 offset: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The per-token fields of chunks of packed entries, one chunk after another: chunk ``i`` holds
    positions ``start[i]:start[i] + size[i]`` of entry ``entry[i]``, whose real tokens are ``seqs``
    (one array per entry, ``real`` long; its other positions are padding) and whose segment id is
    ``segment`` (-1: a padding entry). With ``offset`` (each entry's start in its row), also
    ``token_index``: each token's position in its row.

    Chunks cover whole rows (:func:`pack`, every row of a build) or their zig-zag CP shards, all in
    one pass of whole-array operations: each chunk is cut where its entry's trainable tokens, last
    real token and padding meet, and every field is repeated or gathered over those runs.
    """
    n = real[entry]
    lo, hi = start, start + size
    last = np.minimum(np.maximum(n - 1, lo), hi)      # each chunk's runs: trainable [lo, last), last real
    pad = np.minimum(np.maximum(n, lo), hi)           # token [last, pad), padding [pad, hi)
    at = np.stack([lo, last, pad], 1).reshape(-1)     # run: its first position in its entry
    lens = np.stack([last - lo, pad - last, hi - pad], 1).reshape(-1)
    kind = np.tile(np.arange(3), len(entry))          # 0: trainable, 1: last real token, 2: padding
    e = np.repeat(entry, 3)
    first = np.cumsum(lens) - lens                    # run: its first place in the output
    step = _counting(int(size.sum()))

    def counted(base: np.ndarray) -> np.ndarray:      # base[run] + 0, 1, 2, ... along every run
        out = np.repeat(base - first, lens)
        return np.add(out, step, out=out)

    # every entry's real tokens, then a padding block (what padding runs read); labels read the next
    # token, ignore_index at each entry's last real token and on the padding block
    ends = np.cumsum(real)
    src = ends - real
    block = int(lens[kind == 2].max(initial=0))
    total = int(ends[-1]) if len(ends) else 0
    tokens, labels = _scratch(total + block)
    np.concatenate(seqs, out=tokens[:total]) if seqs else None
    tokens[total:] = pad_id
    labels[:-1] = tokens[1:]
    labels[ends[real > 0] - 1] = ignore_index
    labels[len(tokens) - block:] = ignore_index
    index = counted(np.where(kind < 2, src[e] + at, len(tokens) - block))
    out = {"input_ids": tokens[index], "labels": labels[index], "loss_mask": np.repeat(kind == 0, lens),
           "position_ids": counted(at), "segment_ids": np.repeat(np.where(kind < 2, segment[e], -1), lens)}
    if offset is not None:
        out["token_index"] = counted(offset[e] + at)
    return out


_STEPS = np.arange(0, dtype=np.int64)
_SCRATCH = threading.local()


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two int64 arrays of ``n`` for :func:`_pack_chunks`' tokens and their next-token labels, kept per thread and
    reused (only read by its gathers, never returned): fresh ones of a build's size cost page faults every call."""
    held = getattr(_SCRATCH, "arrays", None)
    if held is None or len(held[0]) < n:
        size = max(n, 2 * len(held[0])) if held is not None else n
        held = _SCRATCH.arrays = (np.empty(size, np.int64), np.empty(size, np.int64))
    return held[0][:n], held[1][:n]


def _counting(n: int) -> np.ndarray:
    """``np.arange(n)`` as a read-only view of one array kept for all calls (grown when too short)."""
    global _STEPS
    if len(_STEPS) < n:
        _STEPS = np.arange(max(n, 2 * len(_STEPS)), dtype=np.int64)
        _STEPS.flags.writeable = False
    return _STEPS[:n]


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
