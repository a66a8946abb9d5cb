"""Mixing schedules: the per-source sampling weights for each training step (paper section 4.2, ``mix``).

A schedule maps a step to a dict ``{source: weight}``; weights are normalised by the mixer.
Built in: :class:`Constant`, :class:`Piecewise` (step-wise), :class:`Linear` and :class:`Cosine`
interpolation (curriculum, warm-up), :class:`FromCallable` (any function of the step) and
:class:`Dynamic` (updated from per-source trainer feedback such as loss).
"""

from __future__ import annotations

import json
import math
from typing import Callable, Mapping

import numpy as np

from ..errors import ConfigError

__all__ = ["Schedule", "Constant", "Piecewise", "Linear", "Cosine", "FromCallable", "Dynamic",
           "as_schedule", "validate_weights"]


def validate_weights(weights: Mapping[str, float], where: str) -> dict[str, float]:
    """Check one mixture: finite, non-negative, not all zero. ``where`` names it in errors."""
    if not isinstance(weights, Mapping) or not weights:
        raise ConfigError(f"{where}: weights must be a non-empty dict {{source: weight}}, got {weights!r}")
    out = {}
    for name, w in weights.items():
        try:
            if isinstance(w, (str, bytes, bool, np.bool_)):     # float() would take "0.5" and True
                raise TypeError
            w = float(w)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: weight of source {name!r} is {w!r}, not a number") from None
        if math.isnan(w) or math.isinf(w):
            raise ConfigError(f"{where}: weight of source {name!r} is {w}; weights must be finite")
        if w < 0:
            raise ConfigError(f"{where}: weight of source {name!r} is negative ({w})")
        out[str(name)] = w
    if sum(out.values()) <= 0:
        raise ConfigError(f"{where}: all weights are zero; at least one source must have a positive weight")
    return out


class Schedule:
    """Base class: ``weights(step)`` gives the mixture at ``step``; stateful schedules override
    ``state_dict``/``load_state_dict`` (the Planner checkpoints them with its own state) and, for
    trainer feedback, ``update(values)``.

    A schedule object may be built once, outside the strategy, or anew each time the strategy runs (each
    step): a new object of the same :meth:`spec` as the step before's carries on from its running state;
    one of another spec starts as made. Several Planners of a process (a train and an eval loader) may
    share one object: each keeps its own running state, and starts from the state the object had when
    first mixed."""

    def weights(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def sources(self) -> set[str]:
        """Every source name this schedule can ever mention (checked against the buffers)."""
        return set(self.weights(0))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: Mapping) -> None:
        pass

    def spec(self) -> dict:
        """The schedule's definition as plain values, not its running state: a checkpoint records it,
        so that resuming under another mixture is refused. By default the class and its JSON-able
        attributes but those :meth:`state_dict` names (``_ema`` or ``ema`` for a state key ``"ema"``); a
        schedule that keeps running state in attributes named otherwise overrides this."""
        running = set(self.state_dict())
        return {"kind": type(self).__qualname__, **{k.lstrip("_"): v for k, v in sorted(vars(self).items())
                                                   if _plain(v) and k.lstrip("_") not in running}}

    def __call__(self, step: int) -> dict[str, float]:
        return self.weights(step)


class Constant(Schedule):
    """The same mixture at every step."""

    def __init__(self, weights: Mapping[str, float]):
        self._w = validate_weights(weights, "Constant schedule")

    def weights(self, step: int) -> dict[str, float]:
        return dict(self._w)

    def spec(self) -> dict:
        return {"kind": "Constant", "weights": _normalised(self._w)}


def _normalised(w: Mapping[str, float]) -> dict[str, float]:
    """Sorted by name, without zero weights, summing to 1: the mixture the mixer uses, whatever the
    scale given."""
    total = sum(w.values())
    return {k: w[k] / total for k in sorted(w) if w[k] > 0}


