"""Learning-rate schedules: `constant`, `cosine` and `linear`.

A schedule maps the index ``s`` of the update being made (0 for the first
optimizer step) to the learning rate, given the peak ``lr`` of the optimizer
and the run's step count ``T`` (``:steps``, or ``--steps``)::

    warmup W:   lr(s) = lr * (s + 1) / W                  for s < W
    cosine:     lr(s) = lr * (f + (1 - f) * (1 + cos(pi * p)) / 2)
    linear:     lr(s) = lr * (1 - (1 - f) * p)
                with p = (s - W) / max(1, T - W), the fraction of decay done,
                and f = :floor, the fraction of the peak reached at s = T.

``constant`` is ``lr`` at every step. ``:warmup`` defaults to 0 and
``:floor`` to 0.0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sexpgpu.errors import SexpgpuError

__all__ = ["SCHEDULES", "Schedule", "make_schedule", "schedule"]

# name as users type it -> decay shape: fraction of decay done -> factor in [floor, 1]
SCHEDULES: dict[str, Callable[[float, float], float]] = {}
_OPTIONS = {"constant": (), "cosine": ("warmup", "floor"), "linear": ("warmup", "floor")}


def schedule(
    name: str,
) -> Callable[[Callable[[float, float], float]], Callable[[float, float], float]]:
    """Register a decay shape ``(progress, floor) -> factor`` under a schedule name."""

    def register(fn: Callable[[float, float], float]) -> Callable[[float, float], float]:
        SCHEDULES[name] = fn
        return fn

    return register


@schedule("constant")
def _constant(progress: float, floor: float) -> float:
    return 1.0


@schedule("cosine")
def _cosine(progress: float, floor: float) -> float:
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@schedule("linear")
def _linear(progress: float, floor: float) -> float:
    return 1.0 - (1.0 - floor) * progress


@dataclass(frozen=True)
class Schedule:
    """A schedule bound to its peak rate and horizon; call it with the update index."""

    shape: Callable[[float, float], float]
    peak: float
    steps: int
    warmup: int = 0
    floor: float = 0.0

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return self.peak * (s + 1) / self.warmup
        progress = min(1.0, (s - self.warmup) / max(1, self.steps - self.warmup))
        return self.peak * self.shape(progress, self.floor)


def make_schedule(spec: Any, peak: float, steps: int) -> Schedule:
    """The schedule a `ScheduleSpec` (``name``, ``options``, ``span``) names; None is constant."""
    if spec is None:
        return Schedule(SCHEDULES["constant"], peak, steps)
    where = getattr(spec, "span", None)
    if spec.name not in SCHEDULES:
        raise SexpgpuError(
            "E-TRAIN-001",
            f"unknown schedule `{spec.name}`",
            where,
            hint=f"use one of {', '.join(sorted(SCHEDULES))}",
        )
    options: Mapping[str, Any] = dict(spec.options)
    allowed = _OPTIONS.get(spec.name, ("warmup", "floor"))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        takes = ", ".join(":" + k for k in allowed) or "no options"
        raise SexpgpuError(
            "E-TRAIN-001",
            f"schedule {spec.name}: unknown option :{unknown[0]}",
            where,
            hint=f"{spec.name} takes {takes}",
        )
    warmup, floor = int(options.get("warmup", 0)), float(options.get("floor", 0.0))
    if warmup < 0 or not 0.0 <= floor <= 1.0:
        raise SexpgpuError(
            "E-TRAIN-001",
            f"schedule {spec.name}: :warmup {warmup} must be >= 0 and :floor {floor} in [0, 1]",
            where,
            hint="e.g. (cosine :warmup 100 :floor 0.1)",
        )
    return Schedule(SCHEDULES[spec.name], peak, steps, warmup, floor)
