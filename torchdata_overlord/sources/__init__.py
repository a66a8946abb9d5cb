"""Sources: what a Source Loader reads (paper section 3). :class:`Source` is the protocol; ParquetSource,
FileSource (JSON Lines, CSV, Arrow IPC) and NodeSource (any stateful torchdata node) implement it."""

from .base import SKIPPED, Source, SourceReadError
from .files import FileSource
from .node import NodeSource
from .parquet import ParquetSource

__all__ = ["Source", "ParquetSource", "FileSource", "NodeSource", "SourceReadError", "SKIPPED"]
