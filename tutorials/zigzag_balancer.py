"""Tutorial: add your own balancing method (the paper's Zig-Zag) and use it in a strategy.

A balancing method receives a ``BinProblem`` (item costs and tokens, the number of bins, an
optional token cap per bin) and returns the bin of every item. Zig-Zag sorts items by cost and
deals them to bins in snake order: 0, 1, ..., k-1, k-1, ..., 1, 0, 0, 1, ... It is cheap and
keeps item counts equal, but it ignores the token cap, so this version refuses a cap; the
planner would otherwise catch the overflow and name the method.

    python tutorials/zigzag_balancer.py
"""

from __future__ import annotations

import numpy as np

import torchdata_overlord as ol
from torchdata_overlord.sim import SimulatedLoaders, SyntheticSource


@ol.register_balancer("zigzag", replace=True)
def zigzag(problem: ol.BinProblem) -> np.ndarray:
    if problem.cap is not None:
        raise ol.ConfigError("zigzag ignores max_tokens; use 'greedy' or 'karmarkar_karp' with a token cap")
    k = problem.n_bins
    order = np.argsort(-problem.costs, kind="stable")
    pos = np.arange(len(order)) % (2 * k)
    snake = np.where(pos < k, pos, 2 * k - 1 - pos)
    bins = np.empty(len(order), np.int64)
    bins[order] = snake
    return bins


def main() -> dict:
    mesh = ol.ClientPlaceTree(dp=8, tp=2)
    sources = [SyntheticSource("web", "web"), SyntheticSource("code", "code")]
    results = {}
    for method in ("arrival", "zigzag", "greedy", "karmarkar_karp"):
        def strategy(g, method=method):
            return (g.mix({"web": 0.7, "code": 0.3}).distribute("DP").cost(ol.attention_flops)
                    .balance(method, microbatches=4).broadcast_at("TP").plan())

        planner = ol.Planner(strategy, mesh, global_batch=512, seed=0)
        loaders = SimulatedLoaders(sources, buffer_size=2048)
        spreads = []
        for _ in range(5):
            plan = planner.plan(loaders.buffers())
            loaders.consume(plan)
            spreads.append(plan.stats["max_over_mean"])
        results[method] = float(np.mean(spreads))
        print(f"{method:>15}: mean per-rank max/mean cost over 5 steps = {results[method]:.3f}")
    return results


if __name__ == "__main__":
    main()
