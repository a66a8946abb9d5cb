"""FileSource: JSON Lines, CSV and Arrow IPC (Feather v2) files as a source, with ParquetSource's order,
epochs, error policy and exact resume.

Text formats have no footer that says how many rows a file holds, so opening the source parses each
file once (single-threaded ``pyarrow.json`` / ``pyarrow.csv`` readers: the same rows in the same
order on every run) to count its rows and check its columns; the file-metadata journal
(:mod:`.metadata_cache`) keeps both, so a later opening parses only the files whose size or mtime
changed. Reading decodes one whole file at a time, as :class:`~torchdata_overlord.ParquetSource`
decodes one row group. Keep files to shard size (tens to hundreds of MiB); a ``.gz`` suffix is
decompressed on the fly.

CSV cells arrive as the text in the file (every column a string: no type inference, no null), unless
``csv_convert_options`` asks for ``pyarrow.csv``'s conversion (see :class:`FileSource`).
"""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.ipc as paipc
import pyarrow.json as pajson

from ..errors import ConfigError
from .parquet import ParquetSource, _check_unchanged, _File

__all__ = ["FileSource"]

_SUFFIXES = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".csv": "csv",
             ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}
_NAMES = {"json": "JSON Lines", "csv": "CSV", "arrow": "Arrow IPC"}
# pyarrow.csv.ConvertOptions' keyword arguments (default_column_type: pyarrow >= 26 only)
_CONVERT_KEYS = [k for k in ("check_utf8", "column_types", "default_column_type", "null_values", "true_values",
                             "false_values", "decimal_point", "strings_can_be_null", "quoted_strings_can_be_null",
                             "include_columns", "include_missing_columns", "auto_dict_encode",
                             "auto_dict_max_cardinality", "timestamp_parsers") if hasattr(pacsv.ConvertOptions(), k)]
_DEFAULT_COLUMN_TYPE = "default_column_type" in _CONVERT_KEYS


def _as_text(names=None) -> pacsv.ConvertOptions:
    """Every column a string, none null: the cells' text as it is in the file. ``names``: the file's
    columns (where pyarrow has no ``default_column_type``, types can only be given by name)."""
    if _DEFAULT_COLUMN_TYPE:
        kwargs = {"default_column_type": pa.string()}
    else:
        kwargs = {"column_types": {n: pa.string() for n in names}}
    return pacsv.ConvertOptions(strings_can_be_null=False, quoted_strings_can_be_null=False, null_values=[],
                                **kwargs)


def _convert_kwargs(name: str, given) -> dict:
    """``csv_convert_options`` (a ConvertOptions or a dict of its keyword arguments) as a dict of every
    keyword argument: plain values that pickle (a ConvertOptions does not), for :meth:`spec_args`."""
    try:
        opts = given if isinstance(given, pacsv.ConvertOptions) else pacsv.ConvertOptions(**given)
        opts.validate()
    except (TypeError, ValueError, pa.ArrowException) as e:
        raise ConfigError(f"source {name!r}: csv_convert_options is not valid pyarrow.csv.ConvertOptions "
                          f"({type(e).__name__}: {e})") from e
    return {k: getattr(opts, k) for k in _CONVERT_KEYS}


