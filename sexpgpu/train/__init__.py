"""Training runs: data, optimizers, schedules, the run loop, checkpoints, metrics.

::

    from sexpgpu.train import run_experiment
    summary = run_experiment("examples/mlp.lisp", steps=300, out="runs/mlp")

docs/training.md describes a run; docs/metrics.md its directory.
"""

from sexpgpu.devices.optim import OPTIMIZERS, make_optimizer
from sexpgpu.train.checkpoint import Checkpoint, Location, load_checkpoint, save_checkpoint
from sexpgpu.train.data import SOURCES, make_loader
from sexpgpu.train.loop import Trainer
from sexpgpu.train.reports import RunSummary, StepReport
from sexpgpu.train.runner import prepare_run, run_experiment
from sexpgpu.train.schedules import SCHEDULES, make_schedule
from sexpgpu.train.settings import RunSettings, experiment_hash

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "SOURCES",
    "Checkpoint",
    "Location",
    "RunSettings",
    "RunSummary",
    "StepReport",
    "Trainer",
    "experiment_hash",
    "load_checkpoint",
    "make_loader",
    "make_optimizer",
    "make_schedule",
    "prepare_run",
    "run_experiment",
    "save_checkpoint",
]
