"""Parallelism transforms: context-parallel split in the load-balanced zig-zag layout.

Ring attention with a causal mask gives late tokens more work than early ones, so a contiguous
split overloads the last CP rank. The Megatron/TransformerEngine layout cuts the row into 2*cp
equal chunks and gives rank i chunks i and 2*cp-1-i, pairing a cheap chunk with an expensive one.
The whole row is split (not each segment), and ``cu_seqlens``/``max_seqlen`` stay global.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .packing import PER_TOKEN_FIELDS

__all__ = ["pad_for_cp", "zigzag_indices", "zigzag_split", "zigzag_merge", "split_packed", "merge_packed",
           "causal_work"]


def _check(length: int, cp: int, rank: int | None = None) -> int:
    """Validate cp/rank against a row length; return the chunk size L // (2*cp)."""
    if cp < 1:
        raise ConfigError(f"context parallel size cp must be >= 1, got {cp}")
    if rank is not None and not 0 <= rank < cp:
        raise ConfigError(f"cp rank {rank} out of range for cp={cp} (expected 0..{cp - 1})")
    if length % (2 * cp):
        raise ConfigError(f"length {length} is not divisible by 2*cp={2 * cp}; call pad_for_cp(packed, cp) "
                          f"(or pack with pad_to_multiple={2 * cp}) before splitting")
    return length // (2 * cp)


def pad_for_cp(packed: dict[str, torch.Tensor], cp: int, pad_id: int = 0,
               ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """Pad a :func:`pack` output so its length is a multiple of 2*cp, extending the padding segment.

    The padding follows pack's convention (one trailing segment, ids -1, positions counting on).
    """
    if cp < 1:
        raise ConfigError(f"context parallel size cp must be >= 1, got {cp}")
    ids, seg = packed["input_ids"], packed["segment_ids"]
    length = ids.numel()
    extra = -length % (2 * cp)
    out = dict(packed)
    if not extra:
        return out
    dev = ids.device
    padded_already = length > 0 and int(seg[-1]) < 0
    first_pos = int(packed["position_ids"][-1]) + 1 if padded_already else 0
    tail = {
        "input_ids": torch.full((extra,), pad_id, dtype=ids.dtype, device=dev),
        "labels": torch.full((extra,), ignore_index, dtype=packed["labels"].dtype, device=dev),
        "loss_mask": torch.zeros(extra, dtype=torch.bool, device=dev),
        "position_ids": torch.arange(first_pos, first_pos + extra, dtype=packed["position_ids"].dtype, device=dev),
        "segment_ids": torch.full((extra,), -1, dtype=seg.dtype, device=dev),
    }
    for k, t in tail.items():
        out[k] = torch.cat([packed[k], t])
    cu = packed["cu_seqlens"]
    if padded_already:
        cu = cu.clone()
        cu[-1] += extra
    else:
        cu = torch.cat([cu, cu.new_tensor([length + extra])])
    out["cu_seqlens"] = cu
    out["max_seqlen"] = (cu[1:] - cu[:-1]).max().to(packed["max_seqlen"].dtype)
    return out


def zigzag_indices(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions (int64) that CP ``rank`` holds: chunk ``rank`` then chunk ``2*cp-1-rank``."""
    c = _check(length, cp, rank)
    lo, hi = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(lo, lo + c, device=device), torch.arange(hi, hi + c, device=device)])


def zigzag_split(tensor: torch.Tensor, cp: int, rank: int, dim: int = -1) -> torch.Tensor:
    """This rank's zig-zag shard of ``tensor`` along ``dim`` (a new tensor, size L // cp there)."""
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
    """CP ``rank``'s shard of a packed row: every field in ``token_fields`` split, the rest kept whole.

    Adds ``cp_rank``, ``cp_size`` (0-d int64) and ``token_index`` (the global positions held), so a
    ring-attention kernel can pair the shard with the global ``cu_seqlens``.
    """
    length = packed["input_ids"].shape[-1]
    _check(length, cp, rank)
    out = {k: (zigzag_split(v, cp, rank) if k in token_fields else v) for k, v in packed.items()}
    dev = packed["input_ids"].device
    out["cp_rank"] = torch.tensor(rank, device=dev)
    out["cp_size"] = torch.tensor(cp, device=dev)
    out["token_index"] = zigzag_indices(length, cp, rank, device=dev)
    return out


def merge_packed(shards: list[dict[str, torch.Tensor]],
                 token_fields: tuple[str, ...] = PER_TOKEN_FIELDS) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_packed` over all ranks (``shards[r]`` from rank r); drops the CP fields."""
    if not shards:
        raise ConfigError("merge_packed: needs one shard per CP rank, got none")
    ranks = [int(s["cp_rank"]) for s in shards]
    if ranks != list(range(len(shards))):
        raise ConfigError(f"merge_packed: shards must be ordered by cp_rank 0..{len(shards) - 1}, got {ranks}")
    skip = {"cp_rank", "cp_size", "token_index"}
    return {k: (zigzag_merge([s[k] for s in shards]) if k in token_fields else v)
            for k, v in shards[0].items() if k not in skip}


def causal_work(token_index: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> int:
    """Causal attention work of a shard: sum over held positions of (position within segment + 1).

    ``cu_seqlens=None`` treats the row as one segment; otherwise positions restart at each boundary.
    """
    idx = token_index.to(torch.int64)
    if cu_seqlens is None:
        pos = idx
    else:
        cu = cu_seqlens.to(device=idx.device, dtype=torch.int64)
        seg = torch.searchsorted(cu, idx, right=True) - 1
        pos = idx - cu[seg]
    return int((pos + 1).sum())