def _plain(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _union(mixtures) -> set[str]:
    return set().union(*(m.keys() for m in mixtures))


def _fill(w: Mapping[str, float], names) -> dict[str, float]:
    return {n: float(w.get(n, 0.0)) for n in sorted(names)}


class Piecewise(Schedule):
    """Step-wise: ``{0: mix_a, 1000: mix_b}`` uses ``mix_a`` for steps 0..999 and ``mix_b`` after."""

    def __init__(self, stages: Mapping[int, Mapping[str, float]]):
        if not isinstance(stages, Mapping) or not stages:
            raise ConfigError(f"Piecewise schedule needs a dict {{first step: mixture}}, got {stages!r}")
        bad = [s for s in stages if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad:
            raise ConfigError(f"Piecewise schedule: each stage's first step must be an integer >= 0, got {bad!r}")
        if 0 not in stages:
            raise ConfigError(f"Piecewise schedule needs a stage starting at step 0, got steps {sorted(stages)}")
        self._steps = sorted(stages)
        names = _union(stages.values())
        self._stages = [_fill(validate_weights(stages[s], f"Piecewise stage at step {s}"), names) for s in self._steps]

    def weights(self, step: int) -> dict[str, float]:
        i = max(j for j, s in enumerate(self._steps) if s <= max(step, 0))
        return dict(self._stages[i])

    def sources(self) -> set[str]:
        return set(self._stages[0])

    def spec(self) -> dict:
        return {"kind": "Piecewise", "steps": list(self._steps), "stages": [_normalised(w) for w in self._stages]}


class Linear(Schedule):
    """Interpolates from ``start`` to ``end`` over ``steps`` steps beginning at ``start_step``."""

    def __init__(self, start: Mapping[str, float], end: Mapping[str, float], steps: int, start_step: int = 0):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"{type(self).__name__} schedule: steps must be an integer >= 1, got {steps!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ConfigError(f"{type(self).__name__} schedule: start_step must be an integer >= 0, got {start_step!r}")
        names = _union([start, end])
        self._a = _fill(validate_weights(start, f"{type(self).__name__} start"), names)
        self._b = _fill(validate_weights(end, f"{type(self).__name__} end"), names)
        # interpolate normalised mixtures so the path stays a valid mixture throughout
        sa, sb = sum(self._a.values()), sum(self._b.values())
        self._a = {k: v / sa for k, v in self._a.items()}
        self._b = {k: v / sb for k, v in self._b.items()}
        self.steps, self.start_step = steps, start_step

    def _progress(self, step: int) -> float:
        return min(max((step - self.start_step) / self.steps, 0.0), 1.0)

    def weights(self, step: int) -> dict[str, float]:
        t = self._progress(step)
        return {k: (1 - t) * self._a[k] + t * self._b[k] for k in self._a}

    def sources(self) -> set[str]:
        return set(self._a)


class Cosine(Linear):
    """Like :class:`Linear` but along a half-cosine: slow at both ends."""

    def _progress(self, step: int) -> float:
        return 0.5 - 0.5 * math.cos(math.pi * super()._progress(step))


class FromCallable(Schedule):
    """Any function ``step -> {source: weight}``; each result is validated when used."""

    def __init__(self, fn: Callable[[int], Mapping[str, float]]):
        if not callable(fn):
            raise ConfigError(f"FromCallable needs a callable of the step, got {fn!r}")
        self._fn = fn

    def weights(self, step: int) -> dict[str, float]:
        return validate_weights(self._fn(step), f"schedule callable at step {step}")

    def spec(self) -> dict:
        """The function's name only: a changed body of the same function is not seen."""
        fn = self._fn
        return {"kind": "FromCallable", "fn": f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"}


class Dynamic(Schedule):
    """Weights updated from per-source feedback (e.g. loss): ``w_i <- w_i * exp(lr * feedback_i)``.

    Sources with higher feedback get more weight; ``floor`` keeps every initially positive source
    sampled. ``OverlordLoader.feedback(values)`` (or ``Planner.plan(..., feedback=[values])``)
    hands trainer feedback to :meth:`update` inside the plan of a fixed step, so it is replayable.
    Deterministic: the same feedback sequence gives the same weights; the state round-trips.
    """

    def __init__(self, initial: Mapping[str, float], lr: float = 1.0, floor: float = 0.01):
        w = validate_weights(initial, "Dynamic schedule initial weights")
        total = sum(w.values())
        self._w = {k: v / total for k, v in sorted(w.items())}
        self._initial = dict(self._w)
        if not (lr > 0 and math.isfinite(lr)):
            raise ConfigError(f"Dynamic schedule: lr must be a positive finite number, got {lr!r}")
        if not 0 <= floor < 1:
            raise ConfigError(f"Dynamic schedule: floor must be in [0, 1), got {floor!r}")
        self.lr, self.floor = float(lr), float(floor)
        self._active = {k for k, v in self._w.items() if v > 0}
        self.updates = 0

    def update(self, feedback: Mapping[str, float]) -> None:
        unknown = set(feedback) - set(self._w)
        if unknown:
            raise ConfigError(f"Dynamic schedule feedback names unknown sources {sorted(unknown)}; known: {sorted(self._w)}")
        for k, f in feedback.items():
            if not math.isfinite(float(f)):
                raise ConfigError(f"Dynamic schedule feedback for {k!r} is {f}; must be finite")
        mean = sum(float(f) for f in feedback.values()) / max(len(feedback), 1)
        w = {k: v * math.exp(self.lr * (float(feedback[k]) - mean)) if k in feedback else v for k, v in self._w.items()}
        total = sum(w.values())
        w = {k: v / total for k, v in w.items()}
        lo = self.floor / max(len(self._active), 1)
        w = {k: (max(v, lo) if k in self._active else 0.0) for k, v in w.items()}
        total = sum(w.values())
        self._w = {k: v / total for k, v in w.items()}
        self.updates += 1

    def weights(self, step: int) -> dict[str, float]:
        return dict(self._w)

    def spec(self) -> dict:
        return {"kind": "Dynamic", "initial": dict(self._initial), "lr": self.lr, "floor": self.floor}

    def state_dict(self) -> dict:
        return {"weights": dict(self._w), "updates": self.updates}

    def load_state_dict(self, state: Mapping) -> None:
        w = dict(state["weights"])
        if set(w) != set(self._w):
            raise ConfigError(f"Dynamic schedule state has sources {sorted(w)}, this schedule has {sorted(self._w)}")
        self._w = {k: float(v) for k, v in sorted(w.items())}
        self.updates = int(state["updates"])


def as_schedule(obj) -> Schedule:
    """Accept a Schedule, a plain ``{source: weight}`` dict (constant) or a callable of the step."""
    if isinstance(obj, Schedule):
        return obj
    if isinstance(obj, Mapping):
        return Constant(obj)
    if callable(obj):
        return FromCallable(obj)
    raise ConfigError(f"mix() needs a Schedule, a dict of weights or a callable of the step, got {type(obj).__name__}")
