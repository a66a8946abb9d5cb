"""The bin-assignment problem every balancing method solves, and the registry of methods.

A method receives a :class:`BinProblem` (item costs and token counts, a number of bins, an
optional per-bin token cap and item-count cap, initial loads) and returns the bin of every item.
When an item fits no bin and ``grow > 0``, a method opens ``grow`` new bins (one more
microbatch for every bucket) instead of overflowing; the cap is never checked after the fact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...errors import ConfigError

__all__ = ["BinProblem", "BinAssignment", "register_balancer", "get_balancer", "balancer_names"]


@dataclass
class BinProblem:
    costs: np.ndarray                       # (n,) float64, >= 0
    tokens: np.ndarray                      # (n,) int64, each <= cap when a cap is set
    n_bins: int
    cap: int | None = None                  # max tokens per bin
    count_cap: int | None = None            # max items per bin
    loads: np.ndarray | None = None         # (n_bins,) initial cost per bin
    token_loads: np.ndarray | None = None   # (n_bins,) initial tokens per bin
    grow: int = 0                           # bins to open at once when an item fits nowhere
    # what the caller will judge the final per-bin cost loads by, lower is better (default: the
    # largest load); a method that tries several answers keeps the one this scores lowest
    score: Callable[[np.ndarray], float] | None = None

    def initial(self) -> tuple[np.ndarray, np.ndarray]:
        loads = np.zeros(self.n_bins) if self.loads is None else np.asarray(self.loads, np.float64)
        tl = np.zeros(self.n_bins, np.int64) if self.token_loads is None else np.asarray(self.token_loads, np.int64)
        return loads.copy(), tl.copy()

    def judge(self, out: "BinAssignment") -> float:
        """``score`` (default: the largest) of the per-bin cost loads that ``out`` leads to."""
        loads, _ = self.initial()
        loads = np.append(loads, np.zeros(out.n_bins - self.n_bins))
        loads += np.bincount(out.bins, weights=self.costs, minlength=out.n_bins)
        if self.score is not None:
            return float(self.score(loads))
        return float(loads.max()) if len(loads) else 0.0


@dataclass
class BinAssignment:
    bins: np.ndarray   # (n,) int64 bin of every item
    n_bins: int        # bins in use after any growth (>= the problem's n_bins)
    # the registered method whose answer this is, when a method hands back another's unchanged
    # (``place`` then knows that method's layout without computing it again)
    by: str | None = None


Balancer = Callable[[BinProblem], "BinAssignment | np.ndarray"]
_REGISTRY: dict[str, Balancer] = {}


def register_balancer(name: str, fn: Balancer | None = None, *, replace: bool = False):
    """Register a balancing method under ``name`` (usable as ``balance(name, ...)``); also a decorator.

    ``fn(problem) -> bins`` may return a :class:`BinAssignment` or just the array of bins. The
    planner checks the result (every item placed once, bins in range, token cap respected) and
    raises naming the method if it is not.
    """
    def deco(f: Balancer) -> Balancer:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"balancer name must be a non-empty string, got {name!r}")
        if name in _REGISTRY and not replace:
            raise ConfigError(f"a balancer named {name!r} is already registered; pass replace=True to override")
        _REGISTRY[name] = f
        return f
    return deco(fn) if fn is not None else deco


def balancer_names() -> list[str]:
    return sorted(_REGISTRY)


def get_balancer(name: str) -> Balancer:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown balancing method {name!r}; registered: {balancer_names()} "
                          f"(add your own with torchdata_overlord.register_balancer)")
    return _REGISTRY[name]


def run_balancer(name: str, problem: BinProblem) -> BinAssignment:
    """Run a registered method and check that its answer is a valid assignment."""
    out = get_balancer(name)(problem)
    if not isinstance(out, BinAssignment):
        out = BinAssignment(out, problem.n_bins)
    raw = np.asarray(out.bins) if out.bins is not None else None
    n = len(problem.costs)
    whole = raw is not None and (not raw.size or np.issubdtype(raw.dtype, np.integer) or (
        np.issubdtype(raw.dtype, np.floating) and bool(np.all(np.isfinite(raw) & (raw == np.round(raw))))))
    if not whole:                           # (whole floats, e.g. 1.0, are bins; 0.5 was truncated to 0, silently)
        got = "None" if raw is None else f"bins of dtype {raw.dtype}" + (
            f" that are not whole numbers (e.g. {float(raw.flat[np.flatnonzero(raw != np.round(raw))[0]])!r})"
            if np.issubdtype(raw.dtype, np.floating) else "")
        raise ConfigError(f"balancer {name!r} returned {got}; a balancer returns a BinAssignment, or one integer "
                          f"bin per item ({n} items, bins 0..{problem.n_bins - 1})")
    if raw.shape != (n,):
        raise ConfigError(f"balancer {name!r} returned {raw.shape} bins for {n} items")
    bins = raw.astype(np.int64)
    if out.n_bins < problem.n_bins:
        raise ConfigError(f"balancer {name!r} returned {out.n_bins} bins where the problem has {problem.n_bins}; "
                          f"every bin must stay (an empty one is fine)")
    if n and (bins.min() < 0 or bins.max() >= out.n_bins):
        raise ConfigError(f"balancer {name!r} returned a bin outside 0..{out.n_bins - 1}")
    if problem.grow == 0 and out.n_bins != problem.n_bins:
        raise ConfigError(f"balancer {name!r} opened bins although growth was not allowed")
    if out.n_bins != problem.n_bins and (out.n_bins - problem.n_bins) % max(problem.grow, 1):
        raise ConfigError(f"balancer {name!r} grew to {out.n_bins} bins; growth must come in steps of {problem.grow}")
    _, tl = problem.initial()
    tl = np.concatenate([tl, np.zeros(out.n_bins - problem.n_bins, np.int64)])
    tok = tl + np.bincount(bins, weights=problem.tokens, minlength=out.n_bins).astype(np.int64)
    if problem.cap is not None and n and tok.max() > problem.cap:
        b = int(tok.argmax())
        raise ConfigError(f"balancer {name!r} put {int(tok[b])} tokens in bin {b}, over max_tokens={problem.cap}")
    if problem.count_cap is not None and n and np.bincount(bins).max() > problem.count_cap:
        raise ConfigError(f"balancer {name!r} put more than {problem.count_cap} items in one bin (equal_counts)")
    return BinAssignment(bins, out.n_bins, out.by)
