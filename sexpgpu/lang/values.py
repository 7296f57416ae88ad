"""Parameter expressions: `(* 4 width)` and friends, evaluated without Python's eval.

A value is an integer, a float, a string or a boolean. An expression is a
literal, the name of a parameter already defined, or a call of one of the
`OPERATORS` (a dict keyed by the name users type, filled by `operator`).
Integers stay integers except under ``/``; results must stay within 64-bit
integers and finite floats, so no expression can run for long.

The typed readers (`integer`, `number`, `boolean`, `string`, `choice`)
evaluate a setting and check its type and range in one step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang.suggest import options_hint
from sexpgpu.lang.syntax import ListNode, Literal, Node, Symbol, describe, literal_text, unparse

__all__ = [
    "OPERATORS",
    "Value",
    "boolean",
    "choice",
    "evaluate",
    "integer",
    "number",
    "show_value",
    "string",
    "type_name",
]

Value = int | float | str | bool
Number = int | float

_INT_LIMIT = 2**63


@dataclass(frozen=True)
class Operator:
    """An arithmetic operation of parameter expressions."""

    name: str
    apply: Callable[..., Number]
    min_args: int
    max_args: int | None  # None: any number from min_args up

    @property
    def usage(self) -> str:
        """How a call is written, e.g. ``(+ x y ...)`` or ``(pow x y)``."""
        args = "x y ..." if self.max_args is None else " ".join("xyz"[: self.max_args])
        return f"({self.name} {args})"


OPERATORS: dict[str, Operator] = {}


def operator(name: str, min_args: int, max_args: int | None = None):
    """Register the decorated function as the operation `name`."""

    def register(fn: Callable[..., Number]) -> Callable[..., Number]:
        OPERATORS[name] = Operator(name, fn, min_args, max_args)
        return fn

    return register


@operator("+", 1)
def _add(*xs: Number) -> Number:
    return sum(xs[1:], xs[0])


@operator("-", 1)
def _sub(*xs: Number) -> Number:
    return -xs[0] if len(xs) == 1 else xs[0] - sum(xs[1:])


@operator("*", 1)
def _mul(*xs: Number) -> Number:
    return math.prod(xs)


@operator("/", 2, 2)
def _div(a: Number, b: Number) -> float:
    return a / b


@operator("//", 2, 2)
def _floordiv(a: Number, b: Number) -> Number:
    return a // b


@operator("%", 2, 2)
def _mod(a: Number, b: Number) -> Number:
    return a % b


@operator("min", 1)
def _min(*xs: Number) -> Number:
    return min(xs)


@operator("max", 1)
def _max(*xs: Number) -> Number:
    return max(xs)


@operator("pow", 2, 2)
def _pow(a: Number, b: Number) -> Number:
    if isinstance(a, int) and isinstance(b, int) and b >= 0:
        if abs(a) > 1 and b > 64:  # would pass 2^63 anyway; never build the huge integer
            raise OverflowError
        return a**b
    return math.pow(a, b)


def evaluate(node: Node, env: Mapping[str, Value], later: Collection[str] | None = None) -> Value:
    """Evaluate a parameter expression.

    Parameters
    ----------
    node
        A literal, a symbol naming a parameter of `env`, or a call of an operator.
    env
        The parameters defined so far.
    later
        While the parameters themselves are evaluated: those defined after
        this point (a hint says so when one is used too early). None once
        every parameter is known.

    Returns
    -------
    Value
        An int, float, str or bool.

    Raises
    ------
    SexpgpuError
        E-FORM-006 for an unknown name, E-FORM-005 for a value of the wrong
        type, E-FORM-007 when the arithmetic fails (division by zero, overflow).
    """
    if isinstance(node, Literal):
        return node.value
    if isinstance(node, Symbol):
        if node.name in env:
            return env[node.name]
        if later is not None and node.name in later:
            hint = f"`{node.name}` is defined after this point; define it earlier"
        else:
            kind = "parameters" if later is None else "parameters defined before it"
            hint = options_hint(node.name, env, kind)
        raise SexpgpuError("E-FORM-006", f"unknown parameter `{node.name}`", node.span, hint)
    if isinstance(node, ListNode) and node.items and isinstance(node.items[0], Symbol):
        return _call(node, env, later)
    raise SexpgpuError(
        "E-FORM-005",
        f"expected a value or an arithmetic expression, found {describe(node)}",
        node.span,
        hint="write a number, a string, true/false, a parameter, or a call such as (* 4 width)",
    )


def _call(node: ListNode, env: Mapping[str, Value], later: Collection[str] | None) -> Number:
    head, *arg_nodes = node.items
    assert isinstance(head, Symbol)
    op = OPERATORS.get(head.name)
    if op is None:
        raise SexpgpuError(
            "E-FORM-006",
            f"unknown operation `{head.name}` in a parameter expression",
            head.span,
            options_hint(head.name, OPERATORS, "operations"),
        )
    count = len(arg_nodes)
    if count < op.min_args or (op.max_args is not None and count > op.max_args):
        raise SexpgpuError(
            "E-FORM-002",
            f"`{op.name}` takes {_arity(op)}, found {count}",
            node.span,
            hint=f"write {op.usage}",
        )
    args = []
    for arg_node in arg_nodes:
        value = evaluate(arg_node, env, later)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SexpgpuError(
                "E-FORM-005",
                f"`{op.name}` needs numbers, found {type_name(value)} {show_value(value)}",
                arg_node.span,
                hint="only integers and floats take part in arithmetic",
            )
        args.append(value)
    try:
        result = op.apply(*args)
    except ZeroDivisionError:
        raise SexpgpuError(
            "E-FORM-007", f"`{op.name}` divides by zero", node.span, hint="check the divisor"
        ) from None
    except (OverflowError, ValueError):
        result = math.inf
    if isinstance(result, int) and abs(result) < _INT_LIMIT:
        return result
    if isinstance(result, float) and math.isfinite(result):
        return result
    raise SexpgpuError(
        "E-FORM-007",
        f"`{op.name}` has no finite result for {', '.join(show_value(a) for a in args)}",
        node.span,
        hint="integers must fit in 64 bits and floats be finite; pow needs a real result",
    )


def _arity(op: Operator) -> str:
    if op.max_args is None:
        return f"at least {op.min_args} argument{'s' if op.min_args > 1 else ''}"
    if op.max_args == op.min_args:
        return f"{op.min_args} arguments"
    return f"{op.min_args} to {op.max_args} arguments"


def type_name(value: object, article: bool = False) -> str:
    """The language's name for the type of a value ("integer", "float", ...).

    With `article`, preceded by "a" or "an" ("an integer").
    """
    names = {bool: "boolean", int: "integer", float: "float", str: "string", tuple: "vector"}
    name = names.get(type(value), type(value).__name__)
    if article:
        name = ("an " if name[0] in "aeiou" else "a ") + name
    return name


def show_value(value: object) -> str:
    """A value as the language writes it: ``true``, ``"text"``, ``[0.9 0.95]``, ``0.0006``."""
    if isinstance(value, tuple):
        return "[" + " ".join(show_value(v) for v in value) + "]"
    return literal_text(value)


# -- typed readers of settings ---------------------------------------------------


def _wrong_type(node: Node, what: str, expected: str, value: Value) -> SexpgpuError:
    found = f"{type_name(value)} {show_value(value)}{_origin(node)}"
    return SexpgpuError(
        "E-FORM-005",
        f"{what} must be {expected}, found {found}",
        node.span,
        hint=f"give {expected}, written out or through a parameter",
    )


def _origin(node: Node) -> str:
    """Where a value came from, when not written out: `` (from `batch`)``."""
    if isinstance(node, Literal):
        return ""
    text = unparse(node)
    return f" (from `{text if len(text) <= 40 else text[:37] + '...'}`)"


def integer(node: Node, env: Mapping[str, Value], what: str, minimum: int = 1) -> int:
    """Evaluate `node` to an integer of at least `minimum` (E-FORM-005 otherwise)."""
    value = evaluate(node, env)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(node, what, "an integer", value)
    if value < minimum:
        raise _out_of_range(node, what, value, f"at least {minimum}")
    return value


def number(
    node: Node,
    env: Mapping[str, Value],
    what: str,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
) -> float:
    """Evaluate `node` to a float (an integer is converted) in [low, high] (or (low, high])."""
    value = evaluate(node, env)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _wrong_type(node, what, "a number", value)
    value = float(value)
    too_low = low is not None and (value <= low if open_low else value < low)
    if too_low or (high is not None and value > high):
        bounds = []
        if low is not None:
            bounds.append(f"{'above' if open_low else 'at least'} {low:g}")
        if high is not None:
            bounds.append(f"at most {high:g}")
        raise _out_of_range(node, what, value, " and ".join(bounds))
    return value


def boolean(node: Node, env: Mapping[str, Value], what: str) -> bool:
    """Evaluate `node` to `true` or `false` (E-FORM-005 otherwise)."""
    value = evaluate(node, env)
    if not isinstance(value, bool):
        raise _wrong_type(node, what, "true or false", value)
    return value


def string(node: Node, env: Mapping[str, Value], what: str) -> str:
    """Evaluate `node` to a string (E-FORM-005 otherwise)."""
    value = evaluate(node, env)
    if not isinstance(value, str):
        raise _wrong_type(node, what, 'a string such as "runs/a"', value)
    return value


def choice(node: Node, env: Mapping[str, Value], what: str, options: Collection[str]) -> str:
    """One of `options`, written as a bare symbol (``bf16``) or given by a string parameter."""
    if isinstance(node, Symbol) and node.name in options:
        return node.name
    if isinstance(node, Symbol) and node.name not in env:
        raise SexpgpuError(
            "E-FORM-005",
            f"{what} must be one of {', '.join(options)}, found `{node.name}`",
            node.span,
            hint=options_hint(node.name, options, "choices"),
        )
    value = evaluate(node, env)
    if isinstance(value, str) and value in options:
        return value
    err = _wrong_type(node, what, f"one of {', '.join(options)}", value)
    err.hint = options_hint(str(value), options, "choices")
    raise err


def _out_of_range(node: Node, what: str, value: Value, bounds: str) -> SexpgpuError:
    return SexpgpuError(
        "E-FORM-005",
        f"{what} must be {bounds}, found {show_value(value)}{_origin(node)}",
        node.span,
        hint=f"give a value {bounds}",
    )
