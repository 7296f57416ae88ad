"""Build IR nodes: one function per op, each running the op's shape rule.

Every function takes its operands, its attributes as keywords, and ``span``
(the `Span` of the source form, kept on the node and used by errors). A
shape or dtype error raises `SexpgpuError` (E-SHAPE-*) at that span.

    >>> from sexpgpu.ir import builder as b
    >>> x = b.input("x", (8, 64), "f32")
    >>> w = b.param("w", (64, 10), "f32")
    >>> y = b.softmax(b.matmul(x, w), axis=-1)
    >>> y.shape
    (8, 10)
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sexpgpu.errors import SexpgpuError, Span
from sexpgpu.ir import shape_rules as _shape_rules  # noqa: F401  (fills SHAPE_RULES)
from sexpgpu.ir.dtypes import DType, numpy_dtype
from sexpgpu.ir.node import ConstArray, Node
from sexpgpu.ir.ops import Op
from sexpgpu.ir.rules import SHAPE_RULES

__all__ = [
    "MAX_AXES",
    "MAX_ELEMENTS",
    "abs",
    "add",
    "attention",
    "attention_grad",
    "broadcast_to",
    "cast",
    "concat",
    "constant",
    "cos",
    "cross_entropy",
    "cross_entropy_grad",
    "div",
    "emit",
    "eq",
    "exp",
    "ge",
    "gelu",
    "gelu_grad",
    "gt",
    "input",
    "iota",
    "layernorm",
    "layernorm_grad",
    "le",
    "log",
    "log_softmax",
    "lt",
    "matmul",
    "max",
    "maximum",
    "minimum",
    "mul",
    "neg",
    "pad",
    "param",
    "pow",
    "reshape",
    "rsqrt",
    "scatter_add",
    "sigmoid",
    "sign",
    "sin",
    "slice",
    "softmax",
    "softmax_grad",
    "sqrt",
    "sub",
    "sum",
    "take",
    "tanh",
    "transpose",
    "uniform",
    "where",
]

ShapeLike = Sequence[int]

# Every value the IR holds fits these bounds, so sizes, byte counts and FLOPs
# stay exact machine integers and NumPy (at most 64 axes) can hold each value.
MAX_AXES = 64
MAX_ELEMENTS = 2**48  # 1 PiB of f32: past any device this package plans for


def emit(op: Op, *inputs: Node, span: Span | None = None, **attrs: Any) -> Node:
    """Make a node of `op`: run its shape rule and return the checked node.

    Parameters
    ----------
    op
        The operation.
    *inputs
        Operand nodes in the op's order.
    span
        The source span of the form this node comes from.
    **attrs
        The op's attributes (see `sexpgpu.ir.ops`).

    Raises
    ------
    SexpgpuError
        E-SHAPE-* when the operands' shapes or dtypes do not fit the op.
    """
    assert all(isinstance(x, Node) for x in inputs), inputs
    dtype, shape, attrs = SHAPE_RULES[op](op, inputs, dict(attrs), span)
    shape = tuple(shape)
    _check_extent(op, shape, span)
    return Node(op, DType(dtype), tuple(builtins.int(d) for d in shape), inputs, attrs, span)


def _check_extent(op: Op, shape: tuple[Any, ...], span: Span | None) -> None:
    """E-SHAPE-012 unless `shape` has whole sizes, at most `MAX_AXES` axes and
    at most `MAX_ELEMENTS` elements."""
    shown = "[" + " ".join(map(str, shape)) + "]"
    shown = f"a value of shape {shown}" if len(shown) <= 80 else "a value"
    bad = [d for d in shape if not isinstance(d, builtins.int | np.integer) or d < 0]
    if bad:
        problem = f"has a size of {bad[0]!r}; sizes are whole numbers, 0 or more"
    elif len(shape) > MAX_AXES:
        problem = f"has {len(shape)} axes, more than the {MAX_AXES} a value may have"
    elif (size := math.prod(builtins.int(d) for d in shape)) > MAX_ELEMENTS:
        problem = f"holds {size:.3g} elements, more than the 2^48 a value may hold"
    else:
        return
    raise SexpgpuError(
        "E-SHAPE-012",
        f"{op.label}: {shown} {problem}",
        span,
        "check the sizes that make this value (a parameter, :seq, :batch or a layer's width)",
    )


# ---------------------------------------------------------------- leaves


def input(name: str, shape: ShapeLike, dtype: DType | str, span: Span | None = None) -> Node:
    """A data placeholder named `name` (fed at each call)."""
    return emit(Op.INPUT, span=span, name=name, shape=tuple(shape), dtype=DType(dtype))


def param(name: str, shape: ShapeLike, dtype: DType | str, span: Span | None = None) -> Node:
    """A parameter named `name` (a stable path such as ``gpt/block.3/attention/wq``)."""
    return emit(Op.PARAM, span=span, name=name, shape=tuple(shape), dtype=DType(dtype))


def constant(
    value: builtins.int | builtins.float | builtins.bool | np.ndarray,
    dtype: DType | str,
    shape: ShapeLike = (),
    span: Span | None = None,
) -> Node:
    """A constant: a scalar filling `shape` (default a rank-0 scalar that broadcasts)."""
    dtype = DType(dtype)
    if isinstance(value, np.ndarray):
        arr = value.astype(numpy_dtype(dtype))
        return emit(Op.CONSTANT, span=span, value=ConstArray(arr), shape=arr.shape, dtype=dtype)
    if dtype is DType.BOOL:
        value = builtins.bool(value)
    elif dtype is DType.INT32:
        value = builtins.int(value)
    else:
        value = builtins.float(value)
    return emit(Op.CONSTANT, span=span, value=value, shape=tuple(shape), dtype=dtype)


def iota(
    shape: ShapeLike, axis: builtins.int, dtype: DType | str = "int32", span: Span | None = None
) -> Node:
    """The index along `axis` at every position of `shape` (``positions``, causal masks)."""
    return emit(Op.IOTA, span=span, shape=tuple(shape), axis=axis, dtype=DType(dtype))


# ---------------------------------------------------------------- elementwise
# Most elementwise and reduction builders differ only in their op, so
# `_elementwise` and `_reduction` make them.


def _elementwise(op: Op, doc: str) -> Callable[..., Node]:
    """The builder ``name(*operands, span=None)`` of the elementwise `op`."""

    def build(*operands: Node, span: Span | None = None) -> Node:
        return emit(op, *operands, span=span)

    return _named(build, op, doc)


def _named(build: Callable[..., Node], op: Op, doc: str) -> Callable[..., Node]:
    """`build` named after `op` (``Op.LOG`` -> ``log``) and documented by `doc`."""
    build.__name__ = build.__qualname__ = op.name.lower()
    build.__doc__ = doc
    return build


neg = _elementwise(Op.NEG, "``-x``.")
exp = _elementwise(Op.EXP, "``e**x``.")
log = _elementwise(Op.LOG, "Natural logarithm.")
sqrt = _elementwise(Op.SQRT, "Square root.")
rsqrt = _elementwise(Op.RSQRT, "``1 / sqrt(x)``.")
tanh = _elementwise(Op.TANH, "Hyperbolic tangent.")
sigmoid = _elementwise(Op.SIGMOID, "``1 / (1 + e**-x)``.")
sin = _elementwise(Op.SIN, "Sine (radians).")
cos = _elementwise(Op.COS, "Cosine (radians).")
abs = _elementwise(Op.ABS, "``|x|``.")
sign = _elementwise(Op.SIGN, "-1, 0 or 1 (no gradient).")
add = _elementwise(Op.ADD, "``a + b`` (broadcasting).")
sub = _elementwise(Op.SUB, "``a - b`` (broadcasting).")
mul = _elementwise(Op.MUL, "``a * b`` (broadcasting).")
div = _elementwise(Op.DIV, "``a / b`` (broadcasting; floats only).")
pow = _elementwise(Op.POW, "``a ** b`` (broadcasting; floats only).")
maximum = _elementwise(Op.MAXIMUM, "Elementwise larger of `a` and `b` (ties share the gradient).")
minimum = _elementwise(Op.MINIMUM, "Elementwise smaller of `a` and `b` (ties share the gradient).")
lt = _elementwise(Op.LT, "``a < b`` as bool.")
le = _elementwise(Op.LE, "``a <= b`` as bool.")
eq = _elementwise(Op.EQ, "``a == b`` as bool.")
where = _elementwise(Op.WHERE, "`a` where `cond` holds, else `b` (broadcasting all three).")


def cast(x: Node, dtype: DType | str, span: Span | None = None) -> Node:
    """`x` converted to `dtype` (floats to int32 truncate toward zero)."""
    return emit(Op.CAST, x, span=span, dtype=DType(dtype))


def uniform(key: Node, counter: Node, salt: builtins.int, span: Span | None = None) -> Node:
    """f32 numbers in [0, 1), a hash of int32 `key` and `counter` (broadcast) and `salt`.

    See `sexpgpu.ir.counter_rng`: the same integers give the same numbers on every device.
    """
    return emit(Op.UNIFORM, key, counter, span=span, salt=salt)


def gt(a: Node, b: Node, span: Span | None = None) -> Node:
    """``a > b`` as bool (built as ``b < a``)."""
    return emit(Op.LT, b, a, span=span)


def ge(a: Node, b: Node, span: Span | None = None) -> Node:
    """``a >= b`` as bool (built as ``b <= a``)."""
    return emit(Op.LE, b, a, span=span)


# ---------------------------------------------------------------- reductions


def _reduction(op: Op, doc: str) -> Callable[..., Node]:
    """The builder ``name(x, axes=None, keepdims=False, span=None)`` of the reduction `op`."""

    def build(
        x: Node,
        axes: builtins.int | Sequence[builtins.int] | None = None,
        keepdims: builtins.bool = False,
        span: Span | None = None,
    ) -> Node:
        axes = (axes,) if isinstance(axes, builtins.int) else axes
        return emit(op, x, span=span, axes=axes, keepdims=keepdims)

    return _named(build, op, doc)


sum = _reduction(Op.SUM, "Sum over `axes` (all axes when None).")
max = _reduction(Op.MAX, "Largest value over `axes` (``amax``; ties share the gradient).")


# ---------------------------------------------------------------- movement


def reshape(x: Node, shape: ShapeLike, span: Span | None = None) -> Node:
    """`x` with a new shape of the same size (one size may be -1)."""
    return emit(Op.RESHAPE, x, span=span, shape=tuple(shape))


def transpose(
    x: Node, axes: Sequence[builtins.int] | None = None, span: Span | None = None
) -> Node:
    """Permute the axes; by default swap the last two."""
    if axes is None:
        axes = [*range(x.ndim - 2), x.ndim - 1, x.ndim - 2] if x.ndim >= 2 else range(x.ndim)
    return emit(Op.TRANSPOSE, x, span=span, axes=tuple(axes))


def broadcast_to(x: Node, shape: ShapeLike, span: Span | None = None) -> Node:
    """`x` repeated along axes of size 1 (and new leading axes) to `shape`."""
    return emit(Op.BROADCAST_TO, x, span=span, shape=tuple(shape))


def slice(
    x: Node, axis: builtins.int, start: builtins.int, stop: builtins.int, span: Span | None = None
) -> Node:
    """Elements ``start <= i < stop`` along `axis` (negative bounds count from the end)."""
    if isinstance(axis, builtins.int) and -x.ndim <= axis < x.ndim:
        n = x.shape[axis]
        start, stop = (start + n if start < 0 else start), (stop + n if stop < 0 else stop)
    return emit(Op.SLICE, x, span=span, axis=axis, start=start, stop=stop)


def pad(
    x: Node,
    axis: builtins.int,
    before: builtins.int,
    after: builtins.int,
    span: Span | None = None,
) -> Node:
    """`x` with `before` and `after` zeros added along `axis`."""
    return emit(Op.PAD, x, span=span, axis=axis, before=before, after=after)


def concat(xs: Sequence[Node], axis: builtins.int, span: Span | None = None) -> Node:
    """Join `xs` along `axis`."""
    return emit(Op.CONCAT, *xs, span=span, axis=axis)


def take(table: Node, ids: Node, span: Span | None = None) -> Node:
    """Rows of `table` picked by int32 `ids`: shape ``ids.shape + table.shape[1:]``."""
    return emit(Op.TAKE, table, ids, span=span)


def scatter_add(ids: Node, updates: Node, rows: builtins.int, span: Span | None = None) -> Node:
    """Zeros of ``[rows, *row]`` with each row of `updates` added at its id (take's VJP)."""
    return emit(Op.SCATTER_ADD, ids, updates, span=span, rows=rows)


# ---------------------------------------------------------------- products and fused


def matmul(a: Node, b: Node, span: Span | None = None) -> Node:
    """Matrix product over the last two axes; leading axes broadcast as in NumPy."""
    return emit(Op.MATMUL, a, b, span=span)


def softmax(x: Node, axis: builtins.int = -1, span: Span | None = None) -> Node:
    """``exp(x - max) / sum(exp(x - max))`` along `axis`, fused."""
    return emit(Op.SOFTMAX, x, span=span, axis=axis)


def log_softmax(x: Node, axis: builtins.int = -1, span: Span | None = None) -> Node:
    """``x - logsumexp(x)`` along `axis`, fused."""
    return emit(Op.LOG_SOFTMAX, x, span=span, axis=axis)


def softmax_grad(y: Node, g: Node, axis: builtins.int, span: Span | None = None) -> Node:
    """``y * (g - sum(g * y, axis))``: the VJP of softmax given its output `y`."""
    return emit(Op.SOFTMAX_GRAD, y, g, span=span, axis=axis)


def cross_entropy(logits: Node, targets: Node, span: Span | None = None) -> Node:
    """Per-row ``logsumexp(logits) - logits[target]`` over the last axis (not averaged)."""
    return emit(Op.CROSS_ENTROPY, logits, targets, span=span)


def cross_entropy_grad(logits: Node, targets: Node, g: Node, span: Span | None = None) -> Node:
    """``g[..., None] * (softmax(logits) - onehot(targets))``: cross-entropy's VJP."""
    return emit(Op.CROSS_ENTROPY_GRAD, logits, targets, g, span=span)


def attention(
    q: Node,
    k: Node,
    v: Node,
    causal: builtins.bool,
    scale: builtins.float | None = None,
    span: Span | None = None,
) -> Node:
    """``softmax(q k^T * scale [+ causal mask]) v`` over the last two axes, fused.

    `q` is ``[.. H seq dim]``, `k` and `v` ``[.. K seq dim]`` with K dividing
    H: query head ``h`` reads key/value head ``h // (H / K)`` (grouped-query
    attention; K = 1 is multi-query, K = H the usual one). `scale` defaults
    to ``dim ** -0.5``. With `causal`, position ``i`` attends to positions
    ``j <= i``. The attention weights are never stored: the VJP recomputes
    them.
    """
    scale = q.shape[-1] ** -0.5 if scale is None and q.ndim else scale
    return emit(Op.ATTENTION, q, k, v, span=span, causal=causal, scale=scale)


def attention_grad(
    q: Node,
    k: Node,
    v: Node,
    g: Node,
    causal: builtins.bool,
    scale: builtins.float,
    span: Span | None = None,
) -> Node:
    """The VJP of `attention`: ``dq, dk, dv`` joined on the head axis, ``[.. H+2K seq dim]``."""
    return emit(Op.ATTENTION_GRAD, q, k, v, g, span=span, causal=causal, scale=scale)


def layernorm(x: Node, eps: builtins.float = 1e-5, span: Span | None = None) -> Node:
    """``(x - mean) / sqrt(var + eps)`` over the last axis, fused (no scale or shift)."""
    return emit(Op.LAYERNORM, x, span=span, eps=eps)


def layernorm_grad(x: Node, g: Node, eps: builtins.float, span: Span | None = None) -> Node:
    """The VJP of `layernorm` at `x` for the cotangent `g` (statistics recomputed)."""
    return emit(Op.LAYERNORM_GRAD, x, g, span=span, eps=eps)


def gelu(x: Node, span: Span | None = None) -> Node:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, fused."""
    return emit(Op.GELU, x, span=span)


def gelu_grad(x: Node, g: Node, span: Span | None = None) -> Node:
    """The VJP of `gelu` at `x` for the cotangent `g`."""
    return emit(Op.GELU_GRAD, x, g, span=span)
