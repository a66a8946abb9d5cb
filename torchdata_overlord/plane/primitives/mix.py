"""``mix(schedule)``: draw this step's global batch from the sources, by deterministic counts."""

from __future__ import annotations

import copy
import difflib
import threading
import weakref

import numpy as np

from ...errors import BufferShortageError, ConfigError
from ..apportion import Apportioner
from ..schedules import as_schedule, validate_weights

_SCHEDULES = threading.Lock()     # one Planner at a time sets and reads a schedule object's running state
_MOVED_BY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # schedule -> the Planner that moved it last
_MADE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()       # schedule -> its running state when first mixed


def _owned_by(schedule, planner) -> bool:
    """Whether ``planner`` (None: no Planner, a probe) moved ``schedule`` last, or none did: then its running
    state is this Planner's (and a change the user made to it directly, as the standalone Planner allows,
    counts). A schedule object belongs to the strategy, which several Planners of one process may share."""
    try:
        owner = _MOVED_BY.get(schedule)
    except TypeError:                        # not weakly referable or not hashable: not tracked
        return True
    return planner is None or owner is None or owner() is planner


def _rebuilt(schedule, planner, key: str) -> bool:
    """Whether ``schedule`` is a new object of the same definition (:meth:`~..schedules.Schedule.spec`) as the
    one ``planner`` moved at this primitive the step before: a strategy that builds its schedule when called."""
    before = getattr(planner, "_live", {}).get(key)
    if before is None or before is schedule:
        return False
    try:
        return _MOVED_BY.get(schedule) is None and before.spec() == schedule.spec()
    except TypeError:
        return False


def _first_seen(schedule) -> None:
    """Keep ``schedule``'s running state as it was made (before any Planner moves it): where a Planner that
    never moved it starts (an untracked schedule, not weakly referable, is never found moved by another)."""
    try:
        if schedule not in _MADE:
            _MADE[schedule] = copy.deepcopy(schedule.state_dict())
    except TypeError:
        pass


def _own(schedule, planner) -> None:
    """Mark ``schedule`` as moved by ``planner`` (kept beside it, not in it: a schedule must still pickle)."""
    if planner is not None:
        try:
            _MOVED_BY[schedule] = weakref.ref(planner)
        except TypeError:
            pass


def _known(unknown: set, sources: tuple, shown: int = 12) -> str:
    """The sources there are, for an error naming ``unknown`` ones: the close matches first (a typo), and at most
    ``shown`` names of a long list (a job of hundreds of sources)."""
    close = {u: difflib.get_close_matches(u, sources, n=1) for u in sorted(unknown) if isinstance(u, str)}
    hint = "; ".join(f"{u!r}: did you mean {m[0]!r}?" for u, m in close.items() if m)
    names = list(sources) if len(sources) <= shown else [*sources[:shown], f"... ({len(sources)} in all)"]
    return (f"{hint}; " if hint else "") + f"the buffers hold {names}"


class Mix:
    """Takes ``counts[s]`` oldest samples of each source (FIFO, so no sample starves in a buffer),
    with counts from largest remainder with carried error, then orders the batch by a shuffle that
    is a pure function of (seed, step). State: the carried error, and the schedule's own state."""

    KIND = "mix"
    STATE_APPORTION = "apportion"
    STATE_SCHEDULE = "schedule"

    def __init__(self, schedule):
        self.schedule = as_schedule(schedule)

    def apply(self, g):
        ctx = g.ctx
        if ctx.global_batch is None or ctx.global_batch < 1:
            raise ConfigError(f"mix() needs a global batch size >= 1, got {ctx.global_batch!r}")
        key = ctx.key(self.KIND)
        saved = ctx.state.get(key, {})
        with _SCHEDULES:
            # a schedule object that mixes two views is moved (state, feedback) by the step's first mix() only
            if not any(s is self.schedule for s in ctx.live.values()):
                self._running_state(ctx, key, saved.get(self.STATE_SCHEDULE))
                if ctx.feedback and hasattr(self.schedule, "update"):
                    for values in ctx.feedback:      # applied inside plan(): a pure input of this step
                        self.schedule.update(values)
                    ctx.feedback_used = True
            ctx.restoring.discard(key)
            weights = self.schedule.weights(ctx.step)
            schedule_state = self.schedule.state_dict()
            _own(self.schedule, ctx.planner)
        weights = validate_weights(weights, f"mix schedule at step {ctx.step}")
        # this step's names too: a callable schedule may name a source first at a later step
        unknown = (self.schedule.sources() | set(weights)) - set(g.sources)
        if unknown:
            raise ConfigError(f"mix schedule names unknown sources {sorted(unknown)}; {_known(unknown, g.sources)}")
        app = Apportioner()
        if self.STATE_APPORTION in saved:
            app.load_state_dict(saved[self.STATE_APPORTION])
        counts = app.counts(weights, ctx.global_batch)
        recs = g.records
        rows = []
        for sid, name in enumerate(recs.sources):
            want = counts.get(name, 0)
            have = np.flatnonzero(recs.source_id == sid)
            if len(have) < want:
                err = BufferShortageError(
                    f"step {ctx.step}: source {name!r} has {len(have)} samples buffered but the schedule asks for "
                    f"{want}; enlarge that Source Loader's buffer or lower its weight")
                err.source, err.have, err.want = name, len(have), want
                raise err
            rows.append(have[:want])
        rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        rows = rows[ctx.rng.permutation(len(rows))]
        ctx.state[key] = {self.STATE_APPORTION: app.state_dict(), self.STATE_SCHEDULE: schedule_state}
        ctx.live[key] = self.schedule
        err = app.error()
        info = {"weights": {k: v / sum(weights.values()) for k, v in weights.items()},
                "counts": {k: int(v) for k, v in counts.items()},
                "cumulative": dict(app.realised),
                "max_abs_error": max((abs(v) for v in err.values()), default=0.0)}
        desc = ", ".join(f"{k}={v}" for k, v in info["counts"].items())
        return g.evolve(f"mix[{type(self.schedule).__name__}]: {desc}", records=recs.take(rows),
                        costs=None, placement=None, mix_info=info)

    def _running_state(self, ctx, key: str, saved: dict | None) -> None:
        """Give the schedule this Planner's running state before the step uses it (``saved``: what this
        primitive saved the step before, or a loaded state's)."""
        _first_seen(self.schedule)
        if saved is None:
            if not _owned_by(self.schedule, ctx.planner):  # another Planner moved it: this one starts it as made
                self.schedule.load_state_dict(copy.deepcopy(_MADE[self.schedule]))
        elif _rebuilt(self.schedule, ctx.planner, key) or not _owned_by(self.schedule, ctx.planner) \
                or key in ctx.restoring:
            # the strategy made it anew (e.g. ol.Dynamic(...) inside the strategy function: the same schedule as
            # the step before, which carries on, not from the start), another Planner of this process moved it
            # (a loader of the same strategy, open or closed), or a state was loaded
            self.schedule.load_state_dict(saved)
