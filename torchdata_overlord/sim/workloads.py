"""Synthetic sources that stand in for Source Loaders when only metadata matters.

Each source draws sample sizes from a named distribution, deterministically from (seed, source,
sample index), and :class:`SimulatedLoaders` keeps a FIFO read buffer per source that is
refilled after each plan consumes its samples, as a Source Loader's buffer would be.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from ..plane.records import BufferMeta

__all__ = ["SyntheticSource", "SimulatedLoaders", "DISTRIBUTIONS"]


def _web(rng, n):          # general web text: lognormal around ~500 tokens
    return np.clip(rng.lognormal(6.2, 0.9, n), 16, 32768).astype(np.int64), None


def _code(rng, n):         # code files: longer and wider
    return np.clip(rng.lognormal(7.0, 1.1, n), 32, 32768).astype(np.int64), None


def _long(rng, n):         # heavy-tailed long-context documents (Pareto tail up to 128k)
    return np.clip(1024 * (rng.pareto(1.1, n) + 1), 1024, 131072).astype(np.int64), None


def _captions(rng, n):     # coyo-like captions: ~98% <= 64 tokens, a long tail of long captions
    return np.clip(rng.lognormal(3.1, 0.55, n) + rng.pareto(1.6, n) * 4, 4, 4096).astype(np.int64), None


def _image_text(rng, n):   # captioned images, 1-3 images of skewed NaViT-style patch counts (patch 14)
    tokens = np.clip(rng.lognormal(3.4, 0.6, n), 4, 1024).astype(np.int64)
    num = rng.choice([1, 1, 1, 2, 3], n)
    side = np.clip(rng.lognormal(6.0, 0.45, (n, 3)), 112, 2048)
    aspect = np.clip(rng.lognormal(0, 0.3, (n, 3)), 0.5, 2)
    per = (np.ceil(side / 14) * np.ceil(side * aspect / 14)).astype(np.int64)
    per[np.arange(3)[None, :] >= num[:, None]] = 0
    return tokens, per


DISTRIBUTIONS = {"web": _web, "code": _code, "long": _long, "captions": _captions, "image_text": _image_text}


@dataclass(frozen=True)
class SyntheticSource:
    """A source named ``name`` whose sample sizes follow ``DISTRIBUTIONS[kind]``."""

    name: str
    kind: str
    seed: int = 0

    def samples(self, start: int, n: int) -> BufferMeta:
        """Metadata of samples ``start .. start + n - 1`` (the same every time it is asked)."""
        chunk = 1024
        parts = []
        for c in range(start // chunk, (start + n - 1) // chunk + 1 if n else start // chunk):
            rng = np.random.default_rng([self.seed, zlib.crc32(self.name.encode()), c])
            parts.append(DISTRIBUTIONS[self.kind](rng, chunk))
        if not parts:
            return BufferMeta(self.name, np.zeros(0, np.int64), np.zeros(0, np.int64))
        lo = start - (start // chunk) * chunk
        tokens = np.concatenate([p[0] for p in parts])[lo:lo + n]
        if parts[0][1] is None:
            return BufferMeta(self.name, np.arange(start, start + n), tokens)
        per = np.concatenate([p[1] for p in parts])[lo:lo + n]
        return BufferMeta(self.name, np.arange(start, start + n), tokens, num_images=(per > 0).sum(1),
                          patches=per.sum(1), patches_sq=(per.astype(np.float64) ** 2).sum(1))


class SimulatedLoaders:
    """FIFO read buffers of ``buffer_size`` samples per source, refilled after each plan."""

    def __init__(self, sources: list[SyntheticSource], buffer_size: int):
        self.sources = {s.name: s for s in sources}
        self.buffer_size = buffer_size
        self._buffers = {s.name: s.samples(0, buffer_size) for s in sources}
        self._next = {s.name: buffer_size for s in sources}

    def buffers(self) -> list[BufferMeta]:
        return list(self._buffers.values())

    def consume(self, plan) -> None:
        """Remove every sample the plan's batch took (dropped ones included) and refill."""
        recs = plan.records
        for sid, name in enumerate(recs.sources):
            taken = recs.index[recs.source_id == sid]
            buf = self._buffers[name]
            keep = ~np.isin(buf.index, taken)
            need = self.buffer_size - int(keep.sum())
            new = self.sources[name].samples(self._next[name], need)
            self._next[name] += need
            self._buffers[name] = BufferMeta(
                name, np.concatenate([buf.index[keep], new.index]), np.concatenate([buf.tokens[keep], new.tokens]),
                np.concatenate([buf.num_images[keep], new.num_images]), np.concatenate([buf.patches[keep], new.patches]),
                np.concatenate([buf.patches_sq[keep], new.patches_sq]))
