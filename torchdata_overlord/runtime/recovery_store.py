"""The Planner's checkpoints in the store (``planner`` at version = steps planned, with who serves where;
``loader/<source>`` every ``snapshot_every`` steps: the source's state, the same whatever its
data-parallel parts) and what a restore reads back: a replacement Planner's restore point, and a
loader's differential restore (its source's last snapshot plus the consumption log of the steps since)."""

from __future__ import annotations

from typing import Mapping

from ..errors import OverlordError
from .fault_policy import RoleLost
from .step import JobState

__all__ = ["RecoveryStore", "PLANNER_KEY", "FENCE_KEY"]

PLANNER_KEY = "planner"                 # the Planner's checkpoints in the store
FENCE_KEY = "planner-fence"             # a replacement Planner's incarnation, written before it restores anything


class RecoveryStore:
    """What a :class:`~.recovery.Recovery` writes to and reads from its checkpoint store (``None``: no
    store, nothing written)."""

    def __init__(self, recovery):
        self.r, self.store = recovery, recovery.store

    def roles(self) -> dict:
        """Who serves where (checkpointed: a replacement Planner continues from it)."""
        r = self.r
        return {"active": dict(r.active), "parts": r.job.parts.to_dict(), "shadow": dict(r.shadows.names), "constructors": list(r.constructor_names),
                "where": dict(r.spares.where), "renames": r.renames, "dead_spares": sorted(r.spares.dead),
                "replaced": dict(r.replaced), "home": r.home, "starting": r.shadows.starting_where()}

    def restore_roles(self, roles: Mapping) -> None:
        """Who serves where, back from a checkpoint's :meth:`roles` record (a replacement Planner)."""
        r = self.r
        r.job.parts = r.job.parts.resized(roles.get("parts") or {})
        r.active, r.shadows.names = dict(roles["active"]), dict(roles["shadow"])
        r.constructor_names, r.spares.where = list(roles["constructors"]), dict(roles["where"])
        r.renames = int(roles["renames"])
        r.spares.dead = set(roles.get("dead_spares", []))
        r.replaced.update(roles.get("replaced", {}))

    def checkpoint(self, version: int, state: dict, consumed: Mapping[str, list], applied: list = ()) -> None:
        """Step ``version``'s checkpoint: the Planner, the unplanned feedback, the feedback the plan of step
        ``version - 1`` used (``applied``) and the leader's prefetch, what the step took from each source, where
        every client is, who serves where and the recoveries so far; then the store keeps what a replay needs."""
        if self.store is None:
            return
        self.r.check_current()              # a Planner replaced while frozen writes nothing after it wakes
        self.store.put(PLANNER_KEY, version, {"planner": state[JobState.PLANNER], "feedback": state[JobState.FEEDBACK],
                                              "applied": [list(e) for e in applied], "prefetch": self.r.job.prefetch,
                                              "events": list(self.r.events),
                                              "consumed": {s: list(consumed.get(s, [])) for s in self.r.sources},
                                              "released": self.r.job.releases.released, "gen": self.r.job.gen,
                                              "roles": self.roles()})
        if version % self.r.policy.snapshot_every == 0:      # each source's state, whatever its parts
            for s in self.r.sources:
                self.store.put(f"loader/{s}", version, state[JobState.LOADERS][s])
        # keep the two newest snapshots of each source (a corrupt newest falls back to the one before)
        # and every Planner checkpoint since the older one: the consumption log a replay needs
        oldest = self.r.job.releases.released
        for s in self.r.sources:
            self.store.gc(f"loader/{s}", keep=2)
            oldest = min([oldest] + self.store.steps(f"loader/{s}")[:1])
        self.store.gc(PLANNER_KEY, keep=1, keep_from=oldest)

    def reset(self, version: int, state: dict) -> None:
        """A new line of history starts at ``version``: drop what came after it, snapshot everyone."""
        if self.store is None:
            return
        self.r.check_current()
        self.store.discard(PLANNER_KEY, version + 1)
        for s in self.r.sources:
            self.store.discard(f"loader/{s}", version + 1)
            self.store.put(f"loader/{s}", version, state[JobState.LOADERS][s])
        self.checkpoint(version, state, {})

    def differential(self, source: str, version: int) -> tuple[int, dict, list] | None:
        """(snapshot version, snapshot, per-step consumption since) from the store, or None."""
        snap = self.store.latest(f"loader/{source}", at_most=version)
        if snap is None:
            return None
        consumed = []
        for v in range(snap[0] + 1, version + 1):
            try:
                ck = self.store.get(PLANNER_KEY, v)
            except (FileNotFoundError, OverlordError) as e:
                raise RoleLost(f"source {source!r}: the consumption log of step {v - 1} is missing or corrupt "
                               f"({e}); cannot replay from the snapshot of step {snap[0]}") from e
            consumed.append(ck["consumed"].get(source, []))
        return snap[0], snap[1], consumed

    def restore_point(self) -> tuple[dict, int, dict]:
        """(the newest Planner checkpoint, and the version and checkpoint a replacement Planner restores:
        where every client was by the newest one, or the newest valid one before)."""
        newest = self.store.latest(PLANNER_KEY)
        if newest is None:
            raise RoleLost("the Planner failed before its first checkpoint; nothing to restore")
        got = self.store.latest(PLANNER_KEY, at_most=min(int(newest[1]["released"]), newest[0]))
        if got is None:
            raise RoleLost(f"no valid Planner checkpoint at or before step {newest[1]['released']}")
        return newest[1], got[0], got[1]
