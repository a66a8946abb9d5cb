"""FileSource: JSON Lines, CSV and Arrow IPC (Feather v2) files as a source, with ParquetSource's order,
epochs, error policy and exact resume.

Text formats have no footer that says how many rows a file holds, so opening the source parses each
file once (single-threaded ``pyarrow.json`` / ``pyarrow.csv`` readers: the same rows in the same
order on every run) to count its rows and check its columns; the file-metadata journal
(:mod:`.metadata_cache`) keeps both, so a later opening parses only the files whose size or mtime
changed. Reading decodes one whole file at a time, as :class:`~torchdata_overlord.ParquetSource`
decodes one row group. Keep files to shard size (tens to hundreds of MiB); a ``.gz`` suffix is
decompressed on the fly.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.ipc as paipc
import pyarrow.json as pajson

from ..errors import ConfigError
from .parquet import ParquetSource, _File

__all__ = ["FileSource"]

_SUFFIXES = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".csv": "csv",
             ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}
_NAMES = {"json": "JSON Lines", "csv": "CSV", "arrow": "Arrow IPC"}


def file_format(path: str, given: str | None) -> str:
    """``given``, else the format the file's suffix names (a ``.gz`` suffix is looked through)."""
    if given is not None:
        return given
    base = path[:-3] if path.endswith(".gz") else path
    for suffix, fmt in _SUFFIXES.items():
        if base.endswith(suffix):
            return fmt
    raise ConfigError(f"{path}: cannot tell its format from its name; pass format='json', 'csv' or 'arrow'")


def _blank(fs: pafs.FileSystem, path: str) -> bool:
    """Whether the file (decompressed) holds only whitespace; False if it cannot be read."""
    try:
        with fs.open_input_stream(path, compression="detect") as stream:
            while chunk := stream.read(1 << 16):
                if chunk.strip():
                    return False
        return True
    except (pa.ArrowException, OSError):
        return False


class FileSource(ParquetSource):
    """One source's JSON Lines (``.jsonl``, ``.json``, ``.ndjson``), CSV (``.csv``) or Arrow IPC
    (``.arrow``, ``.feather``, ``.ipc``) files, each possibly ``.gz``; ``format=`` overrides the
    suffix for every file. Every other argument and behaviour is :class:`~torchdata_overlord.ParquetSource`'s
    (a file plays the part of one row group), including the state and its file fingerprint."""

    def __init__(self, name: str, paths, transform=None, columns=None, shuffle: bool = True, seed: int = 0,
                 epochs: int | None = None, on_error: str = "raise", filesystem: pafs.FileSystem | None = None,
                 skip_log_interval: float = 60.0, format: str | None = None, metadata_cache=None,
                 file_table=None):
        if format is not None and format not in _NAMES:
            raise ConfigError(f"source {name!r}: format must be None (from each file's suffix), 'json', 'csv' or "
                              f"'arrow', got {format!r}")
        self.format = format
        super().__init__(name, paths, transform, columns=columns, shuffle=shuffle, seed=seed, epochs=epochs,
                         on_error=on_error, filesystem=filesystem, skip_log_interval=skip_log_interval,
                         metadata_cache=metadata_cache, file_table=file_table)

    @property
    def FORMAT(self) -> str:           # noqa: N802 - the name ParquetSource's messages use
        return _NAMES[self.format] if self.format else "JSON Lines/CSV/Arrow IPC"

    def _read_table(self, fs: pafs.FileSystem, path: str, shown: str) -> pa.Table:
        fmt = file_format(shown, self.format)
        if fmt == "arrow":
            with fs.open_input_file(path) as f:
                try:
                    return paipc.open_file(f).read_all()
                except pa.ArrowInvalid:             # the IPC stream format (no footer)
                    f.seek(0)
                    return paipc.open_stream(f).read_all()
        with fs.open_input_stream(path, compression="detect") as stream:
            if fmt == "json":
                return pajson.read_json(stream, read_options=pajson.ReadOptions(use_threads=False))
            return pacsv.read_csv(stream, read_options=pacsv.ReadOptions(use_threads=False))

    def _open_file(self, fs: pafs.FileSystem, path: str, shown: str) -> tuple[tuple, list[str]]:
        """Parse the whole file once: its row count and columns (ConfigError naming it if unreadable). An
        empty (or blank) JSON Lines/CSV file has no row and no column, as an empty Parquet file has no row:
        pyarrow refuses it, but it is not damaged."""
        try:
            table = self._read_table(fs, path, shown)
        except (pa.ArrowException, OSError) as e:
            if file_format(shown, self.format) != "arrow" and isinstance(e, pa.ArrowInvalid) and _blank(fs, path):
                return (0,), []
            raise ConfigError(f"{shown}: not a readable {_NAMES[file_format(shown, self.format)]} file "
                              f"({type(e).__name__}: {e}); fix or remove it, or pass on_error='skip'") from e
        return (table.num_rows,), list(table.column_names)

    def _journal_kind(self) -> str:
        return f"text:{self.format or 'by-suffix'}"

    def _read_group(self, f: _File, rg: int) -> pa.Table:
        table = self._read_table(f.fs, f.path, f.shown)
        if table.num_rows != f.groups[0]:
            raise OSError(f"{table.num_rows} rows now, {f.groups[0]} when the source was opened")
        return table if self.columns is None else table.select(self.columns)

    def spec_args(self):
        paths, transform, kwargs = super().spec_args()
        return paths, transform, {**kwargs, "format": self.format}
