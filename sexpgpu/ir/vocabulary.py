"""The model vocabulary: every name a model body may call, keyed by the name users type.

Each entry is a function of one `Call` (its arguments evaluated) returning a
traced value, registered with `entry` (`sexpgpu.ir.vocabulary_table`)
together with its usage line, argument counts and keywords with defaults.
This module holds the entries without parameters (arithmetic, activations,
reductions, shape, products) and imports `sexpgpu.ir.vocabulary_layers`,
which adds the layers and losses; neither imports the other back. Everything is
composed from the IR builder's ops; nothing here runs NumPy.

Arithmetic on two Python numbers is folded at trace time (``(* 4 width)``
is 512), so parameter arithmetic also works inside model bodies.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from functools import reduce
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.ir import builder as b
from sexpgpu.ir.dtypes import DType
from sexpgpu.ir.node import Node
from sexpgpu.ir.shape_rules import format_shape
from sexpgpu.ir.trace_call import Call, Value, describe_value, is_number
from sexpgpu.ir.vocabulary_table import VOCABULARY, Entry, entry, mean_over

__all__ = ["VOCABULARY", "Entry", "entry", "mean_over"]

# ---------------------------------------------------------------- arithmetic

_PY_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "pow": lambda a, c: _int_pow(a, c) if isinstance(a, int) and isinstance(c, int) else a**c,
    "max": max,
    "min": min,
}
_NODE_BINARY: dict[str, Callable[..., Node]] = {
    "+": b.add,
    "-": b.sub,
    "*": b.mul,
    "/": b.div,
    "pow": b.pow,
    "max": b.maximum,
    "min": b.minimum,
}


def _fold(cx: Call) -> Value:
    """Apply a binary op left to right over the arguments.

    Numbers are folded in Python as long as no tensor has joined (``(/ 1 0
    x)`` fails at the ``(/ 1 0)``); the accumulated value keeps the first
    argument's span.
    """
    if all(is_number(v) for v in cx.args):
        return _fold_numbers(cx, cx.args)
    acc: Value = cx.args[0]
    for i in range(1, len(cx.args)):
        spans = [cx.where(0), cx.where(i)]
        pair = Call(cx.name, cx.span, [acc, cx.args[i]], spans, dtype=cx.dtype)
        if all(is_number(v) for v in pair.args):
            acc = _fold_numbers(cx, pair.args)
        else:
            left, right = pair.tensors([0, 1])
            acc = _NODE_BINARY[cx.name](left, right, span=cx.span)
    return acc


def _fold_numbers(cx: Call, numbers: list[Value]) -> Value:
    """`numbers` folded with `cx`'s Python operator, or E-TRACE-004 (division by zero...)."""
    try:
        result = reduce(lambda a, c: _checked(_PY_BINARY[cx.name](a, c)), numbers)
        return _checked(result)  # a single argument: (+ x)
    except (ZeroDivisionError, OverflowError, ValueError) as err:
        raise cx.fail(f"{cx.name}: {err} for {numbers}", "check the numbers") from None


_INT_LIMIT = 2**63  # integers are 64-bit, as the reader reads them


def _checked(result: Any) -> Any:
    """`result` of one folded step, or ValueError/OverflowError when it has no 64-bit value."""
    if isinstance(result, complex):  # (pow -1 0.5)
        raise ValueError("the result is not a real number")
    if isinstance(result, int) and not isinstance(result, bool) and abs(result) >= _INT_LIMIT:
        raise OverflowError("the integer result does not fit in 64 bits")
    if isinstance(result, float) and not math.isfinite(result):
        raise OverflowError("the result is not finite")
    return result


def _int_pow(a: int, c: int) -> int | float:
    """``a ** c`` of integers without building a huge integer first."""
    if c > 64 and abs(a) > 1:  # |a|^c >= 2^65: past 64 bits whatever a is
        raise OverflowError("the integer result does not fit in 64 bits")
    return a**c


def _register_binary(name: str, usage: str, arity: tuple[int, int | None]) -> None:
    entry(name, usage, arity)(_fold)


_register_binary("+", "(+ a b ...)", (1, None))
_register_binary("*", "(* a b ...)", (1, None))
_register_binary("/", "(/ a b ...)", (2, None))
_register_binary("pow", "(pow x y)", (2, 2))
_register_binary("max", "(max a b)", (2, 2))
_register_binary("min", "(min a b)", (2, 2))


@entry("-", "(- a b ...) or (- x)", (1, None))
def _minus(cx: Call) -> Value:
    if len(cx.args) == 1:
        return _unary(cx, operator.neg, b.neg)
    return _fold(cx)


