"""Tracing: a run's loss expression and model, walked into IR nodes.

`trace_run` evaluates the run's ``:loss`` with the data fields bound to INPUT
nodes; calling the model evaluates its body, calling a ``defn`` evaluates
the function's body with fresh parameters, and every other call goes to the
vocabulary (`sexpgpu.ir.vocabulary`). Four forms are special because they
take unevaluated syntax: ``let``, ``->``, ``repeat`` and ``param``.

Parameter names
---------------
A parameter's name is a path: the model's name, then one segment per call
that owns parameters (a ``defn`` call or a layer such as ``linear``), then
the parameter's own name (``gpt/block.3/attention/wq``). Inside one path,
each name keeps a counter: the first call of ``linear`` is ``linear``, later
ones ``linear.1``, ``linear.2``...; the applications of ``repeat`` are always
numbered (``block.0`` ... ``block.11``). A ``param`` bound directly by ``let``
takes the binding's name (``gpt/wte``); an unbound one is ``param``,
``param.1``... Layers name their own parameters (``weight``, ``bias``,
``wq``...). Calling the model twice reuses its parameters.

Scoping is lexical: a ``defn`` body sees its arguments and the experiment's
parameters (``width``), not its caller's ``let`` names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sexpgpu.errors import SexpgpuError, Span
from sexpgpu.ir import builder as b
from sexpgpu.ir.counter_rng import KEY_FIELD, salt_of
from sexpgpu.ir.dtypes import FLOATS, DType
from sexpgpu.ir.node import Node
from sexpgpu.ir.shape_rules import format_shape
from sexpgpu.ir.trace_call import Call, Value, describe_value
from sexpgpu.ir.trace_data import field_specs
from sexpgpu.ir.trace_init import INITIALIZERS, Init
from sexpgpu.ir.trace_special import SPECIAL_FORMS, initializer, unknown_function_hint
from sexpgpu.ir.vocabulary import VOCABULARY, Entry
from sexpgpu.lang import (
    Experiment,
    FnDef,
    Keyword,
    ListNode,
    Literal,
    ModelDef,
    RunDef,
    Symbol,
    unparse,
)
from sexpgpu.lang import Node as Syntax
from sexpgpu.lang.suggest import options_hint

__all__ = ["MAX_CALLS", "ParamSpec", "Scope", "Trace", "trace_run"]

log = logging.getLogger(__name__)

Env = Mapping[str, Value]
_MAX_DEPTH = 48  # defn and model calls inside one another
# Calls one trace may make in all (a 96-layer GPT makes about 3,000): past it a
# `repeat` of 10^9, a `layers` of 2^16 or a defn fan-out of 2^40 stops at once
# instead of building a graph no check or run could finish.
MAX_CALLS = 10_000


@dataclass
class Scope:
    """A path prefix for parameter names and the counters of the names used under it."""

    path: str
    counters: dict[str, int] = field(default_factory=dict)

    def claim(self, name: str, numbered: bool = False) -> str:
        """The next free path for `name` here: ``path/name``, then ``path/name.1``..."""
        k = self.counters.get(name, 0)
        self.counters[name] = k + 1
        return f"{self.path}/{name if k == 0 and not numbered else f'{name}.{k}'}"


@dataclass(frozen=True)
class ParamSpec:
    """A parameter the trace made: its path name, shape, initializer and source."""

    name: str
    shape: tuple[int, ...]
    init: Init
    span: Span | None = None


@dataclass(frozen=True)
class Trace:
    """The traced forward program of one run.

    Attributes
    ----------
    loss
        The f32 scalar loss of one microbatch.
    output
        The model's result (f32) in the first model call of the loss, or None.
    inputs
        Data field -> INPUT node (every field of the data set).
    params
        Path name -> `ParamSpec`, in creation order.
    param_nodes
        Path name -> PARAM node (always f32; bf16 runs cast at each use).
    dtype
        The run's compute dtype.
    activations
        Path -> the float result of each call that owns parameters (a defn
        or a layer, ``gpt/block.3/attention``) and of the model (``gpt``):
        what the activation-RMS diagnostic samples.
    key
        The INPUT node of the microbatch's random key (`KEY_FIELD`), when a
        random op (dropout) reads it; else None.
    train_only
        (node, identity) pairs: values of the training graph that evaluation
        replaces (a dropout's result by its operand).
    """

    loss: Node
    output: Node | None
    inputs: Mapping[str, Node]
    params: Mapping[str, ParamSpec]
    param_nodes: Mapping[str, Node]
    dtype: DType
    activations: Mapping[str, Node] = field(default_factory=dict)
    key: Node | None = None
    train_only: tuple[tuple[Node, Node], ...] = ()


def trace_run(experiment: Experiment, run: RunDef) -> Trace:
    """Trace `run`'s loss (and through it the model) into IR nodes.

    Parameters
    ----------
    experiment
        The loaded experiment (variant applied).
    run
        One of its runs: the loss, data set, batch and dtype come from it.

    Raises
    ------
    SexpgpuError
        E-TRACE-* for calls that do not fit the vocabulary, E-SHAPE-* for
        shapes and dtypes that do not fit an operation, at the user's span.
    """
    tracer = _Tracer(experiment, DType(run.dtype))
    data = experiment.data[run.data]
    inputs: dict[str, Node] = {}
    env: dict[str, Value] = {}
    for name, (shape, dtype) in field_specs(data, run.batch).items():
        inputs[name] = b.input(name, shape, dtype, span=data.span)
        env[name] = tracer.compute_dtype(inputs[name], data.span)
    try:
        loss = tracer.eval(run.loss, env, Scope(run.name))
    except RecursionError:
        raise SexpgpuError(
            "E-TRACE-007",
            "the model's expressions nest too deeply to trace",
            run.loss.span,
            "split deep expressions with let, or use (repeat x n f) for stacks",
        ) from None
    loss = tracer.check_loss(loss, run.loss.span)
    output = tracer.model_output
    if output is not None and output.dtype != DType.F32 and output.dtype in FLOATS:
        output = b.cast(output, DType.F32, span=output.span)
    log.debug("traced %s: %d parameters", run.name, len(tracer.params))
    return Trace(
        loss,
        output,
        inputs,
        dict(tracer.params),
        dict(tracer.param_nodes),
        tracer.dtype,
        dict(tracer.activations),
        tracer.key,
        tuple(tracer.train_only),
    )


class _Tracer:
    """The walk: evaluates syntax to traced values, making IR nodes as it goes."""

    def __init__(self, experiment: Experiment, dtype: DType) -> None:
        self.experiment = experiment
        self.dtype = dtype
        self.params: dict[str, ParamSpec] = {}
        self.param_nodes: dict[str, Node] = {}
        self.model_output: Node | None = None
        self.activations: dict[str, Node] = {}
        self.key: Node | None = None
        self.train_only: list[tuple[Node, Node]] = []
        self.depth = 0
        self.calls = 0

    # ------------------------------------------------------------ values

    def eval(self, node: Syntax, env: Env, scope: Scope, name: str | None = None) -> Value:
        """The value of syntax `node`; `name` is the let name binding it, if any."""
        if isinstance(node, Symbol):
            return self.lookup(node, env)
        if isinstance(node, ListNode):
            if not node.items or not isinstance(node.items[0], Symbol):
                raise SexpgpuError(
                    "E-TRACE-001",
                    "expected a call such as (linear x 10), found "
                    + ("()" if not node.items else unparse(node)),
                    node.span,
                    "a list is a call: its first item names the function",
                )
            head = node.items[0]
            return self.call(head, node.items[1:], node.span, env, scope, name=name)
        if isinstance(node, Keyword):
            raise SexpgpuError(
                "E-TRACE-004",
                f"keyword `:{node.name}` outside a call's arguments",
                node.span,
                "keywords name arguments: (softmax x :axis -1)",
            )
        if isinstance(node, Literal):
            return node.value
        return tuple(self.eval(item, env, scope) for item in node.items)  # a vector

    def lookup(self, symbol: Symbol, env: Env) -> Value:
        """A bound name: a local (let, argument, data field), then an experiment parameter."""
        if symbol.name in env:
            return env[symbol.name]
        if symbol.name in self.experiment.params:
            return self.experiment.params[symbol.name]
        if self.is_function(symbol.name):
            raise SexpgpuError(
                "E-TRACE-002",
                f"`{symbol.name}` is a function, not a value",
                symbol.span,
                f"call it: ({symbol.name} ...), or thread a value through it with ->",
            )
        raise SexpgpuError(
            "E-TRACE-002",
            f"unknown name `{symbol.name}`",
            symbol.span,
            options_hint(symbol.name, [*env, *self.experiment.params], "names in scope"),
        )

    def is_function(self, name: str) -> bool:
        """Whether `name` is callable: a special form, defn, model or vocabulary entry."""
        return (
            name in SPECIAL_FORMS
            or name in self.experiment.functions
            or name in self.experiment.models
            or name in VOCABULARY
        )

    def compute_dtype(self, value: Node, span: Span | None) -> Node:
        """Float values in the run's dtype (bf16 runs cast f32 inputs and parameters)."""
        if value.dtype in FLOATS and value.dtype != self.dtype:
            return b.cast(value, self.dtype, span=span)
        return value

    def check_loss(self, loss: Value, span: Span) -> Node:
        """The loss as an f32 scalar node, or E-TRACE-006."""
        if not isinstance(loss, Node) or loss.shape != () or loss.dtype not in FLOATS:
            found = describe_value(loss)
            raise SexpgpuError(
                "E-TRACE-006",
                f"the loss must be a float scalar, found {found}",
                span,
                "reduce it, e.g. (mean ...) or (cross-entropy logits targets)",
            )
        return loss if loss.dtype == DType.F32 else b.cast(loss, DType.F32, span=span)

    # ------------------------------------------------------------ calls

    def call(
        self,
        head: Symbol,
        items: Sequence[Syntax],
        span: Span,
        env: Env,
        scope: Scope,
        leading: Sequence[tuple[Value, Span]] = (),
        numbered: bool = False,
        name: str | None = None,
    ) -> Value:
        """Call `head` with the syntax `items`, after the already evaluated `leading` values.

        `numbered` asks a call that owns parameters for a numbered path
        segment (``repeat``); `name` is the let name the result is bound to.
        """
        fn = head.name
        self.calls += 1
        if self.calls > MAX_CALLS:
            raise SexpgpuError(
                "E-TRACE-008",
                f"the model expands to more than {MAX_CALLS:,} calls (at `{fn}`)",
                span,
                "a repeat count, a number of layers or a defn called many times over is "
                "too large; check the parameters that set them",
            )
        if fn in SPECIAL_FORMS:
            return SPECIAL_FORMS[fn](self, head, items, span, env, scope, leading, name)
        if fn in self.experiment.functions:
            definition = self.experiment.functions[fn]
            args = self.positional(definition, items, span, env, scope, leading)
            path = scope.claim(fn, numbered)
            return self.record(path, self.apply_defn(definition, args, span, path))
        if fn in self.experiment.models:
            model = self.experiment.models[fn]
            args = self.positional(model, items, span, env, scope, leading)
            return self.apply_model(model, args, span)
        if fn in VOCABULARY:
            entry = VOCABULARY[fn]
            cx = self.arguments(entry, items, span, env, scope, leading)
            if not entry.layer:
                return entry.fn(cx)
            path = scope.claim(fn, numbered)
            cx.make_param = lambda pname, shape, init, at: self.make_param(
                f"{path}/{pname}", shape, init, at
            )
            cx.random_key = lambda: (self.random_key(span), salt_of(path))
            cx.train_only = self.mark_train_only
            return self.record(path, entry.fn(cx))
        raise SexpgpuError(
            "E-TRACE-001",
            f"unknown function `{fn}`",
            head.span,
            unknown_function_hint(fn, self.experiment),
        )

    def positional(
        self,
        definition: FnDef | ModelDef,
        items: Sequence[Syntax],
        span: Span,
        env: Env,
        scope: Scope,
        leading: Sequence[tuple[Value, Span]],
    ) -> list[Value]:
        """The arguments of a defn or model call: positional only, as many as it declares."""
        params = definition.args if isinstance(definition, FnDef) else definition.inputs
        for item in items:
            if isinstance(item, Keyword):
                raise SexpgpuError(
                    "E-TRACE-003",
                    f"`{definition.name}` takes no keyword arguments, found `:{item.name}`",
                    item.span,
                    f"call it as ({definition.name} {' '.join(p.name for p in params)})",
                )
        values = [v for v, _ in leading] + [self.eval(item, env, scope) for item in items]
        if len(values) != len(params):
            raise SexpgpuError(
                "E-TRACE-003",
                f"`{definition.name}` takes {len(params)} argument"
                f"{'s' if len(params) != 1 else ''}, found {len(values)}",
                span,
                f"call it as ({definition.name} {' '.join(p.name for p in params)})",
            )
        return values

    def apply_defn(self, fn: FnDef, args: Sequence[Value], span: Span, path: str) -> Value:
        """Evaluate a defn's body with its arguments bound, under path `path`."""
        env = {p.name: v for p, v in zip(fn.args, args, strict=True)}
        return self.nested(fn.name, span, lambda: self.eval(fn.body, env, Scope(path)))

    def apply_model(self, model: ModelDef, args: Sequence[Value], span: Span) -> Value:
        """Evaluate the model's body; its parameters live under the model's name."""
        env = {p.name: v for p, v in zip(model.inputs, args, strict=True)}
        out = self.nested(model.name, span, lambda: self.eval(model.body, env, Scope(model.name)))
        if self.model_output is None and isinstance(out, Node):
            self.model_output = out
        return self.record(model.name, out)

    def record(self, path: str, value: Value) -> Value:
        """Keep a call's float tensor result as the activation at `path`."""
        if isinstance(value, Node) and value.dtype in FLOATS:
            self.activations.setdefault(path, value)
        return value

    def nested(self, name: str, span: Span, thunk: Callable[[], Value]) -> Value:
        """``thunk()`` one call level deeper, or E-TRACE-007 past `_MAX_DEPTH` levels."""
        self.depth += 1
        try:
            if self.depth > _MAX_DEPTH:
                raise SexpgpuError(
                    "E-TRACE-007",
                    f"calls nest deeper than {_MAX_DEPTH} levels (in `{name}`)",
                    span,
                    "a defn calls itself without end; use (repeat x n f) for a stack of layers",
                )
            return thunk()
        finally:
            self.depth -= 1

    def arguments(
        self,
        entry: Entry,
        items: Sequence[Syntax],
        span: Span,
        env: Env,
        scope: Scope,
        leading: Sequence[tuple[Value, Span]],
    ) -> Call:
        """Evaluate a vocabulary call's arguments into a `Call`, checking counts and keywords."""
        cx = Call(
            entry.name, span, [v for v, _ in leading], [s for _, s in leading], dtype=self.dtype
        )
        i = 0
        while i < len(items):
            item = items[i]
            if isinstance(item, Keyword):
                key = self.keyword(entry, item, items, i, cx)
                value_node = items[i + 1]
                cx.kwargs[key] = self.keyword_value(entry, key, value_node, env, scope)
                cx.kw_spans[key] = value_node.span
                i += 2
                continue
            cx.arg_texts[len(cx.args)] = unparse(item)
            cx.args.append(self.eval(item, env, scope))
            cx.arg_spans.append(item.span)
            i += 1
        _check_count(entry, len(cx.args), span)
        for key, default in entry.keywords.items():
            cx.kwargs.setdefault(key, default)
        return cx

    def keyword(
        self, entry: Entry, item: Keyword, items: Sequence[Syntax], i: int, cx: Call
    ) -> str:
        """Keyword `item` (``items[i]``) checked: known to `entry`, given once, with a value."""
        if item.name not in entry.keywords:
            raise SexpgpuError(
                "E-TRACE-003",
                f"`{entry.name}` has no keyword `:{item.name}`",
                item.span,
                options_hint(item.name, entry.keywords, "keywords", prefix=":")
                if entry.keywords
                else f"usage: {entry.usage}",
            )
        if item.name in cx.kwargs:
            raise SexpgpuError(
                "E-TRACE-003",
                f"keyword `:{item.name}` given twice",
                item.span,
                "give each keyword once",
            )
        if i + 1 >= len(items) or isinstance(items[i + 1], Keyword):
            raise SexpgpuError(
                "E-TRACE-003",
                f"keyword `:{item.name}` has no value",
                item.span,
                f"usage: {entry.usage}",
            )
        return item.name

    def keyword_value(self, entry: Entry, key: str, node: Syntax, env: Env, scope: Scope) -> Value:
        """A keyword's value; a quoted keyword takes an unbound bare symbol as its name.

        ``:init`` takes an initializer (``xavier``, ``(normal 0.02)``), as `param` does.
        """
        if key == "init":
            return initializer(self, node, env, scope, entry.name)
        if (
            key in entry.quoted
            and isinstance(node, Symbol)
            and node.name not in env
            and node.name not in self.experiment.params
        ):
            return node.name
        return self.eval(node, env, scope)

    # ------------------------------------------------------------ random ops

    def random_key(self, span: Span) -> Node:
        """The microbatch's random key: an int32 INPUT the loader feeds (made once)."""
        if self.key is None:
            self.key = b.input(KEY_FIELD, (), DType.INT32, span=span)
        return self.key

    def mark_train_only(self, result: Node, identity: Node) -> Node:
        """Note that evaluation computes `identity` where training computes `result`."""
        self.train_only.append((result, identity))
        return result

    # ------------------------------------------------------------ parameters

    def make_param(self, name: str, shape: tuple[int, ...], init: Init, span: Span) -> Node:
        """The parameter `name` in the run's compute dtype (made once, reused by name)."""
        spec = self.params.get(name)
        if spec is None:
            if any(d < 1 for d in shape):
                raise SexpgpuError(
                    "E-TRACE-004",
                    f"parameter `{name}` has shape {format_shape(shape)}: sizes must be positive",
                    span,
                    "check the sizes given to the layer or param",
                )
            assert init.kind in INITIALIZERS
            self.params[name] = ParamSpec(name, shape, init, span)
            self.param_nodes[name] = b.param(name, shape, DType.F32, span=span)
        elif spec.shape != shape:
            raise SexpgpuError(
                "E-TRACE-004",
                f"parameter `{name}` is {format_shape(spec.shape)} here and "
                f"{format_shape(shape)} in an earlier call",
                span,
                "a model called twice must see inputs of the same shapes",
            )
        return self.compute_dtype(self.param_nodes[name], span)


def _check_count(entry: Entry, n: int, span: Span) -> None:
    """E-TRACE-003 unless `n` positional arguments suit `entry`."""
    if entry.min_args <= n and (entry.max_args is None or n <= entry.max_args):
        return
    if entry.min_args == entry.max_args:
        want = str(entry.min_args)
    elif entry.max_args is None:
        want = f"at least {entry.min_args}"
    else:
        want = f"{entry.min_args} to {entry.max_args}"
    raise SexpgpuError(
        "E-TRACE-003",
        f"`{entry.name}` takes {want} argument{'s' if want != '1' else ''}, found {n}",
        span,
        f"usage: {entry.usage}",
    )
