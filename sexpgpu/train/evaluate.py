"""Evaluation: the mean loss (and argmax accuracy) over a data set's eval batches.

One function serves the run loop's evaluations and ``sexpgpu eval``, so a
checkpoint evaluated alone gives the numbers its run recorded at that step.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sexpgpu.devices.base import HostState, Program
from sexpgpu.errors import SexpgpuError
from sexpgpu.train.data import StreamLoader, make_loader

__all__ = ["Evaluation", "evaluate_batches", "evaluate_trained"]


@dataclass(frozen=True)
class Evaluation:
    """A mean eval loss over `batches` batches; `accuracy` None without a target field.

    `perplexity` is ``exp(loss)`` for a token stream's loss, else None.
    """

    loss: float
    accuracy: float | None
    batches: int
    perplexity: float | None = None


def evaluate_batches(program: Program, batches: Any, target: str | None) -> Evaluation:
    """Evaluate `program` on each batch; the mean loss and the accuracy over every target."""
    losses, right, total = [], 0, 0
    for batch in batches:
        result = program.evaluate(batch, target)
        losses.append(result.loss)
        right, total = right + result.correct, total + result.count
    return Evaluation(float(np.mean(losses)), right / total if total else None, len(losses))


def evaluate_trained(
    trained: Any,
    *,
    data: str | None = None,
    batches: int | None = None,
    device: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Evaluation:
    """Evaluate a `sexpgpu.train.trained.Trained` on one device as its run evaluates.

    Parameters
    ----------
    trained
        The experiment and checkpoint.
    data
        A ``defdata`` of the experiment to evaluate on (default the run's).
    batches
        Eval batches (default the run's ``:eval :batches``, else 20).
    device, environ
        As `sexpgpu.train.runner.prepare_run`; the first local device is used.
    """
    from sexpgpu.devices.base import get_device
    from sexpgpu.runtime.config import RuntimeConfig

    s, compiled = trained.settings, trained.compiled
    dataset = _data_set(trained, data)
    count = batches if batches is not None else (s.eval_batches or 20)
    if count < 1:
        raise SexpgpuError(
            "E-CLI-001",
            f"--batches {count} is not positive",
            "--batches",
            hint="give the number of eval batches, e.g. --batches 20",
        )
    config = RuntimeConfig.from_env(os.environ if environ is None else environ, device=device)
    backend = get_device(config.device)
    loader = make_loader(dataset, batch=s.batch, microbatches=s.microbatches, seed=s.seed)
    _check_fields(loader.fields, compiled.inputs, dataset)
    plan = backend.plan(compiled, optimizer=s.optimizer.name, ranks=1, memory=config.memory)
    plan.memory.check(hint="shrink the model's sizes")
    program = backend.load(plan, config.local_devices[0])
    ckpt = trained.checkpoint
    program.start(
        s.optimizer,
        seed=s.seed,
        state=HostState(ckpt.params, ckpt.optimizer, ckpt.state["optimizer"]),
    )
    result = evaluate_batches(program, loader.eval_batches(count), compiled.target)
    if isinstance(loader, StreamLoader):  # next-token losses: perplexity means something
        perplexity = math.exp(result.loss) if result.loss < 709 else math.inf
        result = dataclasses.replace(result, perplexity=perplexity)
    return result


def _data_set(trained: Any, name: str | None) -> Any:
    from sexpgpu.lang.suggest import options_hint

    data = trained.experiment.data
    if name is None:
        return data[trained.run.data]
    if name not in data:
        raise SexpgpuError(
            "E-CLI-001",
            f"--data {name}: the experiment defines no data set `{name}`",
            "--data",
            hint=options_hint(name, data, "data sets"),
        )
    return data[name]


def _check_fields(
    fields: Mapping[str, tuple[tuple[int, ...], str]],
    inputs: Mapping[str, tuple[tuple[int, ...], str]],
    data: Any,
) -> None:
    """E-DATA-008 unless the data set gives every field the run's graphs read, as they read it."""
    for key, (shape, dtype) in inputs.items():
        got = fields.get(key)
        if got is None or tuple(got[0]) != tuple(shape) or got[1] != dtype:
            found = "no field" if got is None else f"{got[1]} {list(got[0])}"
            raise SexpgpuError(
                "E-DATA-008",
                f"data set `{data.name}` does not fit the run: field `{key}` is {found}, "
                f"the model reads {dtype} {list(shape)}",
                data.span or data.name,
                hint="evaluate on a data set of the fields and :seq the run trained on",
            )