def _unary(cx: Call, py: Callable[[float], float] | None, node: Callable[..., Node]) -> Value:
    value = cx.get(0)
    if is_number(value) and py is not None:
        try:
            return py(value)
        except (ValueError, ZeroDivisionError, OverflowError) as err:
            raise cx.fail(f"{cx.name} of {value}: {err}", "check the number", 0) from None
    return node(cx.tensor(0), span=cx.span)


def _rsqrt(x: float) -> float:
    return 1.0 / math.sqrt(x)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


_UNARY: dict[str, tuple[Callable[[float], float], Callable[..., Node]]] = {
    "neg": (operator.neg, b.neg),
    "exp": (math.exp, b.exp),
    "log": (math.log, b.log),
    "sqrt": (math.sqrt, b.sqrt),
    "rsqrt": (_rsqrt, b.rsqrt),
    "abs": (abs, b.abs),
    "tanh": (math.tanh, b.tanh),
    "sigmoid": (_sigmoid, b.sigmoid),
    "sin": (math.sin, b.sin),
    "cos": (math.cos, b.cos),
}


def _register_unary(name: str) -> None:
    py, node = _UNARY[name]
    entry(name, f"({name} x)")(lambda cx: _unary(cx, py, node))


for _name in _UNARY:
    _register_unary(_name)


# ---------------------------------------------------------------- masks

_COMPARE: dict[str, tuple[Callable[[Any, Any], bool], Callable[..., Node]]] = {
    "<": (operator.lt, b.lt),
    "<=": (operator.le, b.le),
    ">": (operator.gt, b.gt),
    ">=": (operator.ge, b.ge),
    "=": (operator.eq, b.eq),
}


def _compare(cx: Call) -> Value:
    """A comparison: a bool mask of the broadcast shape (a Python bool of two numbers)."""
    py, node = _COMPARE[cx.name]
    if all(is_number(v) for v in cx.args):
        return py(*cx.args)
    left, right = cx.tensors([0, 1])
    return node(left, right, span=cx.span)


for _name in _COMPARE:
    entry(_name, f"({_name} a b)", (2, 2))(_compare)


@entry("where", "(where mask a b)", (3, 3))
def _where(cx: Call) -> Node:
    mask = cx.tensor(0)
    if mask.dtype is not DType.BOOL:
        raise cx.fail(
            f"where: the mask is {describe_value(mask)}, not a bool mask",
            "make it with a comparison, e.g. (where (< x 0) a b)",
            0,
        )
    a, c = cx.tensors([1, 2])
    return b.where(mask, a, c, span=cx.span)


# ---------------------------------------------------------------- activations


@entry("relu", "(relu x)")
def _relu(cx: Call) -> Node:
    x = cx.tensor(0)
    zero = b.constant(0.0, x.dtype, span=cx.span)
    # where, not maximum: the gradient at 0 is 0 (as in PyTorch), and one op cheaper
    return b.where(b.lt(zero, x, span=cx.span), x, zero, span=cx.span)


@entry("gelu", "(gelu x)")
def _gelu(cx: Call) -> Node:
    # The IR's fused GELU (tanh form); its VJP recomputes from x alone.
    return b.gelu(cx.tensor(0), span=cx.span)


@entry("silu", "(silu x)")
def _silu(cx: Call) -> Node:
    x = cx.tensor(0)
    return b.mul(x, b.sigmoid(x, span=cx.span), span=cx.span)


@entry("softmax", "(softmax x :axis -1)", keywords={"axis": -1})
def _softmax(cx: Call) -> Node:
    return b.softmax(cx.tensor(0), axis=cx.integer("axis"), span=cx.span)


@entry("log-softmax", "(log-softmax x :axis -1)", keywords={"axis": -1})
def _log_softmax(cx: Call) -> Node:
    return b.log_softmax(cx.tensor(0), axis=cx.integer("axis"), span=cx.span)


# ---------------------------------------------------------------- reductions

_REDUCE_KEYS = {"axis": None, "keep": False}


@entry("sum", "(sum x :axis A :keep false)", keywords=_REDUCE_KEYS)
def _sum(cx: Call) -> Node:
    return b.sum(cx.tensor(0), cx.axes("axis"), keepdims=cx.boolean("keep"), span=cx.span)


@entry("mean", "(mean x :axis A :keep false)", keywords=_REDUCE_KEYS)
def _mean(cx: Call) -> Node:
    return mean_over(cx.tensor(0), cx.axes("axis"), cx.boolean("keep"), cx.span)


@entry("amax", "(amax x :axis A :keep false)", keywords=_REDUCE_KEYS)
def _amax(cx: Call) -> Node:
    return b.max(cx.tensor(0), cx.axes("axis"), keepdims=cx.boolean("keep"), span=cx.span)


