"""ParquetSource: the file-reading half of a Source Loader (paper section 3).

Streams one source's Parquet files one row group at a time, projecting only the needed columns,
in a deterministic order per (seed, epoch), and resumes exactly from a plain-dict state.

Design, in brief:

* **Sample key** = ``offset[file] + row``, where ``file`` indexes :attr:`ParquetSource.files`
  (sorted resolved paths), ``row`` is the row's index within that file and ``offset[file]`` is
  the number of rows in all earlier files (from the Parquet footers, no data read). Keys are
  dense ``0 .. num_rows-1``, identical in every epoch and run over the same file list.
* **Order**: an epoch is a sequence of *units* (one Parquet row group each). The unit order is a
  permutation drawn from ``numpy.random.default_rng([seed, epoch])``; the rows of unit
  ``(file, rg)`` are permuted by ``default_rng([seed, epoch, file, rg])``, so any position can be
  rebuilt without replaying earlier units. ``shuffle=False`` keeps file, row-group and row order.
* **State** = ``{"epoch", "unit", "row", "ahead", "units", "fingerprint"}``: ``unit`` is the position in
  this epoch's unit order, ``row`` the rows already consumed (yielded or skipped) from that unit. A
  restore reads only the row group it lands in: everything before it is skipped via metadata.
  ``ahead`` lists later units already read in part, ``[unit ordinal, rows]`` (``rows=-1``: all), so
  a state merged from data-parallel parts (below) resumes each unit where its part left it.
* **Data-parallel parts** (paper 5.1): ``shard(j, k)`` makes this source read only the units at
  positions ``j, j+k, j+2k, ...`` of each epoch's order. The order, keys and state format do not
  change, so a state of any part (or of the whole source) loads into any other shard layout.
  :attr:`last_order` is the read-order key of the row just read (``unit ordinal << 32 | row``, with
  ``unit ordinal = epoch * units + unit``): merging parts' buffers by it gives the one-reader order.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..errors import ConfigError
from .base import SKIPPED, SourceReadError
from .skip_log import SkipLog

__all__ = ["ParquetSource", "SourceReadError", "SKIPPED"]

_RELEASE_BYTES = 1 << 20  # after decoding a row group this large, give Arrow's freed pages back to the OS


# --------------------------------------------------------------------------------------------
# path resolution: globs, lists, URIs -> sorted (filesystem, path, shown name)
# --------------------------------------------------------------------------------------------

_GLOB_CHARS = re.compile(r"[*?\[]")


def _glob_regex(pattern: str) -> re.Pattern:
    """Translate a path glob to a regex: ``*``/``?`` stay within one path segment, ``**`` spans many."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*"); i += 3
        elif pattern.startswith("**", i):
            out.append(".*"); i += 2
        elif pattern[i] == "*":
            out.append("[^/]*"); i += 1
        elif pattern[i] == "?":
            out.append("[^/]"); i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            j = pattern.index("]", i + 2)
            body = pattern[i + 1:j]
            neg = body.startswith("!")
            body = (body[1:] if neg else body).replace("\\", "\\\\").replace("[", "\\[")
            out.append("[" + ("^" if neg else "") + body + "]"); i = j + 1
        else:
            out.append(re.escape(pattern[i])); i += 1
    return re.compile("".join(out))


def _expand(fs: pafs.FileSystem, pattern: str) -> list[str]:
    """Files matching ``pattern`` in ``fs``: a glob, a file, or a directory (its ``*.parquet``, recursively)."""
    m = _GLOB_CHARS.search(pattern)
    if m is None:
        info = fs.get_file_info(pattern)
        if info.type == pafs.FileType.File:
            return [pattern]
        if info.type == pafs.FileType.Directory:
            sel = pafs.FileSelector(pattern, recursive=True)
            return sorted(i.path for i in fs.get_file_info(sel)
                          if i.type == pafs.FileType.File and i.path.endswith(".parquet"))
        return []
    base = pattern[:m.start()].rpartition("/")[0] or ("/" if pattern.startswith("/") else "")
    recursive = "/" in pattern[m.start():]
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=recursive, allow_not_found=True))
    rx = _glob_regex(pattern)
    return sorted(i.path for i in infos if i.type == pafs.FileType.File and rx.fullmatch(i.path))