def _plain(v):
    """``v`` as JSON (a digest of conversion options names their journal)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in sorted(v.items())}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v) if isinstance(v, pa.DataType) else type(v).__name__     # a type; pyarrow.csv.ISO8601


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
    (``.arrow``, ``.feather``, ``.ipc``) files, each possibly ``.gz`` (a directory: its files with these
    suffixes); ``format=`` overrides the suffix for every file. Every other argument and behaviour is
    :class:`~torchdata_overlord.ParquetSource`'s
    (a file plays the part of one row group), including the state and its file fingerprint. So under
    ``on_error="skip"`` one row that does not parse (a broken JSON line, a CSV cell that is not UTF-8, a
    CSV row with too many cells) skips its whole file, where a Parquet file loses the row group at most;
    a row that parses but the transform fails on is skipped alone, and so is a row that parses but holds a
    string that is not valid UTF-8 (``pyarrow.json`` accepts one; reading it as ``str`` fails): counted as a
    failing row, and under ``on_error="raise"`` a SourceReadError names the file, row and column.

    CSV cells arrive as the exact text in the file (a CSV file must be UTF-8): every column a ``str``,
    no type inference, no null (an empty cell is ``""``; ``"00123"``, ``"1e3"``, ``"true"``, ``"NA"``,
    ``"null"`` stay those strings). ``csv_convert_options`` changes that: ``"infer"`` is
    ``pyarrow.csv``'s own conversion (numbers, booleans, timestamps; ``""``, ``"NA"``, ``"null"``, ...
    as None); a ``pyarrow.csv.ConvertOptions``, or a dict of its keyword arguments, is used as given
    (pyarrow infers the type of every column it does not type). It is for CSV files only (a
    ConfigError with ``format='json'`` or ``'arrow'``); JSON Lines and Arrow IPC files are read as
    ever. It never changes a file's row count, so states are the same whichever is chosen."""

    UNITS = "files"      # what a data-parallel loader actor reads whole (see :meth:`shard`)
    SUFFIXES = tuple(s + z for s in _SUFFIXES for z in ("", ".gz"))   # the files of a directory it reads

    def __init__(self, name: str, paths, transform=None, columns=None, shuffle: bool = True, seed: int = 0,
                 epochs: int | None = None, on_error: str = "raise", filesystem: pafs.FileSystem | None = None,
                 skip_log_interval: float = 60.0, format: str | None = None, metadata_cache=None,
                 file_table=None, csv_convert_options=None):
        if format is not None and format not in _NAMES:
            raise ConfigError(f"source {name!r}: format must be None (from each file's suffix), 'json', 'csv' or "
                              f"'arrow', got {format!r}")
        if csv_convert_options is None or (isinstance(csv_convert_options, str) and csv_convert_options == "infer"):
            convert = csv_convert_options
        elif isinstance(csv_convert_options, (pacsv.ConvertOptions, dict)):
            convert = _convert_kwargs(name, csv_convert_options)
        else:
            raise ConfigError(f"source {name!r}: csv_convert_options must be None (every CSV cell its text, as a "
                              f"string), 'infer' (pyarrow.csv's type inference and null values), a "
                              f"pyarrow.csv.ConvertOptions or a dict of its keyword arguments, got "
                              f"{csv_convert_options!r}")
        if convert is not None and format in ("json", "arrow"):
            raise ConfigError(f"source {name!r}: csv_convert_options is for CSV files; this source reads "
                              f"format={format!r}")
        self.format = format
        self.csv_convert_options = convert      # None, "infer" or a dict of ConvertOptions' keyword arguments
        super().__init__(name, paths, transform, columns=columns, shuffle=shuffle, seed=seed, epochs=epochs,
                         on_error=on_error, filesystem=filesystem, skip_log_interval=skip_log_interval,
                         metadata_cache=metadata_cache, file_table=file_table)

    @property
    def FORMAT(self) -> str:           # noqa: N802 - the name ParquetSource's messages use
        return _NAMES[self.format] if self.format else "JSON Lines/CSV/Arrow IPC"

    def _csv_convert(self, fs: pafs.FileSystem, path: str, names) -> pacsv.ConvertOptions:
        """The ConvertOptions a CSV file is read with. ``names``: its columns when known (None: read from
        its header here, if pyarrow needs them to type every column a string)."""
        if self.csv_convert_options == "infer":       # pyarrow.csv's own conversion
            return pacsv.ConvertOptions()
        if self.csv_convert_options is not None:
            return pacsv.ConvertOptions(**self.csv_convert_options)
        if names is None and not _DEFAULT_COLUMN_TYPE:
            with fs.open_input_stream(path, compression="detect") as stream:   # the header's column names
                reader = pacsv.open_csv(stream, read_options=pacsv.ReadOptions(use_threads=False))
                names = reader.schema.names
                reader.close()
        return _as_text(names)

    def _read_table(self, fs: pafs.FileSystem, path: str, shown: str, names=None) -> pa.Table:
        fmt = file_format(shown, self.format)
        if fmt == "arrow":
            with fs.open_input_file(path) as f:
                try:
                    return paipc.open_file(f).read_all()
                except pa.ArrowInvalid:             # the IPC stream format (no footer)
                    f.seek(0)
                    return paipc.open_stream(f).read_all()
        convert = self._csv_convert(fs, path, names) if fmt == "csv" else None
        with fs.open_input_stream(path, compression="detect") as stream:
            if fmt == "json":
                return pajson.read_json(stream, read_options=pajson.ReadOptions(use_threads=False))
            return pacsv.read_csv(stream, read_options=pacsv.ReadOptions(use_threads=False), convert_options=convert)

    def _open_file(self, fs: pafs.FileSystem, path: str, shown: str) -> tuple[tuple, list[str]]:
        """Parse the whole file once: its row count and columns (ConfigError naming it if unreadable, saying what
        is wrong: the source adds what to do, see ParquetSource._open_file). An
        empty (or blank) JSON Lines/CSV file has no row and no column, as an empty Parquet file has no row:
        pyarrow refuses it, but it is not damaged."""
        try:
            table = self._read_table(fs, path, shown)
        except (pa.ArrowException, OSError) as e:
            if file_format(shown, self.format) != "arrow" and isinstance(e, pa.ArrowInvalid) and _blank(fs, path):
                return (0,), []
            raise ConfigError(f"{shown}: not a readable {_NAMES[file_format(shown, self.format)]} file "
                              f"({type(e).__name__}: {e})") from e
        return (table.num_rows,), list(table.column_names)

    def _journal_kind(self) -> str:
        kind = f"text:{self.format or 'by-suffix'}"
        if self.csv_convert_options is None:      # the cells' text: row counts and columns as any conversion's
            return kind
        # other options may fail on a file, or (include_columns) name other columns: a journal of their own
        digest = hashlib.sha256(json.dumps(_plain(self.csv_convert_options), sort_keys=True).encode()).hexdigest()
        return f"{kind}:csv-convert-{digest[:16]}"

    def _read_group(self, f: _File, rg: int) -> pa.Table:
        table = self._read_table(f.fs, f.path, f.shown, f.names)
        if table.num_rows != f.groups[0]:
            raise OSError(f"{table.num_rows} rows now, {f.groups[0]} when the source was opened")
        if file_format(f.shown, self.format) == "csv" and list(table.column_names) != list(f.names):
            raise OSError(f"columns {table.column_names} now, {list(f.names)} when the source was opened")
        _check_unchanged(f)                         # (as many rows: rewritten in place, or not at all)
        return table if self.columns is None else table.select(self.columns)

    def spec_args(self):
        paths, transform, kwargs = super().spec_args()
        return paths, transform, {**kwargs, "format": self.format, "csv_convert_options": self.csv_convert_options}
