"""The file-metadata journal: what opening a source learnt about each file, kept between runs.

Opening a :class:`~torchdata_overlord.ParquetSource` reads every file's footer (a
:class:`~torchdata_overlord.FileSource` parses every file) for its row-group sizes and columns. The
journal keeps those per file set, keyed by ``(shown path, size, mtime_ns)``: the next opening reads
only the files whose size or mtime changed (or that it has not seen). The same compact table
(:class:`FileTable`) carries a source's files to another process in ``spec_args()``, so a source
rebuilt there neither lists a directory nor opens a file until it reads one.

Where: a source's ``metadata_cache=`` (a directory; False: no journal); by default the
``metadata`` folder of ``$TORCHDATA_OVERLORD_CACHE``, else of ``$XDG_CACHE_HOME/torchdata_overlord``,
else of ``~/.cache/torchdata_overlord``. One JSON file per file set, named by a hash of the reader
kind and the sorted shown paths, replaced atomically (temporary file + ``os.replace``); beside it,
per source path entries (a glob, a folder: what ``paths`` resolved to), the name of the journal last
written for them, so a folder that gained or lost files starts from its previous journal (which the
new one then replaces). A journal that cannot be read or parsed is ignored and rewritten; a
directory that cannot be written means no journal (logged once, at debug level). An opening that
found no usable file (every one unreadable) writes no journal: there is nothing to remember.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["FileTable", "cache_dir", "journal_path", "pointer_path", "load_journal", "save_journal"]

log = logging.getLogger("torchdata_overlord")

VERSION = 1
_warned: set[str] = set()          # directories already reported as unwritable (log once)


def _prefix(strings: Sequence[str]) -> str:
    """The longest common prefix of ``strings``, cut after its last ``/`` (paths share folders)."""
    if not strings:
        return ""
    p = os.path.commonprefix([min(strings), max(strings)])
    return p[:p.rfind("/") + 1]


_INTS = ("size", "mtime", "ngroups", "groups", "schema")


class FileTable:
    """Per-file metadata of a source's files, column by column, in file order: ``shown`` (paths as
    the source shows them), ``size`` (bytes), ``mtime`` (ns; -1: unknown), ``groups`` (a tuple per
    file: the rows of each row group) and ``names`` (column names: one list per schema, shared by
    its files). ``skipped``: ``[shown, error]`` of files skipped when the source was opened;
    ``filesystems``/``fs_index``: each file's pyarrow filesystem. Stored and pickled column-wise
    (paths as one prefix and their tails, each schema once): 100,000 files take a few MB."""

    def __init__(self, shown: list[str], size: list[int], mtime: list[int], groups: list[tuple], names: list[list],
                 skipped=(), filesystems=(), fs_index=None):
        self.shown, self.size, self.mtime, self.groups, self.names = shown, size, mtime, groups, names
        self.skipped = [list(x) for x in skipped]
        self.filesystems = list(filesystems)
        self.fs_index = fs_index
        self._packed: dict | None = None     # the pickled column-wise form (the columns never change)

    def __len__(self) -> int:
        return len(self.shown)

    def take(self, keep: Sequence[int]) -> "FileTable":
        """The files at positions ``keep`` (the same skips and filesystems)."""
        def pick(col):
            return [col[i] for i in keep]
        fs_index = None if self.fs_index is None else np.asarray(self.fs_index)[list(keep)]
        return FileTable(pick(self.shown), pick(self.size), pick(self.mtime), pick(self.groups), pick(self.names),
                         self.skipped, self.filesystems, fs_index)

    # ---- column-wise form (the JSON journal and pickles) ------------------------------------

    def columns(self) -> dict:
        """The table as plain columns (JSON-able lists; each schema once)."""
        prefix = _prefix(self.shown)
        cut = len(prefix)
        ids = list(map(id, self.names))                   # files of one schema share its names list
        first = dict(zip(ids, self.names))
        index: dict[int, int] = {}
        schemas: dict[tuple, int] = {}
        for k, n in first.items():
            index[k] = schemas.setdefault(tuple(n), len(schemas))
        return {"version": VERSION, "prefix": prefix, "tails": [s[cut:] for s in self.shown], "size": self.size,
                "mtime": self.mtime, "ngroups": list(map(len, self.groups)),
                "groups": list(itertools.chain.from_iterable(self.groups)), "schema": list(map(index.__getitem__, ids)),
                "schemas": [list(k) for k in schemas], "skipped": self.skipped}

    @classmethod
    def from_columns(cls, c: dict) -> "FileTable":
        """The table :meth:`columns` describes; ValueError/KeyError/TypeError if it is malformed."""
        if c.get("version") != VERSION:
            raise ValueError(f"journal version {c.get('version')!r}, expected {VERSION}")
        prefix, tails, schemas = c["prefix"], c["tails"], c["schemas"]
        n = len(tails)
        cols = {k: np.asarray(c[k], np.int64) for k in _INTS}
        if not isinstance(prefix, str) or not set(map(type, tails)) <= {str}:
            raise TypeError("paths must be strings")
        if not all(isinstance(s, list) and all(isinstance(x, str) for x in s) for s in schemas):
            raise TypeError("schemas must be lists of column names")
        ngroups, schema = cols["ngroups"], cols["schema"]
        if any(len(cols[k]) != n for k in ("size", "mtime", "ngroups", "schema")) or \
                int(ngroups.sum()) != len(cols["groups"]):
            raise ValueError("columns of different lengths")
        if n and (ngroups.min() < 0 or schema.min() < 0 or schema.max() >= len(schemas)) or \
                (len(cols["groups"]) and cols["groups"].min() < 0):
            raise ValueError("a negative count or a schema index out of range")
        flat = cols["groups"].tolist()
        if n and ngroups.min() == ngroups.max() == 1:      # one row group a file (small files): a C loop
            groups = list(zip(flat))
        else:
            it = iter(flat)
            groups = [tuple(itertools.islice(it, k)) for k in ngroups.tolist()]
        shown = [prefix + t for t in tails] if prefix else list(tails)
        return cls(shown, cols["size"].tolist(), cols["mtime"].tolist(), groups, [schemas[k] for k in schema.tolist()],
                   [[str(f), str(e)] for f, e in c.get("skipped", [])])

    def __reduce__(self):
        if self._packed is None:          # computed once: a job pickles its sources' tables as it starts roles
            c = self.columns()
            self._packed = {**c, "tails": "\0".join(c["tails"]), "count": len(c["tails"]),
                            **{k: _small(np.asarray(c[k], np.int64)) for k in _INTS}}
        fs_index = None if self.fs_index is None else np.asarray(self.fs_index, np.int32)
        return _unpack, (self._packed, self.filesystems, fs_index)


def _small(a: np.ndarray) -> np.ndarray:
    """``a`` in the narrowest signed integer type that holds it (a pickle's bytes)."""
    for t in (np.int8, np.int16, np.int32):
        if not len(a) or (np.iinfo(t).min <= a.min() and a.max() <= np.iinfo(t).max):
            return a.astype(t)
    return a


def _unpack(packed: dict, filesystems: list, fs_index) -> FileTable:
    c = {**packed, "tails": packed["tails"].split("\0") if packed["count"] else []}     # int columns: arrays
    table = FileTable.from_columns(c)
    table.filesystems, table.fs_index = list(filesystems), fs_index
    return table


# ---- where the journal lives ---------------------------------------------------------------

def cache_dir(setting) -> str | None:
    """The journal folder for a source's ``metadata_cache=`` setting: None/True: the default, False:
    none, else the folder given."""
    if setting is False:
        return None
    if setting is None or setting is True:
        env = os.environ.get("TORCHDATA_OVERLORD_CACHE")
        if env:
            base = Path(env).expanduser()
        else:
            base = Path(os.environ.get("XDG_CACHE_HOME") or Path("~").expanduser() / ".cache") / "torchdata_overlord"
        return str(base / "metadata")
    return os.fspath(Path(setting).expanduser())


def journal_path(directory: str, kind: str, shown: Sequence[str]) -> str:
    """The journal of this reader kind and file set (sorted shown paths) in ``directory``."""
    return os.path.join(directory, f"{_digest(kind, shown)}.json")


def pointer_path(directory: str, kind: str, entries: Sequence[str]) -> str:
    """Where the name of the journal last written for these path entries (globs, folders, files as
    resolved) is kept: a file set that grew or shrank starts from it instead of from nothing."""
    return os.path.join(directory, f"{_digest(kind, entries)}.last")


def _digest(kind: str, strings: Sequence[str]) -> str:
    data = kind.encode() + b"\0" + "\0".join(strings).encode("utf-8", "surrogateescape")
    return hashlib.sha256(data).hexdigest()[:32]


def _read(path: str, kind: str) -> FileTable | None:
    try:
        with open(path, "rb") as f:
            c = json.loads(f.read())
        if c.get("kind") != kind:
            return None
        return FileTable.from_columns(c)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - any damage: ignore the journal, it is rewritten
        log.debug("file-metadata journal %s ignored (%s: %s)", path, type(e).__name__, e)
        return None


def load_journal(path: str, kind: str, pointer: str | None = None) -> FileTable | None:
    """The table stored at ``path`` for reader ``kind``, else the one ``pointer`` names (the journal
    last written for the same path entries); None if absent, unreadable or malformed."""
    table = _read(path, kind)
    if table is None and pointer is not None:
        last = _last(pointer)
        if last is not None and last != os.path.basename(path):
            table = _read(os.path.join(os.path.dirname(pointer), last), kind)
    return table


def _last(pointer: str) -> str | None:
    try:
        with open(pointer) as f:
            name = f.read().strip()
        return name if name.endswith(".json") and os.sep not in name else None
    except OSError:
        return None


def save_journal(path: str, kind: str, table: FileTable, pointer: str | None = None) -> bool:
    """Write ``table`` to ``path`` atomically and make ``pointer`` name it (removing the journal it
    named before: a file set these entries no longer resolve to). False (logged once per folder, at
    debug level) if the folder cannot be written."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        _write(path, json.dumps({"kind": kind, **table.columns()}, separators=(",", ":")).encode())
        if pointer is not None:
            before = _last(pointer)
            _write(pointer, os.path.basename(path).encode())
            if before is not None and before != os.path.basename(path):
                try:
                    os.unlink(os.path.join(directory, before))
                except OSError:
                    pass
        return True
    except OSError as e:
        if directory not in _warned:
            _warned.add(directory)
            log.debug("file-metadata journal not written in %s (%s: %s); sources open without it",
                      directory, type(e).__name__, e)
        return False


def _write(path: str, data: bytes) -> None:
    """``data`` to ``path`` through a temporary file and ``os.replace`` (readers never see a part)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".journal-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
