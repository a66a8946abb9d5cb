"""``cost(fn)``: per-sample cost estimates that ``balance`` equalises."""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError


def evaluate_cost(fn, records) -> np.ndarray:
    """Run a cost model on records and check its answer (shape, finite, non-negative)."""
    name = getattr(fn, "__name__", repr(fn))
    got = fn(records)
    try:
        out = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"cost function {name} returned {type(got).__name__} that is not numbers ({e}); "
                          f"return one finite number >= 0 per sample") from e
    if out.shape != (len(records),):
        raise ConfigError(f"cost function {name} returned shape {out.shape}; expected one value per sample ({len(records)},)")
    bad = ~np.isfinite(out) | (out < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ConfigError(f"cost function {name} returned {out[i]} for sample {records.key(i)}; costs must be finite and >= 0")
    return out


class Cost:
    def __init__(self, fn):
        if not callable(fn):
            raise ConfigError(f"cost() needs a callable of the records, got {fn!r}")
        self.fn = fn

    def apply(self, g):
        costs = evaluate_cost(self.fn, g.records)
        name = getattr(self.fn, "__name__", None) or repr(self.fn)
        return g.evolve(f"cost({name}): total {costs.sum():.3g}", costs=costs, cost_fn=self.fn, placement=None)
