"""``defrun``: a training run's settings, each read by the entry of `RUN_KEYS` for its key.

Optimizers, schedules, diagnostics and reducers are tables keyed by the
names users type (`OPTIMIZERS`, `SCHEDULES`, `DIAGNOSTICS`, `REDUCERS`):
the one place these names, their options and defaults are defined. Each
option names how it is read and its default (`REQUIRED` when it has none).
Option names reach `OptimizerSpec.options` and `ScheduleSpec.options` with
underscores (``weight-decay`` becomes ``weight_decay``), every default
filled in, so execution (`sexpgpu.devices.optim`, `sexpgpu.train`) keeps
implementations keyed by the same names and checks nothing again
(tests/test_names.py holds the two sides together).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang.definitions import (
    CheckpointSpec,
    DiagnosticSpec,
    EvalSpec,
    OptimizerSpec,
    RunDef,
    ScheduleSpec,
)
from sexpgpu.lang.forms import Builder, form_name, keyword_args, require_keys, special_form
from sexpgpu.lang.suggest import options_hint
from sexpgpu.lang.syntax import ListNode, Node, Symbol, Vector, describe
from sexpgpu.lang.values import Value, boolean, choice, integer, number, string

__all__ = [
    "DIAGNOSTICS",
    "LOGGERS",
    "OPTIMIZERS",
    "REDUCERS",
    "REQUIRED",
    "RUN_KEYS",
    "SCHEDULES",
    "Option",
    "RunKey",
    "optimizer_spec",
    "run_key",
    "schedule_spec",
]

REQUIRED = object()
REDUCERS = ("mean", "max", "min", "sum")
# What `:log` and `--log` name: TensorBoard event files, W&B (offline without a key).
LOGGERS = ("tensorboard", "wandb")
EVAL_BATCHES = 10

Env = Mapping[str, Value]


@dataclass(frozen=True)
class Option:
    """An option of an optimizer, schedule or diagnostic: how to read it, its default."""

    read: Callable[[Node, Env, str], Any]
    default: Any = REQUIRED


def _positive(node: Node, env: Env, what: str) -> float:
    return number(node, env, what, low=0.0, open_low=True)


def _non_negative(node: Node, env: Env, what: str) -> float:
    return number(node, env, what, low=0.0)


def _fraction(node: Node, env: Env, what: str) -> float:
    return number(node, env, what, low=0.0, high=1.0)


def _steps(node: Node, env: Env, what: str) -> int:
    return integer(node, env, what, minimum=0)


def _every(node: Node, env: Env, what: str) -> int:
    return integer(node, env, what, minimum=1)


def _reducer(node: Node, env: Env, what: str) -> str:
    return choice(node, env, what, REDUCERS)


def _betas(node: Node, env: Env, what: str) -> tuple[float, float]:
    if not isinstance(node, Vector) or len(node.items) != 2:
        raise SexpgpuError(
            "E-FORM-005",
            f"{what} must be a vector of two numbers, found {describe(node)}",
            node.span,
            hint="write :betas [0.9 0.999]",
        )
    b1, b2 = (number(item, env, what, low=0.0, high=1.0) for item in node.items)
    return (b1, b2)


OPTIMIZERS: dict[str, dict[str, Option]] = {
    "sgd": {
        "lr": Option(_positive),
        "momentum": Option(_fraction, 0.0),
        "nesterov": Option(boolean, False),
    },
    "adamw": {
        "lr": Option(_positive),
        "betas": Option(_betas, (0.9, 0.999)),
        "eps": Option(_positive, 1e-8),
        "weight-decay": Option(_non_negative, 0.0),
    },
    # Muon on hidden matrices, AdamW (at :adamw-lr) on the rest: docs/training.md.
    "muon": {
        "lr": Option(_positive),
        "momentum": Option(_fraction, 0.95),
        "nesterov": Option(boolean, True),
        "ns-steps": Option(_every, 5),
        "adamw-lr": Option(_positive, 1e-3),
        "betas": Option(_betas, (0.9, 0.95)),
        "eps": Option(_positive, 1e-8),
        "weight-decay": Option(_non_negative, 0.0),
    },
}

_DECAY = {"warmup": Option(_steps, 0), "floor": Option(_fraction, 0.0)}
SCHEDULES: dict[str, dict[str, Option]] = {"constant": {}, "cosine": _DECAY, "linear": _DECAY}

_SAMPLED = {"every": Option(_every, 1), "reduce": Option(_reducer, "mean")}
DIAGNOSTICS: dict[str, dict[str, Option]] = {"grad-norm": _SAMPLED, "activation-rms": _SAMPLED}


def _call(
    node: Node, table: dict[str, dict[str, Option]], env: Env, what: str, kind: str
) -> tuple[str, dict[str, Any]]:
    """Read ``(NAME :option value...)`` against `table`; defaults filled in."""
    usage = " ".join(f"({name})" for name in table)
    if not (isinstance(node, ListNode) and node.items and isinstance(node.items[0], Symbol)):
        name = node.name if isinstance(node, Symbol) else ""
        hint = f"write ({name} ...)" if name in table else f"{kind}: {usage}"
        raise SexpgpuError(
            "E-FORM-005", f"{what} must be a call, found {describe(node)}", node.span, hint=hint
        )
    head = node.items[0]
    options = table.get(head.name)
    if options is None:
        raise SexpgpuError(
            "E-FORM-006",
            f"unknown {kind[:-1]} `{head.name}` in {what}",
            head.span,
            hint=options_hint(head.name, table, kind),
        )
    where = f"({head.name} ...)"
    args = keyword_args(node.items[1:], options, where)
    values: dict[str, Any] = {}
    for key, option in options.items():
        if key in args:
            value = option.read(args[key][1], env, f"`:{key}` of {where}")
        elif option.default is REQUIRED:
            raise SexpgpuError(
                "E-FORM-003", f"{where} needs `:{key}`", node.span, hint=f"add :{key} VALUE"
            )
        else:
            value = option.default
        values[key.replace("-", "_")] = value
    return head.name, values


def _filled(table: dict[str, dict[str, Option]], kind: str, name: str, given: Any) -> Any:
    """`given` (underscored option names) with the defaults of `table[name]` filled in."""
    options = table.get(name)
    if options is None:
        hint = options_hint(name, table, f"{kind}s")
        raise SexpgpuError("E-FORM-006", f"unknown {kind} `{name}`", hint=hint)
    keys = {key.replace("-", "_"): option for key, option in options.items()}
    for key in given:
        if key not in keys:
            hint = options_hint(key, keys, "options")
            raise SexpgpuError("E-FORM-003", f"{name} takes no option `{key}`", hint=hint)
    values = {}
    for key, option in keys.items():
        if key not in given and option.default is REQUIRED:
            raise SexpgpuError("E-FORM-003", f"{name} needs `{key}`", hint=f"give {key}=VALUE")
        values[key] = given.get(key, option.default)
    return MappingProxyType(values)


def optimizer_spec(name: str, **options: Any) -> OptimizerSpec:
    """The `OptimizerSpec` ``(name :option value...)`` reads to, made from Python.

    Option names use underscores; defaults come from `OPTIMIZERS`. Values are
    taken as given (the reader checks the ranges of what a file writes).
    """
    return OptimizerSpec(name, _filled(OPTIMIZERS, "optimizer", name, options))


def schedule_spec(name: str = "constant", **options: Any) -> ScheduleSpec:
    """The `ScheduleSpec` ``(name :option value...)`` reads to, made from Python."""
    return ScheduleSpec(name, _filled(SCHEDULES, "schedule", name, options))


# -- run keys ---------------------------------------------------------------------


@dataclass(frozen=True)
class RunKey:
    """A key of defrun: its reader and its default (`REQUIRED` when it has none)."""

    name: str
    read: Callable[[Node, Builder, str], Any]
    default: Any = REQUIRED


RUN_KEYS: dict[str, RunKey] = {}


def run_key(name: str, default: Any = REQUIRED):
    """Register the decorated reader as the defrun key `:name`."""

    def register(read: Callable[[Node, Builder, str], Any]):
        RUN_KEYS[name] = RunKey(name, read, default)
        return read

    return register


def _defined(node: Node, table: Mapping[str, Any], builder: Builder, what: str, kind: str) -> str:
    if not isinstance(node, Symbol):
        raise SexpgpuError(
            "E-FORM-005",
            f"{what} must name a {kind}, found {describe(node)}",
            node.span,
            hint=options_hint("", table, f"{kind}s"),
        )
    if node.name not in table:
        other = builder.names.get(node.name)
        hint = options_hint(node.name, table, f"{kind}s")
        if other is not None:
            hint = f"`{node.name}` is a {other[0]}; {hint}"
        raise SexpgpuError("E-FORM-006", f"unknown {kind} `{node.name}`", node.span, hint=hint)
    return node.name


@run_key("model")
def _model(node: Node, builder: Builder, what: str) -> str:
    return _defined(node, builder.models, builder, what, "model")


@run_key("data")
def _data(node: Node, builder: Builder, what: str) -> str:
    return _defined(node, builder.data, builder, what, "data set")


@run_key("loss")
def _loss(node: Node, builder: Builder, what: str) -> Node:
    if not isinstance(node, ListNode) or not node.items:
        raise SexpgpuError(
            "E-FORM-005",
            f"{what} must be a call, found {describe(node)}",
            node.span,
            hint="write :loss (cross-entropy (MODEL INPUT) TARGET)",
        )
    return node  # traced later, with the model


@run_key("optimizer")
def _optimizer(node: Node, builder: Builder, what: str) -> OptimizerSpec:
    name, options = _call(node, OPTIMIZERS, builder.params, what, "optimizers")
    return OptimizerSpec(name, MappingProxyType(options), node.span)


@run_key("schedule", default=schedule_spec())
def _schedule(node: Node, builder: Builder, what: str) -> ScheduleSpec:
    name, options = _call(node, SCHEDULES, builder.params, what, "schedules")
    return ScheduleSpec(name, MappingProxyType(options), node.span)


@run_key("clip", default=None)
def _clip(node: Node, builder: Builder, what: str) -> float:
    return _positive(node, builder.params, what)


@run_key("batch")
def _batch(node: Node, builder: Builder, what: str) -> int:
    return integer(node, builder.params, what)


@run_key("microbatches", default=1)
def _microbatches(node: Node, builder: Builder, what: str) -> int:
    return integer(node, builder.params, what)


@run_key("steps")
def _steps_key(node: Node, builder: Builder, what: str) -> int:
    return integer(node, builder.params, what)


@run_key("dtype", default="f32")
def _dtype(node: Node, builder: Builder, what: str) -> str:
    return choice(node, builder.params, what, ("f32", "bf16"))


@run_key("seed", default=0)
def _seed(node: Node, builder: Builder, what: str) -> int:
    return integer(node, builder.params, what, minimum=0)


def _every_call(node: Node, what: str, usage: str, builder: Builder) -> tuple[int, tuple]:
    """Read ``(every N rest...)``: N and the remaining items."""
    ok = isinstance(node, ListNode) and len(node.items) >= 2
    if not ok or node.items[0] != Symbol("every", node.span):
        raise SexpgpuError(
            "E-FORM-005", f"{what} must be {usage}, found {describe(node)}", node.span,
            hint=f"write {usage}",
        )  # fmt: skip
    return integer(node.items[1], builder.params, f"N of {what}"), node.items[2:]


@run_key("eval", default=None)
def _eval(node: Node, builder: Builder, what: str) -> EvalSpec:
    every, rest = _every_call(node, what, "(every N :batches M)", builder)
    args = keyword_args(rest, ("batches",), what)
    batches = EVAL_BATCHES
    if "batches" in args:
        batches = integer(args["batches"][1], builder.params, f"`:batches` of {what}")
    return EvalSpec(every, batches, node.span)


@run_key("checkpoint", default=None)
def _checkpoint(node: Node, builder: Builder, what: str) -> CheckpointSpec:
    usage = '(every N "LOCATION")'
    every, rest = _every_call(node, what, usage, builder)
    if len(rest) != 1:
        raise SexpgpuError(
            "E-FORM-002",
            f"{what} takes N and one location, found {len(rest)} items after N",
            node.span,
            hint=f'write {usage}, e.g. (every 1000 "checkpoints")',
        )
    location = string(rest[0], builder.params, f"the location of {what}")
    if not location:
        raise SexpgpuError(
            "E-FORM-005", f"the location of {what} is empty", rest[0].span,
            hint='name a folder such as "checkpoints" or "s3://bucket/run"',
        )  # fmt: skip
    return CheckpointSpec(every, location, node.span)


@run_key("diagnostics", default=())
def _diagnostics(node: Node, builder: Builder, what: str) -> tuple[DiagnosticSpec, ...]:
    if not isinstance(node, ListNode | Vector):
        raise SexpgpuError(
            "E-FORM-005",
            f"{what} must be a list of diagnostics, found {describe(node)}",
            node.span,
            hint="write :diagnostics ((grad-norm :every 10))",
        )
    specs: list[DiagnosticSpec] = []
    for item in node.items:
        name, options = _call(item, DIAGNOSTICS, builder.params, what, "diagnostics")
        if any(spec.name == name for spec in specs):
            raise SexpgpuError(
                "E-FORM-004",
                f"diagnostic `{name}` is asked for twice in {what}",
                item.span,
                hint="keep one",
            )
        specs.append(DiagnosticSpec(name, options["every"], options["reduce"], item.span))
    return tuple(specs)


@run_key("log", default=())
def _log(node: Node, builder: Builder, what: str) -> tuple[str, ...]:
    items = node.items if isinstance(node, Vector) else [node]
    names: list[str] = []
    for item in items:
        if not isinstance(item, Symbol) or item.name not in LOGGERS:
            found = item.name if isinstance(item, Symbol) else describe(item)
            raise SexpgpuError(
                "E-FORM-006",
                f"{what}: unknown logger {found}",
                item.span,
                hint=f"loggers: {', '.join(LOGGERS)}; write :log [tensorboard]",
            )
        if item.name in names:
            raise SexpgpuError(
                "E-FORM-004", f"logger `{item.name}` is named twice in {what}", item.span,
                hint="name each logger once",
            )  # fmt: skip
        names.append(item.name)
    return tuple(names)


_REQUIRED_KEYS = tuple(key for key, spec in RUN_KEYS.items() if spec.default is REQUIRED)


@special_form("defrun", 2, "(defrun NAME :model M :data D :loss L :optimizer O ...)")
def _defrun(form: ListNode, builder: Builder) -> None:
    name = form_name(form, "run", "(defrun NAME :key value...)")
    where = f"run `{name.name}`"
    args = keyword_args(form.items[2:], RUN_KEYS, where)
    require_keys(args, _REQUIRED_KEYS, form, where)
    values = {}
    for key, spec in RUN_KEYS.items():
        if key in args:
            values[key] = spec.read(args[key][1], builder, f"`:{key}` of {where}")
        else:
            values[key] = spec.default
    _check_inputs(values["model"], values["data"], args["model"][1], builder)
    data = builder.data[values["data"]]
    if values["eval"] is not None and data.eval is None and data.options["split"] >= 1.0:
        raise SexpgpuError(
            "E-FORM-005",
            f"{where} evaluates, but data `{values['data']}` keeps nothing for evaluation",
            args["eval"][1].span,
            hint="give the data a :split below 1 (e.g. :split 0.9) or an :eval source, "
            "or drop :eval",
        )
    builder.runs[builder.claim(name, "run")] = RunDef(name=name.name, span=form.span, **values)


def _check_inputs(model: str, data: str, node: Node, builder: Builder) -> None:
    """Every input of the model must be a field the data yields."""
    fields = builder.data[data].fields
    for symbol in builder.models[model].inputs:
        if symbol.name not in fields:
            raise SexpgpuError(
                "E-FORM-006",
                f"model `{model}` takes `{symbol.name}`, which data `{data}` does not yield",
                node.span,
                hint=f"data `{data}` yields {', '.join(fields)}; "
                f"name the model's inputs after them",
            )
