"""The roles of paper section 3: Source Loader, Planner and Data Constructor."""

from .constructor import DataConstructor, sequence_length, sequence_of
from .planner import Planner
from .source_loader import SourceLoader

__all__ = ["Planner", "SourceLoader", "DataConstructor", "sequence_length", "sequence_of"]