def _resolve(name: str, paths, filesystem) -> list[tuple[pafs.FileSystem, str, str]]:
    """Every entry of ``paths`` expanded; sorted and de-duplicated by shown name. Errors name the entry."""
    entries = [paths] if isinstance(paths, str) else list(paths)
    if not entries:
        raise ConfigError(f"source {name!r}: no paths given; pass a glob such as 'data/{name}/*.parquet'")
    found: dict[str, tuple[pafs.FileSystem, str, str]] = {}
    for entry in entries:
        if not isinstance(entry, str):
            raise ConfigError(f"source {name!r}: path entries must be strings, got {entry!r}")
        if filesystem is not None:
            fs, path = filesystem, entry
        elif "://" in entry:
            fs, path = pafs.FileSystem.from_uri(entry)
        else:
            fs, path = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(entry))
        matches = _expand(fs, path)
        if not matches:
            raise ConfigError(f"source {name!r}: {entry!r} matches no file; check the path/glob "
                              f"(globs use * ? [..] and ** for any depth)")
        for p in matches:
            shown = p if fs.type_name == "local" else f"{fs.type_name}://{p}"
            found[shown] = (fs, p, shown)
    return [found[k] for k in sorted(found)]


# --------------------------------------------------------------------------------------------
# per-file metadata, read once in __init__
# --------------------------------------------------------------------------------------------

class _File(NamedTuple):
    fs: pafs.FileSystem
    path: str
    shown: str
    size: int
    groups: tuple            # rows of each row group (a text file: one group, the whole file)
    names: list[str]
    meta: pq.FileMetaData | None = None


def _open_meta(fs: pafs.FileSystem, path: str, shown: str) -> _File:
    """Footer and schema of one file; raises ConfigError naming the file if it is not readable Parquet."""
    try:
        size = fs.get_file_info(path).size
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            meta = pf.metadata
            groups = tuple(meta.row_group(rg).num_rows for rg in range(meta.num_row_groups))
            return _File(fs, path, shown, int(size), groups, list(pf.schema_arrow.names), meta)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{shown}: not a readable Parquet file ({type(e).__name__}: {e}); "
                          f"remove it from the source or pass on_error='skip'") from e


def _columns(columns, transform) -> list[str] | None:
    """The projection: explicit ``columns``, else ``transform.columns``, else None (all columns)."""
    if columns is None:
        columns = getattr(transform, "columns", None)
    if columns is None:
        return None
    cols = [columns] if isinstance(columns, str) else list(columns)
    if not cols or not all(isinstance(c, str) for c in cols):
        raise ConfigError(f"columns must be a non-empty list of column names or None, got {columns!r}")
    return list(dict.fromkeys(cols))


# --------------------------------------------------------------------------------------------
# the source
# --------------------------------------------------------------------------------------------

