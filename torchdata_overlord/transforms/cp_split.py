"""Parallelism transforms: context-parallel split of packed rows, per sequence, in the zig-zag layout.

Ring attention with a causal mask gives late tokens more work than early ones, so a contiguous
split overloads the last CP rank. The Megatron-Core / TransformerEngine layout (THD with CP) pads
every sequence of a packed row to a multiple of 2*cp, cuts each into 2*cp equal chunks and gives
CP rank r chunks r and 2*cp-1-r of every sequence: each rank holds an equal share of every
sequence, pairing a cheap chunk with an expensive one. ``cu_seqlens``, ``cu_seqlens_padded`` and
``max_seqlen`` stay global (the kernel takes the global ones with the rank's shard).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError
from .packing import PER_TOKEN_FIELDS, pack, unpack

__all__ = ["pad_for_cp", "zigzag_indices", "packed_indices", "zigzag_split", "zigzag_merge", "split_packed",
           "merge_packed", "causal_work"]


def _check_cp(cp: int, rank: int | None = None) -> None:
    if cp < 1:
        raise ConfigError(f"context parallel size cp must be >= 1, got {cp}")
    if rank is not None and not 0 <= rank < cp:
        raise ConfigError(f"cp rank {rank} out of range for cp={cp} (expected 0..{cp - 1})")


def _check(length: int, cp: int, rank: int | None = None) -> int:
    """Validate cp/rank against a sequence length; return the chunk size L // (2*cp)."""
    _check_cp(cp, rank)
    if length % (2 * cp):
        raise ConfigError(f"length {length} is not divisible by 2*cp={2 * cp}; call pad_for_cp(packed, cp) "
                          f"(or pack with sequence_multiple={2 * cp}) before splitting")
    return length // (2 * cp)


