"""What the top-level forms define: frozen dataclasses with plain values.

Settings are evaluated (``:batch batch`` is 8 here); model bodies and the loss
stay syntax for the tracer. Mappings are read-only views. Every definition
keeps the span of its form; `span` defaults to None only so that other
layers can build a definition in their tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sexpgpu.errors import Span
from sexpgpu.lang.syntax import Node, Symbol

__all__ = [
    "CheckpointSpec",
    "DataDef",
    "DiagnosticSpec",
    "EvalSpec",
    "FnDef",
    "ModelDef",
    "OptimizerSpec",
    "RunDef",
    "ScheduleSpec",
]

DataKind = Literal["bytes", "tokens", "arrays", "digits", "python-stdlib"]


@dataclass(frozen=True)
class DataDef:
    """``(defdata NAME SOURCE :key value...)``.

    Attributes
    ----------
    name
        The data set's name.
    kind
        The source: bytes, tokens, arrays, digits or python-stdlib.
    path
        The source's file, resolved relative to the experiment file; None for
        digits and python-stdlib.
    options
        Every option with its default filled in: ``fields`` (tuple of the
        field names each microbatch yields), ``split`` (float, the share kept
        for training), ``seq`` (int, stream sources), ``dtype`` ("u16" or
        "u32", tokens).
    eval
        The separate evaluation source of ``:eval``, with the same fields
        (and ``:seq``), or None: the run then evaluates on the split's rest.
    """

    name: str
    kind: DataKind
    path: Path | None
    options: Mapping[str, Any]
    span: Span | None = None
    eval: DataDef | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """The names of the arrays each microbatch holds (``tokens``, ``next``...)."""
        return self.options["fields"]


@dataclass(frozen=True)
class FnDef:
    """``(defn NAME (args) body)``: a model fragment; `body` is unevaluated syntax."""

    name: str
    args: tuple[Symbol, ...]
    body: Node
    span: Span | None = None


@dataclass(frozen=True)
class ModelDef:
    """``(defmodel NAME (inputs) body)``: inputs are data fields; `body` is syntax."""

    name: str
    inputs: tuple[Symbol, ...]
    body: Node
    span: Span | None = None


@dataclass(frozen=True)
class OptimizerSpec:
    """``(adamw :lr 6e-4 ...)``: `options` holds every option, defaults filled in.

    sgd: lr, momentum (0.0), nesterov (False).
    adamw: lr, betas ((0.9, 0.999)), eps (1e-8), weight_decay (0.0).
    Option names use underscores (``weight-decay`` becomes ``weight_decay``).
    """

    name: str
    options: Mapping[str, Any]
    span: Span | None = None


@dataclass(frozen=True)
class ScheduleSpec:
    """``(cosine :warmup 100 :floor 0.1)``; constant has no options, the others
    warmup (int steps, 0) and floor (fraction of the peak rate, 0.0)."""

    name: str
    options: Mapping[str, Any]
    span: Span | None = None


@dataclass(frozen=True)
class EvalSpec:
    """``(every N :batches M)``: evaluate M batches every N steps."""

    every: int
    batches: int
    span: Span | None = None


@dataclass(frozen=True)
class CheckpointSpec:
    """``(every N LOCATION)``: relative locations live inside the run directory."""

    every: int
    location: str
    span: Span | None = None


@dataclass(frozen=True)
class DiagnosticSpec:
    """``(grad-norm :every 10)``: sample every N steps, fold across ranks by `reduce`."""

    name: str
    every: int
    reduce: str
    span: Span | None = None


@dataclass(frozen=True)
class RunDef:
    """``(defrun NAME :key value...)`` with every setting evaluated.

    `model` and `data` name definitions of the same experiment; `loss` is the
    unevaluated loss expression; `clip` is None without clipping; `eval` and
    `checkpoint` are None when not asked for; `log` names the loggers that
    mirror the metrics (``:log [tensorboard wandb]``).
    """

    name: str
    model: str
    data: str
    loss: Node
    optimizer: OptimizerSpec
    schedule: ScheduleSpec
    clip: float | None
    batch: int
    microbatches: int
    steps: int
    dtype: Literal["f32", "bf16"]
    seed: int
    eval: EvalSpec | None
    checkpoint: CheckpointSpec | None
    diagnostics: tuple[DiagnosticSpec, ...]
    log: tuple[str, ...] = ()
    span: Span | None = None