class ParquetSource:
    """One source's Parquet files as an iterator of ``(sample_key, record)``, resumable exactly
    (a :class:`~torchdata_overlord.sources.base.Source`).

    ``paths``: a glob, a file, a directory, a ``pyarrow.fs`` URI (``"file:///d/*.parquet"``,
    ``"s3://b/k/*.parquet"``) or a list of those; with ``filesystem=`` they are paths inside that
    filesystem. ``transform(row_dict)`` makes the record. ``columns`` (or ``transform.columns``)
    is the projection. ``epochs=None`` cycles forever. ``on_error="skip"`` skips unreadable files,
    files without a projected column and failing samples instead of raising: :attr:`skipped` lists
    them with exact counts, the log says the first at once and then sums them up at most every
    ``skip_log_interval`` seconds (:class:`~torchdata_overlord.sources.skip_log.SkipLog`). A source
    whose every row is skipped raises rather than cycling forever.
    ``iter()`` continues from the current position; use :meth:`load_state_dict` to rewind. When a
    transform raises (on_error="raise") the position stays on that sample, so a state taken then
    resumes at it.
    """

    FORMAT = "Parquet"

    def __init__(self, name: str, paths, transform: Callable[[dict], Any] | None = None, columns=None,
                 shuffle: bool = True, seed: int = 0, epochs: int | None = None, on_error: str = "raise",
                 filesystem: pafs.FileSystem | None = None, skip_log_interval: float = 60.0):
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"source {name!r}: on_error must be 'raise' or 'skip', got {on_error!r}")
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise ConfigError(f"source {name!r}: epochs must be None (forever) or an int >= 1, got {epochs!r}")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"source {name!r}: seed must be an int >= 0, got {seed!r}")
        self.name, self.transform, self.on_error = name, transform, on_error
        self.paths, self.filesystem = paths, filesystem       # as given: enough to reopen the source elsewhere
        self.shuffle, self.seed, self.epochs = bool(shuffle), int(seed), epochs
        self.columns = _columns(columns, transform)
        self._columns_given = columns is not None        # else the transform's: its field is what to fix
        self.skips = SkipLog(name, skip_log_interval)
        self.skip_log_interval = self.skips.interval
        self.rows_passed = 0  # rows read or skipped so far (a whole-epoch run of skips means nothing is usable)
        self._files = self._open_all(_resolve(name, paths, filesystem))
        self.files = [f.shown for f in self._files]
        self._build_units()
        self.reads = 0  # row groups decoded so far (observability: restores must not re-read)
        self._part = (0, 1)  # (j, k): this reader takes units j, j+k, ... of each epoch (see shard())
        self._ahead: dict[int, int] = {}
        self.last_order = -1
        self._set_position(0, 0, 0)

    # ---- setup ------------------------------------------------------------------------------

    def _open_file(self, fs: pafs.FileSystem, path: str, shown: str) -> _File:
        """One file's row-group sizes and columns (a Parquet footer); ConfigError naming it if unreadable."""
        return _open_meta(fs, path, shown)

    def _read_group(self, f: _File, rg: int) -> pa.Table:
        """Row group ``rg`` of ``f``, projected. The file is open for this read only: a pyarrow reader
        keeps the column chunks it pre-buffered (compressed) until its next read, which would hold
        them beside the decoded row group for as long as the source serves it."""
        with f.fs.open_input_file(f.path) as raw:
            table = pq.ParquetFile(raw, metadata=f.meta).read_row_group(rg, columns=self.columns)
        if table.nbytes >= _RELEASE_BYTES:
            # decoding grows and frees buffers of about the row group's size; Arrow's allocator keeps
            # the freed pages (a process hosting many sources kept ~3 MiB per 8 MiB row group)
            pa.default_memory_pool().release_unused()
        return table

    def spec_args(self) -> tuple[Any, Any, dict]:
        """``(paths, transform, kwargs)`` to build this source again in another process: for local
        files the resolved :attr:`files` (exactly the same files in the same order); for URIs or a
        ``filesystem=`` (pyarrow filesystems pickle) the paths as given, resolved again there (the
        state's file fingerprint then refuses a file set that changed)."""
        kwargs = dict(columns=self.columns, shuffle=self.shuffle, seed=self.seed, epochs=self.epochs,
                      on_error=self.on_error, skip_log_interval=self.skip_log_interval)
        paths = list(self.files)
        if self.filesystem is not None or any("://" in f for f in self.files):
            paths, kwargs["filesystem"] = self.paths, self.filesystem
        return paths, self.transform, kwargs

    def _open_all(self, resolved) -> list[_File]:
        """Open every file's footer now, so bad files and missing columns fail before iteration."""
        files = []
        for fs, path, shown in resolved:
            try:
                f = self._open_file(fs, path, shown)
            except ConfigError as e:
                if self.on_error == "raise":
                    raise ConfigError(f"source {self.name!r}: {e}") from e.__cause__
                self._skip(shown, None, e, 0)
                continue
            missing = [c for c in self.columns or () if c not in f.names]
            if not missing:
                files.append(f)
                continue
            err = ConfigError(f"source {self.name!r}: {shown} has no column(s) {missing}; available columns: "
                              f"{f.names}. {self._columns_fix(missing)}")
            if self.on_error == "raise":
                raise err
            self._skip(shown, None, err, 0)
        return files

    def _columns_fix(self, missing: list[str]) -> str:
        """What to change when a file lacks a projected column: ``columns=`` if it was given, else the
        transform's field argument (``columns`` came from the transform)."""
        if self._columns_given:
            return "Fix `columns=`, or pass on_error='skip' to skip such files."
        return (f"The transform {self.transform!r} reads {missing}: point its field argument (e.g. "
                f"Tokenize(field=...)) at one of the available columns, or pass on_error='skip' to skip such files.")

    def _build_units(self) -> None:
        """Flatten (file, row group) into unit arrays; file offsets make the dense sample keys."""
        ufile, urg, urows, ufirst, uoffset = [], [], [], [], []
        offset = 0
        for fi, f in enumerate(self._files):
            first = 0
            for rg, n in enumerate(f.groups):
                if n:
                    ufile.append(fi); urg.append(rg); urows.append(n); ufirst.append(first); uoffset.append(offset)
                first += n
            offset += sum(f.groups)
        if offset == 0:
            skipped = self.skips.entries
            first = f"; first skipped: {skipped[0]['file']}: {skipped[0]['error']}" if skipped else ""
            raise ConfigError(f"source {self.name!r} has no rows ({len(self._files)} usable file(s), "
                              f"{len(skipped)} skipped{first}); point it at non-empty {self.FORMAT} files")
        self.num_rows = offset  # rows per epoch
        self._ufile, self._urg = np.asarray(ufile, np.int64), np.asarray(urg, np.int64)
        self._urows, self._ufirst = np.asarray(urows, np.int64), np.asarray(ufirst, np.int64)
        self._uoffset = np.asarray(uoffset, np.int64)  # key = offset of the file + row within the file
        self._fingerprint = {
            "name": self.name, "seed": self.seed, "shuffle": self.shuffle, "columns": self.columns,
            "files": [[f.shown, f.size, sum(f.groups)] for f in self._files]}

    # ---- position ---------------------------------------------------------------------------

    def shard(self, index: int, count: int) -> None:
        """Read only units ``index, index + count, ...`` of each epoch's order (a data-parallel part)."""
        if not (isinstance(count, int) and isinstance(index, int) and 0 <= index < count):
            raise ConfigError(f"source {self.name!r}: shard({index!r}, {count!r}) needs 0 <= index < count")
        self._part = (index, count)

    @property
    def part(self) -> tuple[int, int]:
        """``(j, k)``: this reader's part of the source (``(0, 1)``: all of it)."""
        return self._part

    @property
    def units(self) -> int:
        """Units (row groups, or files for text formats) per epoch: how far a source can be split."""
        return len(self._urows)

    def owns(self, order: int) -> bool:
        """Whether the row with read-order key ``order`` (see :attr:`last_order`) is in this shard's units."""
        j, k = self._part
        return k == 1 or (int(order) >> 32) % len(self._urows) % k == j

    def _set_position(self, epoch: int, unit: int, row: int, ahead=()) -> None:
        """Jump to (epoch, unit, row) using metadata only; the row group is decoded on the next read."""
        self.epoch, self._unit, self._row = epoch, unit, row
        self._ahead = {int(g): int(r) for g, r in ahead}
        self._order = self._unit_order(epoch)
        self._drop_buffer()

    def _unit_order(self, epoch: int) -> np.ndarray:
        n = len(self._urows)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _row_order(self, u: int) -> np.ndarray:
        n = int(self._urows[u])
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.epoch, int(self._ufile[u]), int(self._urg[u])]).permutation(n)

    @property
    def buffer_bytes(self) -> int:
        """Arrow bytes held right now: the one decoded row group (0 between row groups)."""
        return 0 if self._table is None else int(self._table.nbytes)

    def state_dict(self) -> dict:
        """The exact position plus the config fingerprint, as plain ints/strs/lists (JSON-able)."""
        fp = self._fingerprint
        return {"epoch": self.epoch, "unit": self._unit, "row": self._row, "units": len(self._urows),
                "ahead": [[g, r] for g, r in sorted(self._ahead.items())],
                "fingerprint": {**fp, "columns": None if fp["columns"] is None else list(fp["columns"]),
                                "files": [list(x) for x in fp["files"]]}}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken; refuses (ConfigError) a state of another config."""
        try:
            epoch, unit, row, fp = (state[k] for k in ("epoch", "unit", "row", "fingerprint"))
        except (KeyError, TypeError) as e:
            raise ConfigError(f"source {self.name!r}: not a ParquetSource state (need epoch, unit, row, "
                              f"fingerprint): {state!r:.200}") from e
        self._check_fingerprint(fp)
        ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, unit, row))
        n = len(self._urows)
        if not ints or unit > n or (unit < n and row > self._urows[self._unit_order(epoch)[unit]]):
            raise ConfigError(f"source {self.name!r}: position epoch={epoch!r} unit={unit!r} row={row!r} "
                              f"is out of range for {n} row groups")
        ahead = state.get("ahead") or []
        if not all(isinstance(a, (list, tuple)) and len(a) == 2 and all(isinstance(v, int) for v in a) for a in ahead):
            raise ConfigError(f"source {self.name!r}: state 'ahead' must be a list of [unit ordinal, rows], "
                              f"got {ahead!r:.200}")
        self._set_position(epoch, unit, row, ahead)

    def _check_fingerprint(self, fp) -> None:
        mine = self._fingerprint
        if not isinstance(fp, dict):
            raise ConfigError(f"source {self.name!r}: state fingerprint must be a dict, got {fp!r:.100}")
        for k in ("name", "seed", "shuffle", "columns"):
            if fp.get(k) != mine[k]:
                raise ConfigError(f"source {self.name!r}: state was taken with {k}={fp.get(k)!r}, this source "
                                  f"has {k}={mine[k]!r}; restore with the same configuration")
        theirs = [list(x) for x in fp.get("files") or []]
        ours = [list(x) for x in mine["files"]]
        if theirs != ours:
            i = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            a = theirs[i] if i < len(theirs) else "nothing"
            b = ours[i] if i < len(ours) else "nothing"
            raise ConfigError(f"source {self.name!r}: file list differs from the state's ({len(theirs)} vs "
                              f"{len(ours)} files); first difference at #{i}: state has {a}, now {b} "
                              f"([path, bytes, rows]). Restore over the same files.")

    # ---- reading ----------------------------------------------------------------------------

    def __iter__(self) -> "ParquetSource":
        return self

    def __next__(self) -> tuple[int, Any]:
        since = self.rows_passed
        while True:
            _, row, where = self.next_raw()
            key = where[2]
            try:
                out = self.apply(row, where)
            except SourceReadError:
                self._row -= 1      # stay on the failing sample: a state taken now resumes at it
                self.rows_passed -= 1
                raise
            if out is not SKIPPED:
                return key, out
            self.check_progress(since)

    def next_raw(self) -> tuple[int, dict, tuple[str, int, int, int]]:
        """``(index, row, where)``: the next row before the transform; ``index = epoch * num_rows + key``
        (unique over the run), ``where = (file, row, key, epoch)`` for :meth:`apply`.

        Reading is sequential and cheap; a Source Loader runs :meth:`apply` on a worker pool.
        """
        since = self.rows_passed
        while True:
            if self.epochs is not None and self.epoch >= self.epochs:
                raise StopIteration
            if self._unit >= len(self._urows):
                self._set_position(self.epoch + 1, 0, 0, self._ahead.items())
                continue
            u = int(self._order[self._unit])
            if self._part[1] > 1 and self._unit % self._part[1] != self._part[0]:
                self._unit, self._row = self._unit + 1, 0       # another part's unit
                continue
            if self._table is None and self._ahead:
                self._resume_unit(u)
            if self._row >= self._urows[u]:
                self._unit, self._row = self._unit + 1, 0
                self._drop_buffer()
                continue
            if self._table is None and not self._load(u):
                self.check_progress(since)
                continue
            return self._sample(u)

    def _resume_unit(self, u: int) -> None:
        """Before reading unit ``u``: skip the rows a data-parallel part read of it before a reshard (``ahead``)."""
        g = self.epoch * len(self._urows) + self._unit
        done = self._ahead.pop(g, 0)
        for old in [x for x in self._ahead if x < g]:
            del self._ahead[old]
        if done:
            self._row = int(self._urows[u]) if done < 0 else max(self._row, min(done, int(self._urows[u])))

    def check_progress(self, since: int) -> None:
        """Raise if every row since ``rows_passed`` was ``since`` was skipped and those rows span a whole
        epoch (any ``2 * num_rows - 1`` consecutive rows do): then no row of the source is usable, and
        skipping on would cycle forever."""
        n = self.rows_passed - since
        if n >= 2 * self.num_rows - 1:
            raise SourceReadError(f"source {self.name!r}: {n} rows in a row were skipped (on_error='skip'), a whole "
                                  f"epoch of its {self.num_rows} rows: no row of this source is usable (latest: "
                                  f"{self.skips.latest}). Fix the files or the transform.")

    def apply(self, row: dict, where: tuple[str, int, int, int]):
        """``transform(row)`` under this source's error policy: the record, or ``SKIPPED``."""
        if self.transform is None:
            return row
        try:
            return self.transform(row)
        except Exception as e:  # noqa: BLE001 (any user error: wrap with file and row)
            f, r, key, epoch = where
            if self.on_error == "raise":
                raise SourceReadError(f"source {self.name!r}: transform failed on {f} row {r} (key {key}): "
                                      f"{type(e).__name__}: {e}. Fix the transform or pass "
                                      f"on_error='skip'.") from e
            self._skip(f, r, e, epoch)
            return SKIPPED

    def _load(self, u: int) -> bool:
        """Decode unit ``u``'s row group (the only one held). False if it was skipped as unreadable."""
        f, rg = self._files[int(self._ufile[u])], int(self._urg[u])
        try:
            self._table = self._read_group(f, rg)
        except (pa.ArrowException, OSError) as e:
            first = int(self._ufirst[u])
            if self.on_error == "raise":
                raise SourceReadError(f"source {self.name!r}: reading {f.shown} row group {rg} (rows from "
                                      f"{first}) failed: {type(e).__name__}: {e}; has the file changed "
                                      f"since the source was opened? Or pass on_error='skip'.") from e
            self._skip(f.shown, first, e, self.epoch)
            self.rows_passed += int(self._urows[u]) - self._row
            self._unit, self._row = self._unit + 1, 0
            return False
        self.reads += 1
        self._perm = self._row_order(u)
        self._columns_held = list(zip(self._table.column_names, self._table.columns))
        return True

    def _sample(self, u: int) -> tuple[int, dict, tuple[str, int, int, int]]:
        """The raw row at the current position, advancing past it. Converted to Python value by value
        (as ``Table.to_pylist`` does), with no Arrow allocation: a ``take`` of the next rows allocated in
        every reading thread, and pyarrow's allocator gives each such thread pages of its own (~3 MiB
        per Source Loader thread in a process hosting many)."""
        i = int(self._perm[self._row])                    # row index within the row group
        r = int(self._ufirst[u]) + i                      # row index within the file
        row = {name: column[i].as_py() for name, column in self._columns_held}
        key = int(self._uoffset[u]) + r
        self.last_order = ((self.epoch * len(self._urows) + self._unit) << 32) | self._row
        self._row += 1
        self.rows_passed += 1
        return self.epoch * self.num_rows + key, row, (self._files[int(self._ufile[u])].shown, r, key, self.epoch)

    @property
    def skipped(self) -> list[dict]:
        """What ``on_error="skip"`` skipped: per file/row ``file``, ``row`` (None: the whole file; a row
        group's first row when the row group could not be read), ``error`` and ``count`` (epochs)."""
        return self.skips.entries

    def _skip(self, file: str, row: int | None, err: BaseException, epoch: int) -> None:
        self.skips.add(file, row, f"{type(err).__name__}: {err}", epoch)

    def _drop_buffer(self) -> None:
        self._table, self._perm, self._columns_held = None, None, []

    def close(self) -> None:
        """Release the decoded row group (iteration reads it again as needed); log the skips not yet
        summed up."""
        self.skips.flush()
        self._drop_buffer()

    def __enter__(self) -> "ParquetSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ParquetSource({self.name!r}, {len(self.files)} files, {self.num_rows} rows, "
                f"epoch={self.epoch}, unit={self._unit}/{len(self._urows)}, row={self._row})")
