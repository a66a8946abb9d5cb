"""Versioned, checksummed checkpoint store for the fault-tolerance layer.

The Planner and Data Constructor checkpoint their state every step and Source Loaders snapshot
their read positions; after a crash a restarted role resumes from the newest snapshot that is
intact. Three properties make that safe:

* atomic writes: a version is written to ``.tmp-<uuid>`` in its directory, flushed, fsynced and
  renamed into place, so a reader never sees a half-written ``step-*.ckpt``;
* checksums: each file starts with the sha256 of its payload, so a torn or corrupted snapshot is
  detected on read and :meth:`CheckpointStore.latest` falls back to the previous version;
* versions + gc: one file per (key, step), and :meth:`CheckpointStore.gc` keeps the newest few
  (never those a consumer may still need, see ``keep_from``) and sweeps temporaries left by crashes.

The root is a local path or any ``pyarrow.fs`` URI (``file://``, ``s3://``...). The store pickles
as just ``(root, keep)`` so it can be handed to other processes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import uuid
from urllib.parse import quote

import pyarrow.fs as pafs

from ..errors import ConfigError, OverlordError

__all__ = ["CheckpointStore", "CorruptCheckpoint"]

log = logging.getLogger("torchdata_overlord")

_STEP_RE = re.compile(r"^step-(\d+)\.ckpt$")
_TMP_PREFIX = ".tmp-"
_DIGEST_LEN = 64                      # sha256 hex digest
_HEX = frozenset("0123456789abcdef")


class CorruptCheckpoint(OverlordError, RuntimeError):
    """A checkpoint file exists but does not verify (bad checksum, truncated, no header, bad JSON)."""


def _check_step(step, name: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {step!r}")
    return step


def _key_dir(key) -> str:
    """The relative directory of ``key``: "/" nests, everything unsafe (":", spaces...) is %-escaped.

    The mapping is deterministic and injective, so a key always lands in the same directory and two
    keys never share one ("a:b" -> "a%3Ab", "a_b" -> "a_b").
    """
    if not isinstance(key, str) or not key:
        raise ConfigError(f"key must be a non-empty str, got {key!r}")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"key {key!r} has an empty, '.' or '..' path segment; use e.g. 'loader/web'")
    return quote(key, safe="/")


def _decode(data: bytes, path: str):
    """Verify ``<sha256 hex>\\n<payload>`` and return the parsed payload, else raise CorruptCheckpoint."""
    def bad(what: str):
        return CorruptCheckpoint(f"checkpoint {path} is corrupt: {what}; delete it, or call latest() "
                                 "to fall back to the previous version")
    if not data:
        raise bad("the file is empty (truncated)")
    header, sep, payload = data.partition(b"\n")
    try:
        digest = header.decode("ascii")
    except UnicodeDecodeError:
        digest = None
    hex_prefix = digest is not None and set(digest) <= _HEX
    if not sep and hex_prefix and len(digest) <= _DIGEST_LEN:
        raise bad(f"truncated: the file ends inside its header ({len(data)} bytes, no payload)")
    if not hex_prefix or len(digest) != _DIGEST_LEN:
        raise bad("missing header: the first line is not a sha256 hex digest")
    actual = hashlib.sha256(payload).hexdigest()
    if actual != digest:
        raise bad(f"bad checksum (header {digest[:12]}..., payload {actual[:12]}..., "
                  f"{len(payload)} payload bytes): the file is truncated or was overwritten")
    try:
        return json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"bad JSON payload ({e})") from e


class CheckpointStore:
    """Versioned JSON checkpoints under ``<root>/<key>/step-<012d step>.ckpt``.

    ``root``: a local path or a ``pyarrow.fs`` URI; ``keep``: how many newest versions per key
    :meth:`gc` keeps by default (keep >= 2 so a corrupt newest version still has a fallback).
    ``corrupt_skipped`` counts the corrupt versions :meth:`latest` skipped in this process.
    """

    def __init__(self, root: str, keep: int = 8):
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise ConfigError(f"root must be a non-empty path or pyarrow.fs URI, got {root!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1 (versions kept per key by gc), got {keep!r}")
        root = str(root)
        self.root = root if "://" in root else os.path.abspath(root)
        self.keep = keep
        self.corrupt_skipped = 0
        self._fs = None
        fs, base = self._resolve()
        fs.create_dir(base, recursive=True)

    # --- pickling: only (root, keep) travel; the filesystem is re-created lazily -------------------

    def __getstate__(self):
        return {"root": self.root, "keep": self.keep}

    def __setstate__(self, state):
        self.root = state["root"]
        self.keep = state["keep"]
        self.corrupt_skipped = 0
        self._fs = None

    def __repr__(self):
        return f"CheckpointStore(root={self.root!r}, keep={self.keep})"

    def _resolve(self) -> tuple[pafs.FileSystem, str]:
        """``(filesystem, base path)`` for ``root``, created on first use (also after unpickling)."""
        if self._fs is None:
            if "://" in self.root:
                fs, base = pafs.FileSystem.from_uri(self.root)
            else:
                fs, base = pafs.LocalFileSystem(), self.root
            self._fs = (fs, base.rstrip("/") or "/")
        return self._fs

    def _dir(self, key: str) -> str:
        fs, base = self._resolve()
        return f"{base.rstrip('/')}/{_key_dir(key)}"

    def path(self, key: str, step: int) -> str:
        """The filesystem path (for the resolved filesystem) of version ``step`` of ``key``."""
        return f"{self._dir(key)}/step-{_check_step(step):012d}.ckpt"

    def _listing(self, key: str) -> list[pafs.FileInfo]:
        fs, _ = self._resolve()
        sel = pafs.FileSelector(self._dir(key), allow_not_found=True, recursive=False)
        return [i for i in fs.get_file_info(sel) if i.type == pafs.FileType.File]

    # --- write ---------------------------------------------------------------------------------------

    def put(self, key: str, step: int, obj) -> str:
        """Write version ``step`` of ``key`` atomically and return its path.

        ``obj`` must be JSON-serialisable (dict keys become strings). The file appears under its final
        name only once fully written and fsynced, so a crash leaves either the old state or the new.
        """
        dest = self.path(key, step)
        try:
            payload = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise ConfigError(f"obj for checkpoint {key!r} step {step} is not JSON-serialisable ({e}); "
                              "pass dicts/lists/ints/floats/strs/bools/None") from e
        data = hashlib.sha256(payload).hexdigest().encode("ascii") + b"\n" + payload
        fs, _ = self._resolve()
        directory = self._dir(key)
        tmp = f"{directory}/{_TMP_PREFIX}{uuid.uuid4().hex}"
        if isinstance(fs, pafs.LocalFileSystem):
            os.makedirs(directory, exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, dest)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
            dfd = os.open(directory, os.O_RDONLY)    # make the rename itself durable
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        else:
            fs.create_dir(directory, recursive=True)
            with fs.open_output_stream(tmp) as f:
                f.write(data)
                f.flush()
            fs.move(tmp, dest)
        return dest

    # --- read ----------------------------------------------------------------------------------------

    def steps(self, key: str) -> list[int]:
        """The versions of ``key`` present, ascending (temporaries from interrupted writes ignored)."""
        out = []
        for info in self._listing(key):
            m = _STEP_RE.match(info.base_name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def get(self, key: str, step: int):
        """Read and verify version ``step`` of ``key``.

        Raises ``FileNotFoundError`` (with the path and the steps present) when absent, and
        :class:`CorruptCheckpoint` naming the file and the defect when it does not verify.
        """
        fs, _ = self._resolve()
        path = self.path(key, step)
        if fs.get_file_info(path).type != pafs.FileType.File:
            raise FileNotFoundError(f"no checkpoint {key!r} step {step}: {path} does not exist "
                                    f"(steps present: {self.steps(key)})")
        with fs.open_input_stream(path) as f:
            data = f.read()
        return _decode(data, path)

    def latest(self, key: str, at_most: int | None = None) -> tuple[int, object] | None:
        """``(step, obj)`` of the newest version with ``step <= at_most`` that verifies, else None.

        Corrupt versions are skipped with a warning and counted in ``corrupt_skipped``.
        """
        if at_most is not None:
            _check_step(at_most, "at_most")
        for step in reversed(self.steps(key)):
            if at_most is not None and step > at_most:
                continue
            try:
                return step, self.get(key, step)
            except CorruptCheckpoint as e:
                self.corrupt_skipped += 1
                log.warning("skipping corrupt checkpoint, falling back to an older version: %s", e)
            except FileNotFoundError:         # removed by a concurrent gc since the listing
                continue
        return None

    # --- maintenance ---------------------------------------------------------------------------------

    def gc(self, key: str, keep: int | None = None, keep_from: int | None = None) -> list[int]:
        """Delete all but the newest ``keep`` versions of ``key``, sparing every step >= ``keep_from``.

        Also removes temporaries (interrupted writes) no newer than the newest version; with no
        version present, temporaries are left alone (their age cannot be judged). Returns the
        deleted steps, ascending.
        """
        keep = self.keep if keep is None else keep
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1, got {keep!r}")
        if keep_from is not None:
            _check_step(keep_from, "keep_from")
        fs, _ = self._resolve()
        listing = self._listing(key)
        versions = sorted((int(m.group(1)), i) for i in listing if (m := _STEP_RE.match(i.base_name)))
        deleted = []
        for step, info in versions[:-keep]:
            if keep_from is None or step < keep_from:
                fs.delete_file(info.path)
                deleted.append(step)
        newest_mtime = versions[-1][1].mtime if versions else None
        if newest_mtime is not None:
            for info in listing:
                if (info.base_name.startswith(_TMP_PREFIX) and info.mtime is not None
                        and info.mtime <= newest_mtime):
                    fs.delete_file(info.path)
        return deleted

    def discard(self, key: str, from_step: int) -> list[int]:
        """Delete every version of ``key`` at ``from_step`` or later (a job rewound past them starts
        a new line of history there); returns the deleted steps."""
        _check_step(from_step, "from_step")
        fs, _ = self._resolve()
        gone = [s for s in self.steps(key) if s >= from_step]
        for s in gone:
            fs.delete_file(self.path(key, s))
        return gone

    def corrupt(self, key: str, step: int) -> None:
        """Failure injection (tests, benchmarks): flip bytes in the middle of the payload, same length."""
        fs, _ = self._resolve()
        path = self.path(key, step)
        with fs.open_input_stream(path) as f:
            data = bytearray(f.read())
        if not data:
            raise ConfigError(f"cannot corrupt {path}: the file is empty")
        start = _DIGEST_LEN + 1 if len(data) > _DIGEST_LEN + 1 else 0
        mid = start + (len(data) - start) // 2
        for i in range(mid, min(mid + 8, len(data))):
            data[i] ^= 0xFF
        with fs.open_output_stream(path) as f:
            f.write(bytes(data))
