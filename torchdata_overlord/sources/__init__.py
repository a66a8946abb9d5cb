"""Sources: reading one data source's files for a Source Loader (paper section 3)."""

from .parquet import ParquetSource, SourceReadError

__all__ = ["ParquetSource", "SourceReadError"]
