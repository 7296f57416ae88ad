"""From an experiment file to a finished run: the library side of ``sexpgpu run``."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.train.loop import RunSummary, StepReport, Trainer
from sexpgpu.train.resume import run_folder
from sexpgpu.train.settings import (
    RunSettings,
    experiment_identity,
    identity_hash,
    microbatches_per_rank,
)

__all__ = ["prepare_run", "run_experiment"]


def _check_trainable(compiled: Any, rundef: Any) -> None:
    """E-TRACE-006 when no parameter reaches the loss, as PyTorch's backward refuses it.

    `check` and `explain` still show such a graph; only training it is pointless.
    """
    if not compiled.trainable:
        raise SexpgpuError(
            "E-TRACE-006",
            f"the loss of run `{rundef.name}` depends on no parameter: training changes nothing",
            rundef.loss.span,
            hint="compute the loss from the model's output, e.g. (cross-entropy (model x) y)",
        )


def prepare_run(
    path: str | Path,
    *,
    variant: str | None = None,
    sets: Sequence[str] = (),
    run: str | None = None,
    steps: int | None = None,
    out: str | Path | None = None,
    resume: str | None = None,
    device: str | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    announce: Callable[[str], None] | None = None,
    environ: Mapping[str, str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    init_from: str | Path | None = None,
    log: Sequence[str] = (),
    started: float | None = None,
) -> Trainer:
    """Load, check and compile a run of an experiment file; return its `Trainer`.

    Parameters
    ----------
    path
        The experiment file.
    variant, run
        ``--variant`` and ``--run``.
    sets
        ``--set NAME=VALUE`` texts: parameter values after the variant.
    steps
        ``--steps``: overrides ``:steps`` (the schedule's horizon too).
    out
        The run directory; default ``runs/RUN-NAME``, or for a fresh run
        the first ``runs/RUN-NAME-N`` that holds no run yet.
    resume
        ``"latest"``, a checkpoint folder, or None.
    device
        ``--device``; None reads ``SEXPGPU_DEVICE``.
    on_step
        Progress callback (rank 0's thread).
    announce
        Called with the lines a user should see (the checkpoint resumed).
    environ
        The environment (default ``os.environ``): device and node variables.
    storage_options
        fsspec options for remote checkpoint locations.
    init_from
        ``--init-from``: a transformers folder whose parameters a fresh run
        starts from (`sexpgpu.train.hf.read_hf`).
    log
        ``--log``: loggers mirroring the metrics, beside the run's ``:log``.
    started
        ``time.perf_counter()`` when the command began (default: now): the
        run records its first step's ``runtime/first_step_s`` from it.
    """
    started = time.perf_counter() if started is None else started
    from sexpgpu.devices.base import get_device
    from sexpgpu.devices.memory_fit import check_plan
    from sexpgpu.devices.shard import choose as choose_shards
    from sexpgpu.devices.shard import shard_line
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment
    from sexpgpu.runtime.config import RuntimeConfig

    config = RuntimeConfig.from_env(os.environ if environ is None else environ, device=device)
    backend = get_device(config.device)
    devices = [str(d) for d in config.local_devices]
    experiment = load_experiment(path, variant, sets)
    rundef = experiment.run(run)
    if steps is not None and not 1 <= steps < 2**63:  # the file's :steps has the same bounds
        raise SexpgpuError(
            "E-CLI-001",
            f"--steps {steps} is not positive" if steps < 1 else f"--steps {steps} is too large",
            "--steps",
            hint="give the number of optimizer steps, e.g. --steps 200",
        )
    settings = RunSettings.from_run(rundef, steps)
    if log:  # --log adds to :log, each logger once
        settings = dataclasses.replace(settings, log=tuple(dict.fromkeys([*settings.log, *log])))
    compiled = compile_run(experiment, rundef)  # once per run; errors surface before any thread
    prepared = [("front end", time.perf_counter())]
    _check_trainable(compiled, rundef)
    init, record = None, {"sets": dict(experiment.sets)} if experiment.sets else {}
    if init_from is not None:
        init = _init_from(init_from, resume, experiment, rundef, compiled)
        record["init_from"] = str(Path(init_from).resolve())
    plan, shards = choose_shards(
        backend,
        compiled,
        config.shard_optimizer,
        config.world_size,
        optimizer=settings.optimizer.name,
        ranks=len(devices),
        memory=config.memory,
        microbatches=microbatches_per_rank(settings.microbatches, config.world_size),
    )
    check_plan(plan, hint="shrink the model's sizes")  # E-MEM-001 before any initializer runs
    prepared.append(("plan", time.perf_counter()))  # the step compiled or loaded included
    local = config.local_devices
    identity = experiment_identity(experiment, rundef.name)

    def make_program(rank: int) -> Any:
        return backend.load(plan, local[rank])

    return Trainer(
        make_program,
        experiment.data[rundef.data],
        settings,
        run_folder(out, rundef.name, resume, identity_hash(identity)),
        experiment_hash=identity_hash(identity),
        identity=identity,
        devices=devices,
        run_name=rundef.name,
        param_shapes={key: info.shape for key, info in compiled.params.items()},
        target=compiled.target,
        plan=plan.memory,
        report=[*backend.report(plan), *shard_line(shards, config.shard_optimizer)],
        resume=resume,
        on_step=on_step,
        announce=announce,
        storage_options=storage_options,
        runtime=config,
        sets=experiment.sets,
        init=init,
        record=record,
        shard_optimizer=shards > 1,
        started=started,
        prepared=prepared,
    )


def _init_from(
    folder: str | Path, resume: str | None, experiment: Any, run: Any, compiled: Any
) -> dict[str, Any]:
    """The parameters of a transformers folder (E-CLI-001 with --resume; E-HF-*)."""
    from sexpgpu.train.hf import read_hf

    if resume is not None:
        raise SexpgpuError(
            "E-CLI-001",
            "--init-from starts a run; --resume continues one from its checkpoint",
            "--init-from",
            hint="drop --init-from to resume, or --resume to start from the folder",
        )
    shapes = {key: info.shape for key, info in compiled.params.items()}
    return read_hf(folder, experiment, run, shapes)


def run_experiment(path: str | Path, **options: Any) -> RunSummary:
    """`prepare_run` then train; the keyword arguments are `prepare_run`'s."""
    return prepare_run(path, **options).run()
