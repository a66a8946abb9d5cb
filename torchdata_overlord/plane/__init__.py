"""The data plane (paper section 4): mesh tree, DGraph, primitives, balancing, schedules, plans."""

from .costs import AttentionFlops, EncoderCost, attention_flops, encoder_cost, token_count
from .dgraph import DGraph, PlanContext
from .place_tree import ClientPlaceTree
from .plan import Plan, PlanItem
from .records import BufferMeta, Records, SampleKey
from .schedules import Constant, Cosine, Dynamic, FromCallable, Linear, Piecewise, Schedule

__all__ = ["ClientPlaceTree", "DGraph", "PlanContext", "Plan", "PlanItem", "BufferMeta", "Records", "SampleKey",
           "Schedule", "Constant", "Piecewise", "Linear", "Cosine", "FromCallable", "Dynamic",
           "token_count", "AttentionFlops", "attention_flops", "EncoderCost", "encoder_cost"]
