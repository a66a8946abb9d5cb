"""Built-in cost models (``DGraph.cost``): per-sample compute estimates from metadata, vectorised.

A cost model is any callable ``fn(records) -> array of float`` with one value per row of a
:class:`~torchdata_overlord.plane.records.Records`; the balancer equalises their sums.
"""

from __future__ import annotations

import numpy as np

__all__ = ["token_count", "AttentionFlops", "attention_flops", "EncoderCost", "encoder_cost"]


def token_count(records) -> np.ndarray:
    """Cost = number of text tokens (data volume, activation memory)."""
    return records.tokens.astype(np.float64)


class AttentionFlops:
    """Forward FLOPs of one transformer layer on each packed segment of ``L`` tokens.

    ``4 * h * L**2`` for attention scores and values (quadratic: each segment attends only to
    itself in a packed sequence) plus ``2 * L * (4 + 2 * ffn_mult) * h**2`` for the projections
    and the MLP (linear). The ratio of the two terms, not the layer count, decides balance.
    """

    def __init__(self, hidden: int = 4096, ffn_mult: float = 4.0):
        self.hidden, self.ffn_mult = hidden, ffn_mult

    def of_length(self, length) -> np.ndarray:
        L = np.asarray(length, dtype=np.float64)
        h = float(self.hidden)
        return 4.0 * h * L * L + 2.0 * L * (4.0 + 2.0 * self.ffn_mult) * h * h

    def __call__(self, records) -> np.ndarray:
        return self.of_length(records.tokens)

    def __repr__(self) -> str:
        return f"AttentionFlops(hidden={self.hidden}, ffn_mult={self.ffn_mult})"


class EncoderCost(AttentionFlops):
    """Vision-encoder FLOPs from patch counts: quadratic per image (``sum p_i**2``), linear in ``sum p_i``."""

    def __init__(self, hidden: int = 1024, ffn_mult: float = 4.0):
        super().__init__(hidden, ffn_mult)

    def __call__(self, records) -> np.ndarray:
        h = float(self.hidden)
        return 4.0 * h * records.patches_sq + 2.0 * records.patches * (4.0 + 2.0 * self.ffn_mult) * h * h

    def __repr__(self) -> str:
        return f"EncoderCost(hidden={self.hidden}, ffn_mult={self.ffn_mult})"


attention_flops = AttentionFlops()
encoder_cost = EncoderCost()
