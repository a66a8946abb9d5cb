"""Synthetic workloads: buffer metadata with realistic length distributions, for demos and benchmarks."""

from .workloads import DISTRIBUTIONS, SimulatedLoaders, SyntheticSource

__all__ = ["SyntheticSource", "SimulatedLoaders", "DISTRIBUTIONS"]
