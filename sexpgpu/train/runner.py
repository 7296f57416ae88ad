"""From an experiment file to a finished run: the library side of ``sexpgpu run``."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.train.loop import RunSummary, StepReport, Trainer
from sexpgpu.train.settings import RunSettings, experiment_hash

__all__ = ["prepare_run", "run_experiment"]


def _devices(device: str | None, environ: Mapping[str, str]) -> tuple[list[str], int | None]:
    """The local devices of a cpu run, and ``SEXPGPU_MEMORY`` (None when unset)."""
    from sexpgpu.runtime.config import RuntimeConfig

    config = RuntimeConfig.from_env(environ, device=device)
    if config.device != "cpu":
        raise SexpgpuError(
            "E-CLI-001",
            f"training on `{config.device}` is not available yet; only cpu runs train",
            "--device",
            hint="use --device cpu (SEXPGPU_DEVICES=0,1 simulates several ranks)",
        )
    if config.nodes != 1:
        raise SexpgpuError(
            "E-DP-005",
            f"SEXPGPU_NODES={config.nodes}: runs of several nodes need cuda",
            "SEXPGPU_NODES",
            hint="unset SEXPGPU_NODES for a cpu run",
        )
    return [str(d) for d in config.local_devices], config.memory


def _check_trainable(program: Any, rundef: Any) -> None:
    """E-TRACE-006 when no parameter reaches the loss, as PyTorch's backward refuses it.

    `check` and `explain` still show such a graph; only training it is pointless.
    """
    from sexpgpu.ir.node import topological_order
    from sexpgpu.ir.ops import Op

    if not any(node.op == Op.PARAM for node in topological_order([program.trace.loss])):
        raise SexpgpuError(
            "E-TRACE-006",
            f"the loss of run `{rundef.name}` depends on no parameter: training changes nothing",
            getattr(rundef.loss, "span", None),
            hint="compute the loss from the model's output, e.g. (cross-entropy (model x) y)",
        )


def _check_memory(program: Any, settings: RunSettings, ranks: int, memory: int | None) -> None:
    """E-MEM-001 before any initializer runs when a rank's arrays cannot fit.

    A rank holds its float32 parameters, the optimizer's moments (one array
    per parameter each) and the training graph's planned live set. The
    simulated ranks of a cpu run share the host, so each gets its share of
    the host's memory unless ``SEXPGPU_MEMORY`` sets the budget per rank.
    """
    from sexpgpu.runtime.memory import MemoryBudget, MemoryPlan, detect_budget
    from sexpgpu.train.optim import OPTIMIZERS

    budget = detect_budget("cpu", memory)
    if memory is None and ranks > 1:
        budget = MemoryBudget(budget.device, budget.nbytes // ranks, f"host memory / {ranks}")
    params = 4 * int(program.param_count)
    moments = len(getattr(OPTIMIZERS.get(settings.optimizer.name), "moments", ()))
    plan = MemoryPlan(
        budget,
        {
            "parameters": params,
            "optimizer": moments * params,
            "activations": int(program.planned_peak_bytes),
        },
    )
    plan.check(hint="shrink the model's sizes")


def prepare_run(
    path: str | Path,
    *,
    variant: str | None = None,
    run: str | None = None,
    steps: int | None = None,
    out: str | Path | None = None,
    resume: str | None = None,
    device: str | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    environ: Mapping[str, str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Trainer:
    """Load, check and compile a run of an experiment file; return its `Trainer`.

    Parameters
    ----------
    path
        The experiment file.
    variant, run
        ``--variant`` and ``--run``.
    steps
        ``--steps``: overrides ``:steps`` (the schedule's horizon too).
    out
        The run directory; default ``runs/RUN-NAME``.
    resume
        ``"latest"``, a checkpoint folder, or None.
    device
        ``--device``; None reads ``SEXPGPU_DEVICE``.
    on_step
        Progress callback (rank 0's thread).
    environ
        The environment (default ``os.environ``): device variables.
    storage_options
        fsspec options for remote checkpoint locations.
    """
    from sexpgpu.devices.program import compile_run
    from sexpgpu.lang import load_experiment

    devices, memory = _devices(device, os.environ if environ is None else environ)
    experiment = load_experiment(path, variant)
    rundef = experiment.run(run)
    if steps is not None and not 1 <= steps < 2**63:  # the file's :steps has the same bounds
        raise SexpgpuError(
            "E-CLI-001",
            f"--steps {steps} is not positive" if steps < 1 else f"--steps {steps} is too large",
            "--steps",
            hint="give the number of optimizer steps, e.g. --steps 200",
        )
    settings = RunSettings.from_run(rundef, steps)
    first = compile_run(experiment, rundef)  # errors surface before any thread starts
    _check_trainable(first, rundef)
    _check_memory(first, settings, len(devices), memory)
    programs = {0: first}

    def make_program(rank: int) -> Any:
        return programs.pop(rank) if rank in programs else compile_run(experiment, rundef)

    model = experiment.models[rundef.model]
    return Trainer(
        make_program,
        experiment.data[rundef.data],
        settings,
        Path(out) if out is not None else Path("runs") / rundef.name,
        experiment_hash=experiment_hash(experiment, rundef.name),
        devices=devices,
        model_inputs=[getattr(s, "name", str(s)) for s in model.inputs],
        resume=resume,
        on_step=on_step,
        storage_options=storage_options,
    )


def run_experiment(path: str | Path, **options: Any) -> RunSummary:
    """`prepare_run` then train; the keyword arguments are `prepare_run`'s."""
    return prepare_run(path, **options).run()
