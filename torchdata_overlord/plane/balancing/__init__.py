"""Balancing methods (greedy, Karmarkar-Karp, user-registered) and the levels they apply at."""

from . import greedy as _greedy  # noqa: F401  (registers "greedy")
from . import karmarkar_karp as _kk  # noqa: F401  (registers "karmarkar_karp")
from .layout import LEVELS, Placement, place
from .problem import BinAssignment, BinProblem, balancer_names, get_balancer, register_balancer

__all__ = ["BinProblem", "BinAssignment", "register_balancer", "get_balancer", "balancer_names",
           "place", "Placement", "LEVELS"]
