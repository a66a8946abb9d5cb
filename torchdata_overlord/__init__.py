"""torchdata_overlord: disaggregated, cost-balanced multi-source data loading for PyTorch (OVERLORD).

The public API, in the order a training script meets it:

* the mesh: :class:`ClientPlaceTree`;
* the declarative data plane a strategy is written in: :class:`DGraph` with the primitives
  ``mix``, ``distribute``, ``cost``, ``balance``, ``broadcast_at`` and ``plan``, the schedules
  (:class:`Constant`, :class:`Piecewise`, :class:`Linear`, :class:`Cosine`, :class:`FromCallable`,
  :class:`Dynamic`), the cost models (:func:`token_count`, :data:`attention_flops`,
  :data:`encoder_cost`) and :func:`register_balancer` for user balancing methods;
* the roles: :class:`Planner` (runs a strategy on buffer metadata, one :class:`Plan` per step);
* the metadata a Source Loader reports: :class:`BufferMeta`;
* real data: the sources (:class:`ParquetSource`; :class:`FileSource` for JSON Lines, CSV and Arrow IPC
  files; :class:`NodeSource` for any stateful ``torchdata.nodes`` node; :class:`Source`, the protocol
  they share) with the sample transforms :class:`Tokenize` and :class:`ImageText`;
* the trainer's drop-in ``DataLoader``: :class:`OverlordLoader`, with :class:`FaultTolerance` to
  keep feeding through failed roles under ``runtime="rpc"``; what it yields, key by key:
  :class:`Batch` and :class:`Microbatch` (``torchdata_overlord.batch``); a state saved under another
  mesh resumes elastically (:mod:`torchdata_overlord.elastic` says what carries over; ``elastic.earliest``
  picks the state to load when ranks disagree).
"""

from . import elastic
from .batch import Batch, Microbatch
from .errors import BufferShortageError, ConfigError, OverlordError, OversizeSampleError
from .plane import (AttentionFlops, BufferMeta, ClientPlaceTree, Constant, Cosine, DGraph, Dynamic, EncoderCost,
                    FromCallable, Linear, Piecewise, Plan, PlanItem, SampleKey, Schedule, attention_flops,
                    encoder_cost, token_count)
from .plane.balancing import BinProblem, register_balancer
from .loader import FaultTolerance, OverlordLoader
from .roles import Planner
from .sources import FileSource, NodeSource, ParquetSource, Source, SourceReadError
from .transforms import ImageText, Tokenize

__version__ = "0.1.0"

__all__ = [
    "OverlordLoader", "FaultTolerance", "Batch", "Microbatch", "Source", "ParquetSource", "FileSource", "NodeSource",
    "Tokenize", "ImageText",
    "ClientPlaceTree", "DGraph", "Plan", "PlanItem", "SampleKey", "BufferMeta", "Planner",
    "Schedule", "Constant", "Piecewise", "Linear", "Cosine", "FromCallable", "Dynamic",
    "token_count", "AttentionFlops", "attention_flops", "EncoderCost", "encoder_cost",
    "register_balancer", "BinProblem",
    "OverlordError", "ConfigError", "OversizeSampleError", "BufferShortageError", "SourceReadError",
]
