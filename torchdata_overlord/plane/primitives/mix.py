"""``mix(schedule)``: draw this step's global batch from the sources, by deterministic counts."""

from __future__ import annotations

import numpy as np

from ...errors import BufferShortageError, ConfigError
from ..apportion import Apportioner
from ..schedules import as_schedule, validate_weights


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
        if key in ctx.restoring and self.STATE_SCHEDULE in saved:
            self.schedule.load_state_dict(saved[self.STATE_SCHEDULE])
            ctx.restoring.discard(key)
        if ctx.feedback and hasattr(self.schedule, "update"):
            for values in ctx.feedback:          # applied inside plan(): a pure input of this step
                self.schedule.update(values)
            ctx.feedback_used = True
        weights = validate_weights(self.schedule.weights(ctx.step), f"mix schedule at step {ctx.step}")
        # this step's names too: a callable schedule may name a source first at a later step
        unknown = (self.schedule.sources() | set(weights)) - set(g.sources)
        if unknown:
            raise ConfigError(f"mix schedule names unknown sources {sorted(unknown)}; the buffers hold {list(g.sources)}")
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
        ctx.state[key] = {self.STATE_APPORTION: app.state_dict(), self.STATE_SCHEDULE: self.schedule.state_dict()}
        ctx.live[key] = self.schedule
        err = app.error()
        info = {"weights": {k: v / sum(weights.values()) for k, v in weights.items()},
                "counts": {k: int(v) for k, v in counts.items()},
                "cumulative": dict(app.realised),
                "max_abs_error": max((abs(v) for v in err.values()), default=0.0)}
        desc = ", ".join(f"{k}={v}" for k, v in info["counts"].items())
        return g.evolve(f"mix[{type(self.schedule).__name__}]: {desc}", records=recs.take(rows),
                        costs=None, placement=None, mix_info=info)
