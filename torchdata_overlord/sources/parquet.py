"""ParquetSource: the file-reading half of a Source Loader (paper section 3).

Streams one source's Parquet files one row group at a time, projecting only the needed columns,
in a deterministic order per (seed, epoch), and resumes exactly from a plain-dict state.

Design, in brief:

* **Sample key** = ``offset[file] + row``, where ``file`` indexes :attr:`ParquetSource.files`
  (sorted resolved paths), ``row`` is the row's index within that file and ``offset[file]`` is
  the number of rows in all earlier files (from the Parquet footers, no data read). Keys are
  dense ``0 .. num_rows-1``, identical in every epoch and run over the same file list (wherever it is:
  sorting paths under one root sorts their relative paths). A row's *index* (what ``next_raw`` and
  iteration give, and the ``"source:index"`` a batch names it by) is ``epoch * num_rows + key``: unique
  over the run, and ``index % num_rows`` is the key.
* **Order**: an epoch is a sequence of *units* (one Parquet row group each). The unit order is a
  permutation drawn from ``numpy.random.default_rng([seed, epoch])``; the rows of unit
  ``(file, rg)`` are permuted by ``default_rng([seed, epoch, file, rg])``, so any position can be
  rebuilt without replaying earlier units. ``shuffle=False`` keeps file, row-group and row order.
* **State** = ``{"epoch", "unit", "row", "ahead", "units", "fingerprint"}``: ``unit`` is the position in
  this epoch's unit order, ``row`` the rows already consumed (yielded or skipped) from that unit. A
  restore reads only the row group it lands in: everything before it is skipped via metadata.
  ``ahead`` lists later units already read in part, ``[unit ordinal, rows]`` (``rows=-1``: all), so
  a state merged from data-parallel parts (below) resumes each unit where its part left it.
* **Files fingerprint**: a state says which files it was taken over: ``[path, bytes, rows]`` of each
  (absolute paths, with their URI scheme), or for more than :data:`FILES_LISTED` files their count, rows
  and digests (:func:`_digest`). Keys, order and position depend on the files' order, row groups and rows
  only, never on where they are, so a state also loads over the same files under another root: the
  same paths relative to the file set's common root (the longest folder the files share; one file's:
  its folder), the same sizes and row counts, in the same order (the data copied to a local SSD, another
  mount point or bucket prefix); the move is logged. Any other difference is refused, naming it.
* **Data-parallel parts** (paper 5.1): ``shard(j, k)`` makes this source read only the units at
  positions ``j, j+k, j+2k, ...`` of each epoch's order. The order, keys and state format do not
  change, so a state of any part (or of the whole source) loads into any other shard layout.
  :attr:`last_order` is the read-order key of the row just read (``unit ordinal << 32 | row``, with
  ``unit ordinal = epoch * units + unit``): merging parts' buffers by it gives the one-reader order.
* **Opening** lists the files once and reads each footer's row-group sizes and column names; the
  file-metadata journal (:mod:`.metadata_cache`) keeps those, so a later opening reads only the
  files whose size or mtime changed, and ``spec_args()`` carries them to a process that rebuilds
  the source (no listing, no footer read there). Only those numbers and names are held per file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import operator
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..errors import ConfigError, a_type
from .base import SKIPPED, SourceReadError
from .metadata_cache import FileTable, cache_dir, journal_path, load_journal, pointer_path, save_journal
from .skip_log import SkipLog

__all__ = ["ParquetSource", "SourceReadError", "SKIPPED"]

log = logging.getLogger("torchdata_overlord")

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


def _expand(fs: pafs.FileSystem, pattern: str, suffixes: tuple[str, ...] = (".parquet",), name: str = "",
            kind: str = "ParquetSource") -> list[tuple[str, int, int | None]]:
    """Files matching ``pattern`` in ``fs``, sorted, as ``(path, size, mtime_ns)`` from the listing: a
    glob, a file, or a directory (its files named with one of ``suffixes``, recursively). A directory or
    glob leaves out files and folders whose names start with ``.`` or ``_`` (see :func:`_hidden`); a file
    named in full is read. Of a directory, the other files left out are logged; a directory holding none
    of ``suffixes`` but other files is a ConfigError saying so."""
    file = pafs.FileType.File
    m = _GLOB_CHARS.search(pattern)
    if m is None:
        info = fs.get_file_info(pattern)
        if info.type == file:
            return [(pattern, info.size, info.mtime_ns)]
        if info.type != pafs.FileType.Directory:
            return []
        visible = [x for x in _listing(fs, pattern, True) if not _hidden(x[0], pattern)]
        found = sorted(x for x in visible if x[0].endswith(suffixes))
        other = sorted(x[0] for x in visible if not x[0].endswith(suffixes))
        if other and not found:
            raise ConfigError(f"source {name!r}: directory {pattern!r} holds {len(other)} file(s) but none named "
                              f"{' or '.join('*' + s for s in suffixes)}, which {kind} reads from a directory (e.g. "
                              f"{other[0]!r}); " + ("JSON Lines, CSV and Arrow IPC files are FileSource's"
                                                    if kind == "ParquetSource" else
                                                    "name the files with a glob, and pass format= for files "
                                                    "whose suffix does not give it"))
        if other:
            log.warning("source %r: directory %r: left out %d file(s) not named %s (e.g. %r); name them with a glob "
                        "to read them", name, pattern, len(other), " or ".join("*" + s for s in suffixes), other[0])
        return found
    base = pattern[:m.start()].rpartition("/")[0] or ("/" if pattern.startswith("/") else "")
    rx = _glob_regex(pattern)
    return sorted(x for x in _listing(fs, base, "/" in pattern[m.start():])
                  if rx.fullmatch(x[0]) and not _hidden(x[0], base, pattern[len(base):]))


_HIDDEN = (".", "_")    # names a listing leaves out, as pyarrow.dataset, Spark and Hive do (_temporary, _SUCCESS, .crc)


def _hidden(path: str, base: str, pattern: str = "") -> bool:
    """Whether a file or folder of ``path`` below ``base`` is named with a :data:`_HIDDEN` prefix (an uncommitted
    job's ``_temporary/``, ``_SUCCESS``, ``.part-0.crc``, macOS ``._x.parquet``), unless ``pattern`` (the glob
    below ``base``) names such a prefix itself (``_*.parquet``: the user asked for them)."""
    asked = {seg[0] for seg in pattern.split("/") if seg and seg[0] in _HIDDEN}
    return any(c[0] in _HIDDEN and c[0] not in asked for c in path[len(base):].split("/") if c)


LIST_THREADS = 4        # threads listing the subfolders of a folder (pyarrow lists without the GIL)


def _listing(fs: pafs.FileSystem, base: str, recursive: bool) -> list[tuple[str, int, int | None]]:
    """The files under directory ``base`` of ``fs`` as ``(path, size, mtime_ns)``, unordered; [] if it is
    missing. A recursive listing of a folder of folders lists each subfolder on a thread (100,000 files
    in 100 folders: 0.5 -> 0.3 s here). ``is_file``, not ``type == FileType.File``: over 100,000
    files the enum costs a third of the listing."""
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=False, allow_not_found=True))
    out = [(i.path, i.size, i.mtime_ns) for i in infos if i.is_file]
    subdirs = [i.path for i in infos if not i.is_file and i.type == pafs.FileType.Directory] if recursive else []
    if len(subdirs) > 1:
        with ThreadPoolExecutor(min(LIST_THREADS, len(subdirs)), thread_name_prefix="overlord-list") as pool:
            for part in pool.map(lambda d: _listing_all(fs, d), subdirs):
                out += part
    elif subdirs:
        out += _listing_all(fs, subdirs[0])
    return out


def _listing_all(fs: pafs.FileSystem, base: str) -> list[tuple[str, int, int | None]]:
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    return [(i.path, i.size, i.mtime_ns) for i in infos if i.is_file]


class _Listing(NamedTuple):
    """The resolved files, column by column, sorted by shown name: ``mtime`` is the listing's
    ``mtime_ns`` (-1 where the filesystem gives none); ``fs_index`` points into ``filesystems``;
    ``entries``: the path entries as resolved (absolute, with their filesystem's scheme)."""
    entries: list[str]
    filesystems: list
    fs_index: list[int]
    shown: list[str]
    size: list[int]
    mtime: list[int]


def _resolve(name: str, paths, filesystem, suffixes: tuple[str, ...] = (".parquet",),
             kind: str = "ParquetSource") -> _Listing:
    """Every entry of ``paths`` expanded; sorted and de-duplicated by shown name. Errors name the entry.
    Sizes and mtimes come from the listing itself (no file is opened or stat'ed again)."""
    entries = [paths] if isinstance(paths, str) else list(paths)
    if not entries:
        raise ConfigError(f"source {name!r}: no paths given; pass a glob such as 'data/{name}/*.parquet'")
    filesystems: list = []
    resolved: list[str] = []
    found: dict[str, tuple] = {}
    local_fs = pafs.LocalFileSystem()
    for entry in entries:
        if not isinstance(entry, str):
            raise ConfigError(f"source {name!r}: path entries must be strings, got {entry!r}")
        if filesystem is not None:
            fs, path = filesystem, entry
        elif "://" in entry:
            fs, path = pafs.FileSystem.from_uri(entry)
        else:
            fs, path = local_fs, os.path.abspath(os.path.expanduser(entry))
        matches = _expand(fs, path, suffixes, name, kind)
        if not matches:
            raise ConfigError(f"source {name!r}: {entry!r} matches no file; check the path/glob "
                              f"(globs use * ? [..] and ** for any depth)")
        k = next((j for j, g in enumerate(filesystems) if g is fs or g.equals(fs)), None)
        if k is None:
            filesystems.append(fs)
            k = len(filesystems) - 1
        scheme = "" if fs.type_name == "local" else f"{fs.type_name}://"
        resolved.append(scheme + path)
        if len(entries) == 1:                  # one entry: its matches are sorted and distinct already
            return _Listing(resolved, filesystems, [0] * len(matches), [scheme + p for p, _, _ in matches],
                            [z or 0 for _, z, _ in matches], [-1 if t is None else t for _, _, t in matches])
        for path, size, mtime in matches:
            found[scheme + path] = (k, size or 0, -1 if mtime is None else mtime)
    shown = sorted(found)
    rows = [found[s] for s in shown]
    return _Listing(resolved, filesystems, [r[0] for r in rows], shown, [r[1] for r in rows], [r[2] for r in rows])


# --------------------------------------------------------------------------------------------
# per-file metadata: row-group sizes and columns, from the journal, a spec, or the footers
# --------------------------------------------------------------------------------------------

class _File(NamedTuple):
    fs: pafs.FileSystem
    path: str
    shown: str
    size: int
    groups: tuple            # rows of each row group (a text file: one group, the whole file)
    names: list[str]
    mtime: int = -1          # mtime_ns when listed (-1: unknown)


def _check_unchanged(f: _File, size: int | None = None) -> None:
    """Raise OSError when file ``f`` is not the one listed when the source opened: another size (``size``: as
    the open file says, where no stat is made), or on a local disk another mtime (a file rewritten in place
    with the same row groups gave its new rows under the old sample keys). A remote file's mtime would cost
    a request per read: not asked."""
    mtime = None
    if f.fs.type_name == "local":
        st = os.stat(f.path)
        size, mtime = st.st_size, st.st_mtime_ns
    if f.size and size is not None and size != f.size:
        raise OSError(f"the file is {size} bytes now, {f.size} when the source was opened")
    if mtime is not None and f.mtime >= 0 and mtime != f.mtime:
        raise OSError(f"the file was modified since the source was opened (mtime {mtime} ns, {f.mtime} then)")


class _Files(Sequence):
    """A source's usable files (a :class:`FileTable`) as :class:`_File` records, each made when asked
    for: 100,000 files open without 100,000 objects. The last one made is kept, so the file being
    read is asked for again as the same object."""

    def __init__(self, table: FileTable):
        self.table = table
        self._last: tuple[int, _File | None] = (-1, None)

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        if i < 0:
            i += len(self)
        last = self._last
        if last[0] == i:
            return last[1]
        t = self.table
        fs, shown = t.filesystems[int(t.fs_index[i])], t.shown[i]
        path = shown if fs.type_name == "local" else shown[len(fs.type_name) + 3:]
        f = _File(fs, path, shown, t.size[i], t.groups[i], t.names[i], t.mtime[i])
        self._last = (i, f)
        return f


def _open_meta(fs: pafs.FileSystem, path: str, shown: str) -> tuple[tuple, list[str]]:
    """Row-group sizes and column names from one file's footer; ConfigError naming the file if it is
    not readable Parquet (what is wrong only: the source adds what to do, which depends on its policy)."""
    try:
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            meta = pf.metadata
            return tuple(meta.row_group(rg).num_rows for rg in range(meta.num_row_groups)), list(pf.schema_arrow.names)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{shown}: not a readable Parquet file ({type(e).__name__}: {e})") from e


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


def _converts(column, i: int) -> bool:
    """Whether value ``i`` of ``column`` converts to Python (finds the column a failing row fails in)."""
    try:
        column[i].as_py()
        return True
    except (ValueError, OverflowError, pa.ArrowException):
        return False


# --------------------------------------------------------------------------------------------
# the source
# --------------------------------------------------------------------------------------------

FILES_LISTED = 64   # a state lists at most this many files in its fingerprint; beyond, their count and digest


def _files_fingerprint(files: list, listed: int = FILES_LISTED):
    """What a state says of the file set: ``[[path, bytes, rows], ...]`` for a few files (a mismatch names
    the first different one); for more, ``{"count", "rows", "sha256", "root", "relative_sha256"}`` (see
    :func:`_digest`), so a state of a source of 100,000 files stays small (it is taken for every buffered
    sample and travels with every step)."""
    if len(files) <= listed:
        return [list(x) for x in files]
    paths, sizes, rows = zip(*files)
    return _digest(list(paths), sizes, rows)


def _copy_files(files):
    """A fresh copy of a files fingerprint (a state is the caller's to change; ``copy.deepcopy`` cost
    ~10 us)."""
    return dict(files) if isinstance(files, dict) else [list(x) for x in files]


def _root(paths: Sequence[str]) -> int:
    """Where the file set's common root ends in each of ``paths`` (sorted or not): the length of the
    longest folder prefix they share, up to and including its ``/``; a single file's root is its folder.
    ``path[:cut - 1]`` is the root, ``path[cut:]`` the path relative to it. A URI keeps its scheme in the
    root (``s3://b/k/x.parquet``: root ``s3://b/k``)."""
    if not paths:
        return 0
    prefix = os.path.commonprefix([min(paths), max(paths)])
    return prefix.rfind("/") + 1


def _relative(files: list) -> tuple[str, list[list]]:
    """``(root, [[path relative to root, bytes, rows], ...])`` of a ``[[path, bytes, rows], ...]`` list."""
    cut = _root([f[0] for f in files])
    root = files[0][0][:max(cut - 1, 0)] if files else ""
    return root, [[f[0][cut:], f[1], f[2]] for f in files]


def _digest(paths: list[str], sizes, rows) -> dict:
    """``{"count", "rows", "sha256", "root", "relative_sha256"}`` of a file set: ``sha256`` hashes the
    NUL-joined paths, then the sizes and the row counts as little-endian int64 arrays; ``relative_sha256``
    the same with each path relative to the common ``root`` (:func:`_root`), so a state also loads over
    the same files copied under another root (states of earlier releases have no ``relative_sha256``
    and ``root``: they load over the same paths only)."""
    cut = _root(paths)
    tail = np.asarray(sizes, "<i8").tobytes() + np.asarray(rows, "<i8").tobytes()
    h = hashlib.sha256("\0".join(paths).encode())
    h.update(tail)
    r = hashlib.sha256("\0".join([p[cut:] for p in paths]).encode())
    r.update(tail)
    return {"count": len(paths), "rows": int(np.sum(np.asarray(rows, np.int64))), "sha256": h.hexdigest(),
            "root": paths[0][:max(cut - 1, 0)] if paths else "", "relative_sha256": r.hexdigest()}


def _legacy_digest(files: list) -> dict:
    """The digest states of release 2026-11-23 carried (sha256 of the file list's compact JSON)."""
    blob = json.dumps([list(x) for x in files], separators=(",", ":")).encode()
    return {"count": len(files), "rows": int(sum(x[2] for x in files)), "sha256": hashlib.sha256(blob).hexdigest()}


_DIGEST_KEYS = ("count", "rows", "sha256")      # what every release's digest has


class ParquetSource:
    """One source's Parquet files as an iterator of ``(sample_key, record)``, resumable exactly
    (a :class:`~torchdata_overlord.sources.base.Source`).

    ``paths``: a glob, a file, a directory (its ``*.parquet`` files at any depth; the others are left out
    and logged), a ``pyarrow.fs`` URI (``"file:///d/*.parquet"``, ``"s3://b/k/*.parquet"``) or a list of
    those; with ``filesystem=`` they are paths inside that filesystem. ``transform(row_dict)`` makes the record.
    ``columns`` (or ``transform.columns``) is the projection. ``epochs=None`` cycles forever. ``on_error="skip"`` skips unreadable files,
    files without a projected column and failing samples (the transform fails on the row, or a value of
    it cannot be read: a string that is not valid UTF-8) instead of raising: :attr:`skipped` lists
    them with exact counts, the log says the first at once and then sums them up at most every
    ``skip_log_interval`` seconds (:class:`~torchdata_overlord.sources.skip_log.SkipLog`). A source
    whose every row is skipped raises rather than cycling forever.
    ``iter()`` continues from the current position; use :meth:`load_state_dict` to rewind. When a
    transform raises, or a value cannot be read (on_error="raise"), the position stays on that sample,
    so a state taken then resumes at it. ``metadata_cache``: the folder of the file-metadata journal
    (None: the default folder, False: none; see :mod:`~torchdata_overlord.sources.metadata_cache`);
    :attr:`metadata_reads` counts the files whose footer this opening read. ``file_table`` comes from
    :meth:`spec_args`.
    """

    FORMAT = "Parquet"
    OPEN_THREADS = min(32, 4 * (os.cpu_count() or 1))    # threads reading footers on a non-local filesystem

    UNITS = "row groups"      # what a data-parallel loader actor reads whole (see :meth:`shard`)
    SUFFIXES = (".parquet",)    # the files of a directory it reads (a glob or a file named in full: any)

    def __init__(self, name: str, paths, transform: Callable[[dict], Any] | None = None, columns=None,
                 shuffle: bool = True, seed: int = 0, epochs: int | None = None, on_error: str = "raise",
                 filesystem: pafs.FileSystem | None = None, skip_log_interval: float = 60.0,
                 metadata_cache=None, file_table: FileTable | None = None):
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"source {name!r}: on_error must be 'raise' or 'skip', got {on_error!r}")
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
            raise ConfigError(f"source {name!r}: epochs must be None (forever) or an int >= 1, got {epochs!r}")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"source {name!r}: seed must be an int >= 0, got {seed!r}")
        if not (metadata_cache is None or isinstance(metadata_cache, (bool, str, os.PathLike))):
            raise ConfigError(f"source {name!r}: metadata_cache must be a directory, False (none) or None (the "
                              f"default folder), got {metadata_cache!r}")
        if file_table is not None and not isinstance(file_table, FileTable):
            raise ConfigError(f"source {name!r}: file_table must come from spec_args(), got "
                              f"{type(file_table).__name__}")
        self.name, self.transform, self.on_error = name, transform, on_error
        self.paths, self.filesystem = paths, filesystem       # as given: enough to reopen the source elsewhere
        self.metadata_cache = metadata_cache
        self.shuffle, self.seed, self.epochs = bool(shuffle), int(seed), epochs
        self.columns = _columns(columns, transform)
        self._columns_given = columns is not None        # else the transform's: its field is what to fix
        self.skips = SkipLog(name, skip_log_interval)
        self.skip_log_interval = self.skips.interval
        self.rows_passed = 0  # rows read or skipped so far (a whole-epoch run of skips means nothing is usable)
        self.metadata_reads = 0  # files opened for their metadata (footer, or a text file's parse) by __init__
        # the usable files' metadata (a FileTable)
        self._meta = self._from_table(file_table) if file_table is not None else \
            self._open_all(_resolve(name, paths, filesystem, self.SUFFIXES, type(self).__name__))
        self._files = _Files(self._meta)
        self.files = list(self._meta.shown)
        self._build_units()
        self.reads = 0  # row groups decoded so far (observability: restores must not re-read)
        self._part = (0, 1)  # (j, k): this reader takes units j, j+k, ... of each epoch (see shard())
        self._ahead: dict[int, int] = {}
        self.last_order = -1
        self._moves_logged: set = set()    # (old root, new root) a loaded state's files moved from and to
        self._set_position(0, 0, 0)

    # ---- setup ------------------------------------------------------------------------------

    def _open_file(self, fs: pafs.FileSystem, path: str, shown: str) -> tuple[tuple, list[str]]:
        """One file's row-group sizes and column names (its Parquet footer); ConfigError naming it if
        unreadable, saying what is wrong (not what to do: :meth:`_open_all` adds that under on_error="raise").
        May run on several threads at once (see :meth:`_read_metas`)."""
        return _open_meta(fs, path, shown)

    def _journal_kind(self) -> str:
        """What the metadata means (the journal of one kind is not read as another's)."""
        return "parquet"

    def _read_group(self, f: _File, rg: int) -> pa.Table:
        """Row group ``rg`` of ``f``, projected. The file is open for this read only: a pyarrow reader
        keeps the column chunks it pre-buffered (compressed) until its next read, which would hold
        them beside the decoded row group for as long as the source serves it. Its footer is read
        again, and must still describe the row groups seen when the source was opened, and the file have the
        same size (and on a local disk mtime)."""
        with f.fs.open_input_file(f.path) as raw:
            pf = pq.ParquetFile(raw)
            meta = pf.metadata
            groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
            if groups != tuple(f.groups):
                raise OSError(f"row groups of {list(groups)} rows now, {list(f.groups)} when the source was opened")
            _check_unchanged(f, raw.size())         # (the same row groups: rewritten in place, or not at all)
            table = pf.read_row_group(rg, columns=self.columns)
        if table.nbytes >= _RELEASE_BYTES:
            # decoding grows and frees buffers of about the row group's size; Arrow's allocator keeps
            # the freed pages (a process hosting many sources kept ~3 MiB per 8 MiB row group)
            pa.default_memory_pool().release_unused()
        return table

    def _no_rows(self, nfiles: int) -> ConfigError:
        """The error of a source with no row: its usable files (``nfiles``) are empty, and the others were
        skipped (on_error="skip"): which, why (the first few reasons) and what to do."""
        t, skipped = self._meta, self.skips.entries
        empty = t.shown[0] + (f" and {nfiles - 1} more" if nfiles > 1 else "") if nfiles else ""
        if not skipped:
            return ConfigError(f"source {self.name!r} has no rows ({nfiles} usable file(s)"
                               f"{': ' + empty if empty else ''}, 0 skipped); point it at non-empty "
                               f"{self.FORMAT} files")
        shown = 3
        reasons = "; ".join(f"{e['file']}: {e['error'].rstrip('.')}" for e in skipped[:shown])
        more = f"; and {len(skipped) - shown} more" if len(skipped) > shown else ""
        if not nfiles:
            return ConfigError(f"source {self.name!r} has no rows: all its {len(skipped)} file(s) were skipped "
                               f"(on_error='skip'): {reasons}{more}. Fix these files or remove them from the "
                               f"source's paths")
        return ConfigError(f"source {self.name!r} has no rows: its {nfiles} usable file(s) ({empty}) are empty, "
                           f"and the other {len(skipped)} were skipped (on_error='skip'): {reasons}{more}. Fix the "
                           f"skipped files, or point the source at non-empty {self.FORMAT} files")

    def spec_args(self) -> tuple[Any, Any, dict]:
        """``(paths, transform, kwargs)`` to build this source again in another process: the paths and
        ``filesystem`` as given, and ``file_table``: the files this source opened, with their sizes,
        mtimes, row groups, columns and filesystems (pyarrow filesystems pickle). The source built
        from them lists no directory and reads no footer: the same files in the same order, the same
        fingerprint (a state of another file set is refused there as here)."""
        t = self._meta
        table = FileTable(t.shown, t.size, t.mtime, t.groups, t.names,
                          [[e["file"], e["error"]] for e in self.skips.entries if e["row"] is None],
                          t.filesystems, t.fs_index)
        kwargs = dict(columns=self.columns, shuffle=self.shuffle, seed=self.seed, epochs=self.epochs,
                      on_error=self.on_error, skip_log_interval=self.skip_log_interval, filesystem=self.filesystem,
                      metadata_cache=self.metadata_cache, file_table=table)
        return self.paths, self.transform, kwargs

    def _from_table(self, table: FileTable) -> FileTable:
        """A :class:`FileTable` from :meth:`spec_args`, checked, opening no file (the files it skipped at
        open are counted as skipped here too)."""
        n = len(table)
        cols = (table.size, table.mtime, table.groups, table.names)
        if table.fs_index is None or any(len(c) != n for c in (*cols, table.fs_index)) or \
                (n and not 0 <= int(np.max(table.fs_index)) < len(table.filesystems)):
            raise ConfigError(f"source {self.name!r}: file_table is incomplete (no filesystems, or columns of "
                              f"different lengths); pass the one spec_args() made")
        for file, error in table.skipped:
            self.skips.add(file, None, error, 0)
        return table

    def _open_all(self, listing: _Listing) -> FileTable:
        """Every file's row groups and columns, now, so bad files and missing columns fail before
        iteration: from the journal (:mod:`.metadata_cache`) where a file's size and mtime are those it
        recorded, else from the file itself (:meth:`_open_file`); the journal is then brought up to date.
        The usable files, in order."""
        n, shown = len(listing.shown), listing.shown
        kind, directory = self._journal_kind(), cache_dir(self.metadata_cache)
        journal = None if directory is None else journal_path(directory, kind, shown)
        pointer = None if directory is None else pointer_path(directory, kind, listing.entries)
        old = None if journal is None else load_journal(journal, kind, pointer)
        size, mtime = np.asarray(listing.size, np.int64), np.asarray(listing.mtime, np.int64)
        groups: list = [None] * n
        names: list = [None] * n
        if old is not None and old.shown == shown:
            at = np.arange(n)
        elif old is not None:
            pos = {f: i for i, f in enumerate(old.shown)}
            at = np.fromiter((pos.get(f, -1) for f in shown), np.int64, n)
        else:
            at = np.full(n, -1, np.int64)
        found = at >= 0
        j = np.where(found, at, 0)
        hit = found & (mtime >= 0)
        if old is not None and len(old):         # an empty journal (older releases wrote them) has nothing to index
            hit &= (np.asarray(old.size, np.int64)[j] == size) & (np.asarray(old.mtime, np.int64)[j] == mtime)
        if old is not None and hit.all() and old.shown == shown:
            groups, names = old.groups, old.names              # the usual case: nothing changed
        else:
            for i in np.flatnonzero(hit).tolist():
                groups[i], names[i] = old.groups[at[i]], old.names[at[i]]
        todo = np.flatnonzero(~hit).tolist()
        errors: dict[int, ConfigError] = {}
        schemas: dict[tuple, list] = {}                         # one names list per schema read
        for i, got in zip(todo, self._read_metas(listing, todo)):
            if isinstance(got, ConfigError):
                errors[i] = got
            elif got is not None:
                groups[i], names[i] = tuple(got[0]), schemas.setdefault(tuple(got[1]), list(got[1]))
        self.metadata_reads = sum(groups[i] is not None for i in todo) + len(errors)
        ok = [i for i in range(n) if groups[i] is not None]
        table = FileTable(shown, listing.size, listing.mtime, groups, names, (), listing.filesystems, listing.fs_index)
        keep = [i for i in ok if mtime[i] >= 0]
        # something new, or another file set; never an empty journal (nothing to remember: keep the previous one)
        if journal is not None and keep and (any(groups[i] is not None and mtime[i] >= 0 for i in todo)
                                             or old is None or len(old.shown) != len(keep)
                                             or old.shown != [shown[i] for i in keep]):
            save_journal(journal, kind, table.take(keep), pointer)
        # errors and files without a projected column, in file order
        missing_of: dict[int, list] = {}
        for nm in {id(x): x for x in names if x is not None}.values():
            missing_of[id(nm)] = [c for c in self.columns or () if c not in nm]
        # a file with neither rows nor columns (an empty JSON Lines/CSV file) lacks no column: it is just empty
        bad = sorted([*errors, *(i for i in ok if missing_of[id(names[i])] and (names[i] or any(groups[i])))])
        for i in bad:
            if i in errors:
                if self.on_error == "raise":
                    raise ConfigError(f"source {self.name!r}: {errors[i]}; fix or remove it, or pass "
                                      f"on_error='skip' to skip such files") from errors[i].__cause__
                self._skip(shown[i], None, errors[i], 0)
                continue
            missing = missing_of[id(names[i])]
            err = ConfigError(f"source {self.name!r}: {shown[i]} has no column(s) {missing}; available columns: "
                              f"{names[i]}. {self._columns_fix(missing)}")
            if self.on_error == "raise":
                raise err
            self._skip(shown[i], None, err, 0)
        if len(ok) == n and not bad:
            return table
        drop = set(bad)
        return table.take([i for i in ok if i not in drop])

    def _read_metas(self, listing: _Listing, todo: list[int]) -> list:
        """:meth:`_open_file` of the files at ``todo``, in order: ``(groups, names)`` or the ConfigError it
        raised (None: not read). Files on a local filesystem are read one after another (a footer read
        there costs the GIL-bound Python around it, so threads do not help), stopping at the first
        error under on_error="raise"; files on other filesystems (object stores: a round trip per file)
        on a pool of up to :attr:`OPEN_THREADS` threads."""
        def one(i):
            fs, shown = listing.filesystems[listing.fs_index[i]], listing.shown[i]
            path = shown if fs.type_name == "local" else shown[len(fs.type_name) + 3:]
            try:
                return self._open_file(fs, path, shown)
            except ConfigError as e:
                return e

        remote = [i for i in todo if listing.filesystems[listing.fs_index[i]].type_name != "local"]
        got = {}
        if len(remote) > 1:
            with ThreadPoolExecutor(min(self.OPEN_THREADS, len(remote)), thread_name_prefix="overlord-open") as pool:
                got = dict(zip(remote, pool.map(one, remote)))
        out: list = [None] * len(todo)
        for k, i in enumerate(todo):
            out[k] = got[i] if i in got else one(i)
            if isinstance(out[k], ConfigError) and self.on_error == "raise":
                break
        return out

    def _columns_fix(self, missing: list[str]) -> str:
        """What to change when a file lacks a projected column: ``columns=`` if it was given, else the
        transform's field argument (``columns`` came from the transform); under on_error="raise", or
        on_error='skip' to skip such files (under "skip" it is skipped already)."""
        skip = ", or pass on_error='skip' to skip such files." if self.on_error == "raise" else "."
        if self._columns_given:
            return f"Fix `columns=`{skip}"
        return (f"The transform {self.transform!r} reads {missing}: point its field argument (e.g. "
                f"Tokenize(field=...)) at one of the available columns{skip}")

    def _build_units(self) -> None:
        """Flatten (file, row group) into unit arrays; file offsets make the dense sample keys."""
        t = self._meta
        nfiles = len(t)
        ngroups = np.fromiter(map(len, t.groups), np.int64, nfiles)
        rows = np.fromiter(itertools.chain.from_iterable(t.groups), np.int64, int(ngroups.sum()))
        file_of = np.repeat(np.arange(nfiles, dtype=np.int64), ngroups)
        file_rows = np.zeros(nfiles, np.int64)
        np.add.at(file_rows, file_of, rows)
        file_offset = np.cumsum(file_rows) - file_rows                 # rows in all earlier files
        keep = rows > 0
        self._ufile, self._urows = file_of[keep], rows[keep]
        self._urg = (np.arange(len(rows), dtype=np.int64) - (np.cumsum(ngroups) - ngroups)[file_of])[keep]
        self._uoffset = file_offset[file_of][keep]       # key = offset of the file + row within the file
        self._ufirst = (np.cumsum(rows) - rows - file_offset[file_of])[keep]     # row in the file
        offset = int(file_rows.sum())
        if offset == 0:
            raise self._no_rows(nfiles)
        self.num_rows = offset  # rows per epoch
        self._fingerprint = {"name": self.name, "seed": self.seed, "shuffle": self.shuffle, "columns": self.columns}
        self._file_rows = file_rows
        self._state_files = _files_fingerprint(self._file_list()) if nfiles <= FILES_LISTED else \
            _digest(t.shown, t.size, file_rows)

    def _file_list(self) -> list[list]:
        """``[[path, bytes, rows], ...]`` of the usable files (built when asked: 100,000 small lists cost)."""
        t = self._meta
        return [[f, z, r] for f, z, r in zip(t.shown, t.size, self._file_rows.tolist())]

    # ---- position ---------------------------------------------------------------------------

    def shard(self, index: int, count: int) -> None:
        """Read only units ``index, index + count, ...`` of each epoch's order (a data-parallel part).
        More parts than units is refused: a part without a unit would search every epoch for a row forever."""
        if not (isinstance(count, int) and isinstance(index, int) and 0 <= index < count):
            raise ConfigError(f"source {self.name!r}: shard({index!r}, {count!r}) needs 0 <= index < count")
        if count > self.units:
            raise ConfigError(f"source {self.name!r} has {self.units} {self.UNITS} with rows, the units loader actors split "
                              f"it by: it cannot be split over {count} loader actors; give it at most {self.units} "
                              f"(a Placement's SourcePlacement.actors)")
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
        return self.state_at(self.position())

    def position(self) -> tuple:
        """The exact position as a small tuple of ints: what :meth:`state_dict` holds besides the
        fingerprint. A Source Loader keeps one per buffered row (a state, with its copy of the files
        fingerprint, cost ~5 us and a dozen containers for the garbage collector to track) and turns
        the one it checkpoints into a state with :meth:`state_at`."""
        return self.epoch, self._unit, self._row, tuple(sorted(self._ahead.items())) if self._ahead else ()

    def state_at(self, position: tuple) -> dict:
        """The :meth:`state_dict` of a :meth:`position` this source was at."""
        epoch, unit, row, ahead = position
        fp = self._fingerprint
        return {"epoch": epoch, "unit": unit, "row": row, "units": len(self._urows),
                "ahead": [[g, r] for g, r in ahead],
                "fingerprint": {**fp, "columns": None if fp["columns"] is None else list(fp["columns"]),
                                "files": _copy_files(self._state_files)}}

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

    def check_state(self, state: dict) -> None:
        """Refuse (ConfigError naming the difference) a state of another source configuration (name,
        seed, shuffle, columns, files) without moving: what a resume checks before any role loads it."""
        fp = state.get("fingerprint") if isinstance(state, dict) else None
        if fp is None:
            raise ConfigError(f"source {self.name!r}: not {a_type(self)} state (no fingerprint): "
                              f"{state!r:.200}")
        self._check_fingerprint(fp)

    def _check_fingerprint(self, fp) -> None:
        """Refuse (ConfigError naming the difference) a state of another configuration or file set. The same
        files under another root (copied to another folder, mount point or bucket prefix: the same paths
        relative to the file set's common root, sizes and row counts, in the same order) are the same file
        set: the sample keys, the order and the positions depend on those only, so the stream continues
        exactly; that is logged (INFO) once per move."""
        mine = self._fingerprint
        if not isinstance(fp, dict):
            raise ConfigError(f"source {self.name!r}: state fingerprint must be a dict, got {fp!r:.100}")
        for k in ("name", "seed", "shuffle", "columns"):
            if fp.get(k) != mine[k]:
                raise ConfigError(f"source {self.name!r}: state was taken with {k}={fp.get(k)!r}, this source "
                                  f"has {k}={mine[k]!r}; restore with the same configuration")
        theirs = fp.get("files")
        if theirs == self._state_files:      # the usual case
            return
        files = self._file_list()
        if theirs == files:
            return
        if isinstance(theirs, dict) or isinstance(self._state_files, dict):
            theirs = theirs if isinstance(theirs, dict) else _files_fingerprint(theirs or [], listed=0)
            ours = _files_fingerprint(files, listed=0)
            if all(theirs.get(k) == ours[k] for k in _DIGEST_KEYS) or theirs == _legacy_digest(files):
                return
            if theirs.get("relative_sha256") == ours["relative_sha256"] and \
                    all(theirs.get(k) == ours[k] for k in ("count", "rows")):
                return self._moved(theirs.get("root"), ours["root"], ours["count"])
            if "relative_sha256" in theirs:
                was = f" under {theirs.get('root')}, relative sha256 {str(theirs['relative_sha256'])[:12]}"
                now = f" under {ours['root']}, relative sha256 {ours['relative_sha256'][:12]}"
                over, old = "[path relative to the root, bytes, rows]", ""
            else:
                was, now = f", sha256 {str(theirs.get('sha256'))[:12]}", f", sha256 {ours['sha256'][:12]}"
                over, old = "[path, bytes, rows]", (" (a state of an earlier release records its files by absolute "
                                                     "path only: it loads over them at those paths, not over a copy)")
            raise ConfigError(f"source {self.name!r}: file set differs from the state's ({theirs.get('count')} "
                              f"files of {theirs.get('rows')} rows{was}; now {ours['count']} files of "
                              f"{ours['rows']} rows{now}, over {over} of every file){old}. Restore over the same "
                              f"files (the same files copied under another root are the same).")
        theirs = [list(x) for x in theirs or []]
        if not all(len(x) == 3 and isinstance(x[0], str) for x in theirs):
            raise ConfigError(f"source {self.name!r}: the state's file list must hold [path, bytes, rows] per file, "
                              f"got {theirs!r:.200}")
        their_root, their_rel = _relative(theirs)
        our_root, our_rel = _relative(files)
        if theirs and their_rel == our_rel:
            return self._moved(their_root, our_root, len(files))
        i = next((i for i, (a, b) in enumerate(zip(their_rel, our_rel)) if a != b), min(len(theirs), len(files)))
        same_root = their_root == our_root
        a = (theirs if same_root else their_rel)[i] if i < len(theirs) else "nothing"
        b = (files if same_root else our_rel)[i] if i < len(files) else "nothing"
        what = "[path, bytes, rows]" if same_root else \
            (f"[path relative to the root, bytes, rows]; the state's files are under {their_root}, these under "
             f"{our_root}")
        raise ConfigError(f"source {self.name!r}: file list differs from the state's ({len(theirs)} vs "
                          f"{len(files)} files); first difference at #{i}: state has {a}, now {b} ({what}). "
                          f"Restore over the same files (the same files copied under another root are the same)."
                          + self._left_out_at_open([x[0] for x in theirs]))

    def _left_out_at_open(self, paths: list[str]) -> str:
        """Why a state's file list no longer matches, when files of ``paths`` were skipped at opening
        (``on_error="skip"``: unreadable now, or lacking a column): a sentence naming the first, or ""."""
        gone = {x["file"]: x["error"] for x in self.skips.entries if x["row"] is None}
        hit = [p for p in paths if p in gone]
        if not hit:
            return ""
        return (f" {len(hit)} of the state's files {'was' if len(hit) == 1 else 'were'} left out at opening under "
                f"on_error='skip', e.g. {hit[0]}: {gone[hit[0]]}; a state resumes only over the files it was "
                f"taken over: restore that file, or start this source without the state.")

    def _moved(self, old: str | None, new: str, count: int) -> None:
        """Log (once per source and move) that a state taken over files under ``old`` loads over ``new``."""
        if (old, new) in self._moves_logged:
            return
        self._moves_logged.add((old, new))
        log.info("source %r: the state's %d files moved from %s to %s (the same paths relative to that root, sizes "
                 "and row counts, in the same order): resuming over them", self.name, count, old, new)

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
            out = self._sample(u)
            if out is not None:
                return out
            self.check_progress(since)      # the row's values could not be converted: skipped (on_error="skip")

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
            f, r, key, _ = where
            if self.on_error == "raise":
                raise SourceReadError(f"source {self.name!r}: transform failed on {f} row {r} (key {key}): "
                                      f"{type(e).__name__}: {e}. Fix the transform or pass "
                                      f"on_error='skip'.") from e
            self.skip_sample(where, e)
            return SKIPPED

    def skip_sample(self, where: tuple[str, int, int, int], error: BaseException) -> None:
        """Count and log the row at ``where`` as skipped for ``error`` (on_error="skip"), as :meth:`apply` does
        when the transform fails on it. A Source Loader skips this way a row whose sample it cannot use (its
        text holds the image placeholder)."""
        f, r, _, epoch = where
        self._skip(f, r, error, epoch)

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

    def _sample(self, u: int) -> tuple[int, dict, tuple[str, int, int, int]] | None:
        """The raw row at the current position, advancing past it. Converted to Python value by value
        (as ``Table.to_pylist`` does), with no Arrow allocation: a ``take`` of the next rows allocated in
        every reading thread, and pyarrow's allocator gives each such thread pages of its own (~3 MiB
        per Source Loader thread in a process hosting many).

        A value that does not convert (a string that is not valid UTF-8: pyarrow's JSON reader and Parquet
        files accept such bytes, ``as_py`` fails on them) is a failing row: under ``on_error="skip"`` it is
        skipped and counted as a row the transform fails on (then None: the caller reads on), under "raise"
        a :class:`SourceReadError` names the file, row and column, the position staying on that row."""
        i = int(self._perm[self._row])                    # row index within the row group
        r = int(self._ufirst[u]) + i                      # row index within the file
        try:
            row = {name: column[i].as_py() for name, column in self._columns_held}
        except (ValueError, OverflowError, pa.ArrowException) as e:     # UnicodeDecodeError is a ValueError
            return self._unconvertible(u, i, r, e)
        key = int(self._uoffset[u]) + r
        self.last_order = ((self.epoch * len(self._urows) + self._unit) << 32) | self._row
        self._row += 1
        self.rows_passed += 1
        return self.epoch * self.num_rows + key, row, (self._files[int(self._ufile[u])].shown, r, key, self.epoch)

    def _unconvertible(self, u: int, i: int, r: int, e: BaseException) -> None:
        """Row ``r`` of its file (``i`` of unit ``u``'s row group) holds a value ``as_py`` fails on: raise, or
        skip it (see :meth:`_sample`)."""
        column = next((name for name, col in self._columns_held if not _converts(col, i)), None)
        shown, key = self._files[int(self._ufile[u])].shown, int(self._uoffset[u]) + r
        what = f"column {column!r}" if column is not None else "a column"
        why = f"{what} holds a value that cannot be read ({type(e).__name__}: {e})"
        if isinstance(e, UnicodeDecodeError):
            why = f"{what} holds a string that is not valid UTF-8 ({type(e).__name__}: {e})"
        if self.on_error == "raise":
            raise SourceReadError(f"source {self.name!r}: reading {shown} row {r} (key {key}) failed: {why}. Fix "
                                  f"that row in the file, or pass on_error='skip' to skip such rows.") from e
        self._skip(shown, r, ValueError(why), self.epoch)
        self._row += 1
        self.rows_passed += 1
        return None

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
