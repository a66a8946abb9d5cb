"""Asking the Source Loaders for a step's metadata ahead: right after the previous step's delivery, so
each loader refills its buffer (reads and transforms) while that step is committed and built, not
when the next step is planned. A loader runs its calls in order, so the answer is the one asking
later would get; an answer from a loader replaced since, or of another generation, is not used."""

from __future__ import annotations

__all__ = ["MetadataAhead"]


class MetadataAhead:
    """The metadata calls asked ahead for one step, on behalf of a :class:`~.recovery.Recovery`."""

    def __init__(self, recovery):
        self.r = recovery
        self.asked: tuple[int, int, dict] | None = None   # (gen, step, {source: (loader, future)})

    def ask(self, gen: int, step: int) -> None:
        """Ask every active loader for step ``step``'s metadata now (on the loader's own thread)."""
        r = self.r
        self.asked = (gen, step, {s: (r.active[s], r.loader_ref(r.active[s]).metadata(ahead=True)) for s in r.sources})

    def metadata(self, gen: int, step: int) -> dict:
        """Every source's metadata for ``step``: what was asked ahead where still valid, else asked now."""
        asked, self.asked = self.asked, None
        issued = {}
        if asked is not None and asked[:2] == (gen, step):
            issued = {s: fut for s, (name, fut) in asked[2].items() if self.r.active[s] == name}
        return self.r.each_loader(lambda ref, s: ref.metadata(), step, issued=issued)
