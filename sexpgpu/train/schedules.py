"""Learning-rate schedules: `constant`, `cosine` and `linear`.

A schedule maps the index ``s`` of the update being made (0 for the first
optimizer step) to the learning rate, given the peak ``lr`` of the optimizer
and the run's step count ``T`` (``:steps``, or ``--steps``)::

    warmup W:   lr(s) = lr * (s + 1) / W                  for s < W
    cosine:     lr(s) = lr * (f + (1 - f) * (1 + cos(pi * p)) / 2)
    linear:     lr(s) = lr * (1 - (1 - f) * p)
                with p = (s - W) / max(1, T - W), the fraction of decay done,
                and f = :floor, the fraction of the peak reached at s = T.

``constant`` is ``lr`` at every step. The names, options and defaults are
the language's (`sexpgpu.lang.runs.SCHEDULES`); each rule here takes the
options as keyword arguments, every one filled in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["SCHEDULES", "Schedule", "make_schedule", "schedule"]

# A rule: (peak rate, update index s, run steps T, **options) -> the rate.
Rule = Callable[..., float]

# name as users type it (the language's table) -> rule
SCHEDULES: dict[str, Rule] = {}


def schedule(name: str) -> Callable[[Rule], Rule]:
    """Register a rule ``(peak, s, steps, **options) -> rate`` under a schedule name."""

    def register(rule: Rule) -> Rule:
        SCHEDULES[name] = rule
        return rule

    return register


def _decay(peak: float, s: int, steps: int, warmup: int, shape: Callable[[float], float]) -> float:
    """Linear warmup over `warmup` updates, then `shape` of the fraction of decay done."""
    if s < warmup:
        return peak * (s + 1) / warmup
    return peak * shape(min(1.0, (s - warmup) / max(1, steps - warmup)))


@schedule("constant")
def _constant(peak: float, s: int, steps: int) -> float:
    return peak


@schedule("cosine")
def _cosine(peak: float, s: int, steps: int, *, warmup: int, floor: float) -> float:
    def shape(p: float) -> float:
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))

    return _decay(peak, s, steps, warmup, shape)


@schedule("linear")
def _linear(peak: float, s: int, steps: int, *, warmup: int, floor: float) -> float:
    return _decay(peak, s, steps, warmup, lambda p: 1.0 - (1.0 - floor) * p)


@dataclass(frozen=True)
class Schedule:
    """A schedule bound to its peak rate, horizon and options; call it with the update index."""

    rule: Rule
    peak: float
    steps: int
    options: dict[str, Any]

    def __call__(self, s: int) -> float:
        return self.rule(self.peak, s, self.steps, **self.options)


def make_schedule(spec: Any, peak: float, steps: int) -> Schedule:
    """The schedule a `ScheduleSpec` (``name``, ``options``) names, peaking at `peak`."""
    return Schedule(SCHEDULES[spec.name], peak, steps, dict(spec.options))
