"""ProfileJournal: source profiles kept between runs, so a restarted job does not profile again.

One small JSON file per source, valid while its key (:func:`~.profile.source_key`: the source's
files, its transform and the profiling method) matches. The journal is a cache: an entry that cannot
be read is profiled again, and a directory that cannot be written just means no journal.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

from .profile import SourceProfile, source_key

__all__ = ["ProfileJournal", "default_journal_dir"]

log = logging.getLogger("torchdata_overlord")


def default_journal_dir(checkpoint_dir: str | os.PathLike | None = None) -> Path:
    """``<checkpoint_dir>/profiles`` when the job has a checkpoint store, else
    ``$TORCHDATA_OVERLORD_CACHE/profiles``, else ``$XDG_CACHE_HOME/torchdata_overlord/profiles``
    (``~/.cache/torchdata_overlord/profiles`` without it)."""
    if checkpoint_dir is not None:
        return Path(checkpoint_dir) / "profiles"
    if os.environ.get("TORCHDATA_OVERLORD_CACHE"):
        return Path(os.environ["TORCHDATA_OVERLORD_CACHE"]) / "profiles"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "torchdata_overlord" / "profiles"


class ProfileJournal:
    """``ProfileJournal(directory)``: ``get(source)`` the profile stored for it, ``put(profile)`` one."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def path(self, name: str) -> Path:
        """The source's file: its name made safe, plus a hash of the name so two names never collide."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
        return self.directory / f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}.json"

    def get(self, source) -> SourceProfile | None:
        """The stored profile of ``source`` if its key still matches; None if absent, stale or unreadable."""
        key = source_key(source)
        if key is None:
            return None
        try:
            profile = SourceProfile.from_dict(json.loads(self.path(source.name).read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.info("profile journal: ignoring %s (%s: %s); profiling %r again",
                     self.path(source.name), type(e).__name__, e, source.name)
            return None
        return profile if profile.key == key and profile.name == source.name else None

    def put(self, profile: SourceProfile) -> None:
        """Store ``profile`` (atomically: a reader sees the old file or the new one); a profile without a
        key is not stored, and a failure to write is logged, never raised."""
        if profile.key is None:
            return
        target = self.path(profile.name)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(profile.to_dict(), f)
                os.replace(tmp, target)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            log.info("profile journal: cannot write %s (%s); profiles are not kept", target, e)
