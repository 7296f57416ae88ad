"""What a run reports: after each step (`StepReport`) and at its end (`RunSummary`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["RunSummary", "StepReport"]


@dataclass(frozen=True)
class StepReport:
    """What the progress display shows after each step."""

    step: int
    steps: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_time_s: float
    eta_s: float
    eval_loss: float | None = None  # the latest evaluation's, if any
    eval_accuracy: float | None = None
    eval_step: int | None = None  # the step of the latest evaluation
    unit: str = "tok"  # what tokens_per_s counts: tok (streams) or samples (arrays)
    # At the run's first step: seconds since its start (compiling included), and by phase.
    first_step_s: float | None = None
    startup: tuple[tuple[str, float], ...] = ()


@dataclass
class RunSummary:
    """How a run ended: the last step's numbers and rank 0's parameters."""

    step: int
    loss: float | None
    eval_loss: float | None
    eval_accuracy: float | None
    seconds: float
    params: dict[str, np.ndarray] = field(repr=False)
    resumed_from: int | None = None
    memory: str | None = None  # ``memory: peak X of Y planned (+Z%)``
    interrupted: bool = False  # stopped early by `Trainer.stop` (SIGINT, SIGTERM)