def pad_for_cp(packed: dict[str, torch.Tensor], cp: int, pad_id: int = 0,
               ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """Repack a :func:`pack` output so that every sequence and the row are multiples of 2*cp.

    The row keeps at least its length (rounded up to 2*cp; longer when the sequences' own padding
    needs more room); :func:`split_packed` can then split it.
    """
    _check_cp(cp)
    m = 2 * cp
    seqs = unpack(packed)
    need = sum(-(-s.numel() // m) * m for s in seqs)
    length = -(-max(packed["input_ids"].numel(), need) // m) * m
    return pack(seqs, length, pad_id, ignore_index, pad_to_multiple=m, sequence_multiple=m)


def zigzag_indices(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions (int64) of one sequence that CP ``rank`` holds: chunk ``rank`` then chunk ``2*cp-1-rank``."""
    c = _check(length, cp, rank)
    lo, hi = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(lo, lo + c, device=device), torch.arange(hi, hi + c, device=device)])


def packed_indices(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Row positions (int64) that CP ``rank`` holds of a packed row: for every entry of
    ``cu_seqlens_padded`` in order, its chunks ``rank`` and ``2*cp-1-rank`` (TransformerEngine's
    ``thd_get_partitioned_indices``). Every entry's length must be a multiple of 2*cp."""
    cu = torch.as_tensor(cu_seqlens_padded)
    return torch.from_numpy(_packed_indices(cu.detach().cpu().numpy(), cp, rank)).to(cu.device)


def _packed_indices(cu_seqlens_padded: np.ndarray, cp: int, rank: int) -> np.ndarray:
    """:func:`packed_indices` in numpy (whole-row operations: a row of many sequences costs no more calls)."""
    _check_cp(cp, rank)
    return _chunk_indices(cu_seqlens_padded, cp, np.array([[rank]]))


def _chunk_indices(cu_seqlens_padded: np.ndarray, cp: int, ranks: np.ndarray) -> np.ndarray:
    """Row positions of chunks ``r`` and ``2*cp-1-r`` of every entry, for each r of ``ranks`` (shape (k, 1)) in turn."""
    cu = cu_seqlens_padded.astype(np.int64)
    lens = cu[1:] - cu[:-1]
    entry, start, size = _zigzag_chunks(lens, np.zeros(len(lens), np.int64), cp, ranks.reshape(-1))
    first = np.cumsum(size) - size
    return np.repeat(cu[:-1][entry] + start - first, size) + np.arange(int(size.sum()), dtype=np.int64)


def _zigzag_chunks(lengths: np.ndarray, row: np.ndarray, cp: int,
                   ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(entry, start, size)`` of the zig-zag chunks of packed entries (``lengths``, each a multiple
    of 2*cp; ``row``: each entry's row, non-decreasing) that ``ranks`` hold, as their shards lie one
    after another: row by row, then rank by rank, then entry by entry, chunks ``r`` and ``2*cp-1-r``."""
    bad = np.flatnonzero(lengths % (2 * cp))
    if len(bad):
        j = int(bad[0])
        raise ConfigError(f"entry {j} of the packed row is {int(lengths[j])} tokens long, not a multiple of 2*cp={2 * cp}; "
                          f"pack with sequence_multiple={2 * cp} (or call pad_for_cp(packed, cp)) before splitting")
    c = lengths // (2 * cp)
    n, k = len(lengths), len(ranks)
    halves = np.stack([ranks, 2 * cp - 1 - ranks], -1)                        # (rank, 2)
    key = (row[:, None, None] * k + np.arange(k)[None, :, None]).repeat(2, 2)   # (entry, rank, 2): row, then rank
    order = np.argsort(key.reshape(-1), kind="stable")
    entry = np.repeat(np.arange(n), 2 * k)[order]
    start = (c[:, None, None] * halves[None]).reshape(-1)[order]
    return entry, start, c[entry]


def zigzag_split(tensor: torch.Tensor, cp: int, rank: int, dim: int = -1) -> torch.Tensor:
    """This rank's zig-zag shard of one sequence ``tensor`` along ``dim`` (a new tensor, size L // cp there)."""
    c = _check(tensor.shape[dim], cp, rank)
    return torch.cat([tensor.narrow(dim, rank * c, c), tensor.narrow(dim, (2 * cp - 1 - rank) * c, c)], dim)


def zigzag_merge(shards: list[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`zigzag_split`: ``shards[r]`` is rank r's shard; returns the full tensor."""
    if not shards:
        raise ConfigError("zigzag_merge: needs one shard per CP rank, got none")
    size = shards[0].shape[dim]
    if size % 2 or any(s.shape[dim] != size for s in shards):
        raise ConfigError(f"zigzag_merge: shards must share an even size along dim {dim}, got "
                          f"{[s.shape[dim] for s in shards]}")
    c = size // 2
    firsts = [s.narrow(dim, 0, c) for s in shards]
    seconds = [s.narrow(dim, c, c) for s in reversed(shards)]
    return torch.cat(firsts + seconds, dim)


def split_packed(packed: dict[str, torch.Tensor], cp: int, rank: int,
                 token_fields: tuple[str, ...] = PER_TOKEN_FIELDS) -> dict[str, torch.Tensor]:
    """CP ``rank``'s shard of a packed row: every field in ``token_fields`` split per sequence
    (:func:`packed_indices`), the rest kept whole.

    Adds ``cp_rank``, ``cp_size`` (0-d int64) and ``token_index`` (the row positions held), so a
    ring-attention kernel can pair the shard with the global ``cu_seqlens``/``cu_seqlens_padded``.
    """
    length = packed["input_ids"].shape[-1]
    _check(length, cp, rank)
    ids = packed["input_ids"]
    idx_np = _packed_indices(packed["cu_seqlens_padded"].detach().cpu().numpy(), cp, rank)
    idx = torch.from_numpy(idx_np).to(ids.device)
    out = {k: (_take(v, idx_np, idx) if k in token_fields else v) for k, v in packed.items()}
    out["cp_rank"] = torch.tensor(rank, device=ids.device)
    out["cp_size"] = torch.tensor(cp, device=ids.device)
    out["token_index"] = idx
    return out


def _take(v: torch.Tensor, idx_np: np.ndarray, idx: torch.Tensor) -> torch.Tensor:
    """``v.index_select(-1, idx)``; through numpy for a plain CPU tensor (a torch call costs ~10x here)."""
    if v.device.type == "cpu" and not v.requires_grad and v.dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.take(v.numpy(), idx_np, -1))
    return v.index_select(-1, idx)


_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.float32, torch.float64}


def merge_packed(shards: list[dict[str, torch.Tensor]],
                 token_fields: tuple[str, ...] = PER_TOKEN_FIELDS) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_packed` over all ranks (``shards[r]`` from rank r); drops the CP fields."""
    if not shards:
        raise ConfigError("merge_packed: needs one shard per CP rank, got none")
    ranks = [int(s["cp_rank"]) for s in shards]
    if ranks != list(range(len(shards))):
        raise ConfigError(f"merge_packed: shards must be ordered by cp_rank 0..{len(shards) - 1}, got {ranks}")
    idx = torch.cat([s["token_index"] for s in shards])
    n = idx.numel()
    if not torch.equal(torch.sort(idx).values, torch.arange(n, device=idx.device)):
        raise ConfigError(f"merge_packed: the shards' token_index must cover 0..{n - 1} once each; pass every "
                          f"CP rank's shard of one row")
    skip = {"cp_rank", "cp_size", "token_index"}
    out = {}
    for k, v in shards[0].items():
        if k in skip:
            continue
        if k in token_fields:
            vals = torch.cat([s[k] for s in shards], -1)
            v = torch.empty_like(vals).index_copy_(-1, idx, vals)
        out[k] = v
    return out


def causal_work(token_index: torch.Tensor, cu_seqlens_padded: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> int:
    """Causal attention work of a shard: sum over held real positions of (position within sequence + 1).

    ``cu_seqlens_padded=None`` treats the row as one sequence; otherwise positions restart at each
    entry, and with ``cu_seqlens`` (real lengths) the padding of each entry counts no work.
    """
    idx = token_index.to(torch.int64)
    if cu_seqlens_padded is None:
        return int((idx + 1).sum())
    cu = cu_seqlens_padded.to(device=idx.device, dtype=torch.int64)
    seg = torch.searchsorted(cu, idx, right=True) - 1
    pos = idx - cu[seg]
    if cu_seqlens is not None:
        real = cu_seqlens.to(device=idx.device, dtype=torch.int64)
        pos = pos[pos < (real[1:] - real[:-1])[seg]]
    return int((pos + 1).sum())
