"""The orchestration primitives (paper section 4.2), one operator per module.

Each operator is built from its arguments and applied to a DGraph with ``apply(graph)``;
``DGraph.mix(...)`` and friends are shorthands. Operators with state across steps keep it in
the Planner's state store (``PlanContext.state``) so that it is checkpointed with the Planner.
"""

from .balance import Balance
from .broadcast import BroadcastAt
from .cost import Cost
from .distribute import Distribute
from .mix import Mix

__all__ = ["Mix", "Distribute", "Cost", "Balance", "BroadcastAt"]