# ---------------------------------------------------------------- shape


@entry("reshape", "(reshape x [d ...])", (2, 2))
def _reshape(cx: Call) -> Node:
    shape = cx.ints(1, minimum=-1)
    if shape.count(-1) > 1:
        raise cx.fail("reshape: at most one size may be -1", "give the other sizes", 1)
    return b.reshape(cx.tensor(0), shape, span=cx.span)


@entry("transpose", "(transpose x :axes [..])", keywords={"axes": None})
def _transpose(cx: Call) -> Node:
    axes = cx.get("axes")
    return b.transpose(cx.tensor(0), None if axes is None else cx.ints("axes"), span=cx.span)


@entry("slice", "(slice x :axis -1 :from 0 :to N)", keywords={"axis": -1, "from": 0, "to": None})
def _slice(cx: Call) -> Node:
    x = cx.tensor(0)
    axis = cx.integer("axis")
    in_range = -x.ndim <= axis < x.ndim
    stop = cx.integer("to") if cx.get("to") is not None else x.shape[axis] if in_range else 0
    start = cx.integer("from")
    if start == stop and in_range:  # refused here, not by whichever op meets the empty axis
        raise cx.fail(
            f"slice: :from {start} :to {stop} is empty", "make :to greater than :from", "to"
        )
    return b.slice(x, axis, start, stop, span=cx.span)


@entry("concat", "(concat a b ... :axis 0)", (1, None), keywords={"axis": 0})
def _concat(cx: Call) -> Node:
    if len(cx.args) == 1 and isinstance(cx.args[0], tuple):  # (concat [a b] :axis 1)
        items = list(cx.args[0])
        if not items:
            raise cx.fail("concat: the vector of parts is empty", "join one tensor or more", 0)
        parts = Call(cx.name, cx.span, items, [cx.where(0)] * len(items), dtype=cx.dtype)
        return b.concat(parts.tensors(range(len(parts.args))), cx.integer("axis"), span=cx.span)
    return b.concat(cx.tensors(range(len(cx.args))), cx.integer("axis"), span=cx.span)


@entry("take", "(take table ids)", (2, 2))
def _take(cx: Call) -> Node:
    return b.take(cx.tensor(0), cx.tensor(1), span=cx.span)


@entry("positions", "(positions ids)")
def _positions(cx: Call) -> Node:
    ids = cx.tensor(0)
    if ids.ndim < 1:
        raise cx.fail("positions needs a [batch seq] input, found a scalar", "pass token ids", 0)
    return b.iota(ids.shape, axis=ids.ndim - 1, dtype=DType.INT32, span=cx.span)


_DTYPES = ("f32", "bf16", "int32")


@entry("cast", "(cast x :dtype f32)", keywords={"dtype": None}, quoted=("dtype",))
def _cast(cx: Call) -> Node:
    target = cx.get("dtype")
    if target not in _DTYPES:
        raise cx.fail(
            f"cast: `:dtype` must be one of {', '.join(_DTYPES)}, found "
            + ("nothing" if target is None else describe_value(target)),
            "write (cast x :dtype f32)",
            "dtype",
        )
    return b.cast(cx.tensor(0), DType(target), span=cx.span)


# ---------------------------------------------------------------- products


@entry("matmul", "(matmul a b)", (2, 2))
def _matmul(cx: Call) -> Node:
    left, right = cx.tensors([0, 1])
    if left.ndim >= 2 and right.ndim >= 2 and left.shape[-1] != right.shape[-2]:
        raise _inner_mismatch(cx, left, right)
    return b.matmul(left, right, span=cx.span)


def _inner_mismatch(cx: Call, left: Node, right: Node) -> SexpgpuError:
    """E-SHAPE-003 with a hint naming the operand to transpose, when one would fit."""
    pair = f"{format_shape(left.shape)} by {format_shape(right.shape)}"
    fits = [left.shape[-1] == right.shape[-1], left.shape[-2] == right.shape[-2]]
    if any(fits):
        i = 1 if fits[0] else 0
        shape = format_shape((left, right)[i].shape)
        hint = f"{cx.text(i)} is {shape}; did you mean (transpose {cx.text(i)})?"
    else:
        hint = (
            f"{cx.text(0)} is {format_shape(left.shape)} and {cx.text(1)} is "
            f"{format_shape(right.shape)}: the left's last axis must equal the right's "
            "second-to-last"
        )
    return SexpgpuError(
        "E-SHAPE-003",
        f"matmul: inner dimensions differ, {left.shape[-1]} and {right.shape[-2]} ({pair})",
        cx.span,
        hint,
    )


from sexpgpu.ir import vocabulary_layers as _layers  # noqa: E402, F401  (registers the layers)
