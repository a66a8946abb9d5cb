"""The loaders' metadata one step ahead: each ``deliver(step)`` answers with the metadata of the
loader's refilled buffer (:class:`~.loader_actor.Delivery`), so the next step is planned without
asking again; a loader refills while its parts travel to the constructors, and a step costs one
call per loader, not two. An answer from a loader replaced since, or of another generation or step, is not used: such
a loader is asked ``metadata()`` (the first step, after a reset or a replacement)."""

from __future__ import annotations

from typing import Mapping

__all__ = ["MetadataAhead"]


class MetadataAhead:
    """The next step's metadata as the deliveries answered it, on behalf of a :class:`~.recovery.Recovery`."""

    def __init__(self, recovery):
        self.r = recovery
        self.kept: tuple[int, int, dict] | None = None     # (gen, step, {source: (loader, BufferMeta)})

    def keep(self, gen: int, step: int, deliveries: Mapping) -> None:
        """Step ``step``'s metadata from the deliveries of the step before (loader key -> Delivery)."""
        self.kept = (gen, step, {s: (self.r.active[s], d.meta) for s, d in deliveries.items() if d.meta is not None})

    def metadata(self, gen: int, step: int) -> dict:
        """Every loader's metadata for ``step``: what a delivery answered where still valid, else asked now."""
        kept, self.kept = self.kept, None
        have = {}
        if kept is not None and kept[:2] == (gen, step):
            have = {s: meta for s, (name, meta) in kept[2].items() if self.r.active.get(s) == name}
        missing = [s for s in self.r.keys if s not in have]
        return {**have, **(self.r.each_loader(lambda ref, s: ref.metadata(), step, only=missing) if missing else {})}
