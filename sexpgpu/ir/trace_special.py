"""The special forms of model bodies: ``let``, ``->``, ``repeat``, ``param``.

They take their arguments as syntax (a binding vector, a function to apply,
an initializer), so the tracer hands them the unevaluated items. Each is a
function ``form(tracer, head, items, span, env, scope, leading, name)``
registered in `SPECIAL_FORMS` under the name users type; `leading` holds
values threaded in by ``->`` or ``repeat``, and `name` is the ``let`` name
the form's result is bound to.

=================================  ===============================================
form                               meaning
=================================  ===============================================
``(let [a e1 b e2] body)``         bind in order, each seeing the earlier ones
``(-> x f (g a) ...)``             ``(g (f x) a)``: the value goes first;
                                   a bare symbol is a call with one argument
``(repeat x n f)``                 ``f`` applied ``n`` times, fresh parameters
                                   each (``f`` a name or a partial call ``(g a)``)
``(param [shape] :init INIT)``     a parameter; INIT ``(normal std)``,
                                   ``(uniform lo hi)``, ``zeros``, ``ones``,
                                   ``xavier`` (default ``(normal 0.02)``)
=================================  ===============================================
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from typing import Any

from sexpgpu.errors import SexpgpuError, Span
from sexpgpu.ir.trace_call import Value, describe_value, is_number
from sexpgpu.ir.trace_init import INITIALIZERS, Init
from sexpgpu.ir.vocabulary import VOCABULARY
from sexpgpu.lang import Experiment, Keyword, ListNode, Symbol, Vector, unparse
from sexpgpu.lang import Node as Syntax

__all__ = ["SPECIAL_FORMS", "initializer", "unknown_function_hint"]

Leading = Sequence[tuple[Value, Span]]
Form = Callable[..., Value]
SPECIAL_FORMS: dict[str, Form] = {}

_USAGE = {
    "let": "(let [name expr ...] body)",
    "->": "(-> x f (g a) ...)",
    "repeat": "(repeat x n f)",
    "param": "(param [d ...] :init (normal 0.02))",
}
_DEFAULT_INIT = Init("normal", (0.02,))


def _special(name: str) -> Callable[[Form], Form]:
    def decorate(fn: Form) -> Form:
        SPECIAL_FORMS[name] = fn
        return fn

    return decorate


def _malformed(name: str, message: str, span: Span) -> SexpgpuError:
    return SexpgpuError("E-TRACE-005", f"{name}: {message}", span, f"usage: {_USAGE[name]}")


def _no_leading(name: str, leading: Leading, span: Span) -> None:
    if leading:
        raise _malformed(name, "cannot take a threaded value", span)


@_special("let")
def _let(tracer: Any, head: Symbol, items, span: Span, env, scope, leading, name) -> Value:
    _no_leading("let", leading, span)
    if not items or not isinstance(items[0], Vector):
        raise _malformed("let", "the bindings must be a vector [name expr ...]", span)
    bindings = items[0].items
    if len(bindings) % 2:
        raise _malformed("let", "the bindings need a name and an expression each", items[0].span)
    if len(items) < 2:
        raise _malformed("let", "the body is missing", span)
    local = dict(env)
    for target, expr in zip(bindings[::2], bindings[1::2], strict=True):
        if not isinstance(target, Symbol):
            raise _malformed("let", f"binds names, found {unparse(target)}", target.span)
        local[target.name] = tracer.eval(expr, local, scope, name=target.name)
    value: Value = ()
    for body in items[1:]:
        value = tracer.eval(body, local, scope)
    return value


def _apply(
    tracer: Any, f: Syntax, value: Value, at: Span, env, scope, numbered: bool = False
) -> Value:
    """``f`` applied to `value`: a symbol is a one-argument call, a list a partial call."""
    if isinstance(f, Symbol):
        return tracer.call(f, (), f.span, env, scope, leading=[(value, at)], numbered=numbered)
    if isinstance(f, ListNode) and f.items and isinstance(f.items[0], Symbol):
        return tracer.call(
            f.items[0], f.items[1:], f.span, env, scope, leading=[(value, at)], numbered=numbered
        )
    raise SexpgpuError(
        "E-TRACE-005",
        f"cannot apply {unparse(f)}: expected a function name or a call such as (linear 10)",
        f.span,
        "write a function name (gelu) or a call missing its first argument ((linear width))",
    )


@_special("->")
def _thread(tracer: Any, head: Symbol, items, span: Span, env, scope, leading, name) -> Value:
    if leading:
        value, at = leading[0]
        steps = items
        if len(leading) > 1:
            raise _malformed("->", "threads one value", span)
    else:
        if not items:
            raise _malformed("->", "needs a value to thread", span)
        value, at, steps = tracer.eval(items[0], env, scope), items[0].span, items[1:]
    for step in steps:
        value = _apply(tracer, step, value, at, env, scope)
        at = step.span
    return value


@_special("repeat")
def _repeat(tracer: Any, head: Symbol, items, span: Span, env, scope, leading, name) -> Value:
    args: list[tuple[Value | None, Syntax | None, Span]] = [(v, None, s) for v, s in leading]
    args += [(None, item, item.span) for item in items]
    if len(args) != 3 or any(isinstance(node, Keyword) for _, node, _ in args):
        raise _malformed("repeat", f"takes 3 arguments, found {len(args)}", span)
    (x, x_node, x_span), (_, n_node, n_span), (_, f_node, _) = args
    if x_node is not None:
        x = tracer.eval(x_node, env, scope)
    count = tracer.eval(n_node, env, scope)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise SexpgpuError(
            "E-TRACE-004",
            f"repeat: the count must be a non-negative integer, found {describe_value(count)}",
            n_span,
            "write a whole number or a parameter holding one, such as layers",
        )
    for _ in range(count):
        x = _apply(tracer, f_node, x, x_span, env, scope, numbered=True)
    return x


@_special("param")
def _param(tracer: Any, head: Symbol, items, span: Span, env, scope, leading, name) -> Value:
    _no_leading("param", leading, span)
    if not items or isinstance(items[0], Keyword):
        raise _malformed("param", "the shape is missing", span)
    shape = tracer.eval(items[0], env, scope)
    shape = shape if isinstance(shape, tuple) else (shape,)
    if not shape or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise SexpgpuError(
            "E-TRACE-004",
            f"param: the shape must be a vector of integers, found {unparse(items[0])}",
            items[0].span,
            "write a shape such as [vocab width]",
        )
    init = _DEFAULT_INIT
    rest = items[1:]
    if rest:
        if len(rest) != 2 or not isinstance(rest[0], Keyword) or rest[0].name != "init":
            raise _malformed("param", "takes a shape and :init only", rest[0].span)
        init = initializer(tracer, rest[1], env, scope)
    path = scope.claim(name or "param")
    return tracer.make_param(path, tuple(shape), init, span)


def initializer(tracer: Any, node: Syntax, env, scope, who: str = "param") -> Init:
    """An initializer from its syntax: ``zeros`` or ``(normal 0.02)`` (`who`: the form's name)."""
    if isinstance(node, Symbol):
        kind, arg_nodes = node.name, ()
    elif isinstance(node, ListNode) and node.items and isinstance(node.items[0], Symbol):
        kind, arg_nodes = node.items[0].name, node.items[1:]
    else:
        kind, arg_nodes = "", ()
    forms = "(normal std), (uniform lo hi), zeros, ones, xavier"
    if kind not in INITIALIZERS:
        close = difflib.get_close_matches(kind, INITIALIZERS, n=1)
        lead = f"did you mean `{close[0]}`? " if close else ""
        raise SexpgpuError(
            "E-TRACE-005",
            f"{who}: unknown initializer {unparse(node)}",
            node.span,
            f"{lead}initializers: {forms}",
        )
    if len(arg_nodes) != INITIALIZERS[kind]:
        raise SexpgpuError(
            "E-TRACE-005",
            f"{who}: `{kind}` takes {_count(INITIALIZERS[kind])}, found {len(arg_nodes)}",
            node.span,
            f"initializers: {forms}",
        )
    args = []
    for arg in arg_nodes:
        value = tracer.eval(arg, env, scope)
        if not is_number(value):
            raise SexpgpuError(
                "E-TRACE-004",
                f"{who}: `{kind}` takes numbers, found {describe_value(value)}",
                arg.span,
                f"initializers: {forms}",
            )
        args.append(float(value))
    _check_init(kind, args, arg_nodes, forms)
    return Init(kind, tuple(args))


def _check_init(kind: str, args: list[float], nodes: Sequence[Syntax], forms: str) -> None:
    """E-TRACE-005 at the argument of an initializer that draws nothing sensible."""
    for value, node in zip(args, nodes, strict=True):
        if not math.isfinite(value):
            problem = f"param: `{kind}` takes finite numbers, found {value}"
            raise SexpgpuError("E-TRACE-005", problem, node.span, f"initializers: {forms}")
    if kind == "normal" and args[0] < 0:
        raise SexpgpuError(
            "E-TRACE-005",
            f"param: the standard deviation of `normal` is negative ({args[0]:g})",
            nodes[0].span,
            "write a standard deviation of 0 or more, e.g. (normal 0.02)",
        )
    if kind == "uniform" and not args[0] < args[1]:
        raise SexpgpuError(
            "E-TRACE-005",
            f"param: `uniform` needs its low bound below its high one, found "
            f"{args[0]:g} and {args[1]:g}",
            nodes[1].span,
            "write (uniform LOW HIGH), e.g. (uniform -0.1 0.1)",
        )


def unknown_function_hint(name: str, experiment: Experiment) -> str:
    """'did you mean' the nearest callable name, then every defined and vocabulary name."""
    defined = sorted({*experiment.functions, *experiment.models})
    vocabulary = sorted({*VOCABULARY, *SPECIAL_FORMS})
    close = difflib.get_close_matches(name, [*defined, *vocabulary], n=1, cutoff=0.6)
    lead = f"did you mean `{close[0]}`? " if close else ""
    own = f"defined: {' '.join(defined)}; " if defined else ""
    return f"{lead}{own}vocabulary: {' '.join(vocabulary)}"


def _count(n: int) -> str:
    return "no numbers" if n == 0 else "1 number" if n == 1 else f"{n} numbers"
