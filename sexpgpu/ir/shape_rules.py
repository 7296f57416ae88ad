"""Shape and dtype rules: what each op accepts and what it gives.

Each rule checks its operands and raises `SexpgpuError` at the user's span
naming the shapes involved, with a hint. Broadcasting follows NumPy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sexpgpu.errors import SexpgpuError, Span
from sexpgpu.ir.dtypes import FLOATS, DType
from sexpgpu.ir.node import ConstArray, Node, Shape
from sexpgpu.ir.ops import COMPARISON, Op
from sexpgpu.ir.rules import shape_rule

__all__ = ["broadcast_shapes", "check_targets", "format_shape", "loss_dtype"]

Attrs = dict[str, Any]
Result = tuple[DType, Shape, Attrs]
_NUMBERS = FLOATS | {DType.INT32}


def format_shape(shape: Sequence[int]) -> str:
    """A shape as the language writes it: ``[16 32]``."""
    return "[" + " ".join(str(d) for d in shape) + "]"


def broadcast_shapes(op: Op, shapes: Sequence[Shape], span: Span | None) -> Shape:
    """The NumPy broadcast of `shapes`, or E-SHAPE-001 naming them all."""
    ndim = max(len(s) for s in shapes)
    out = []
    for axis in range(-ndim, 0):
        dims = {s[axis] for s in shapes if len(s) >= -axis} - {1}
        if len(dims) > 1:
            listed = " and ".join(format_shape(s) for s in shapes)
            raise SexpgpuError(
                "E-SHAPE-001",
                f"{op.label}: shapes {listed} do not broadcast (axis {axis})",
                span,
                "sizes must be equal or 1 on each axis, counted from the end; "
                "reshape or transpose one operand",
            )
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _axis(op: Op, axis: int, ndim: int, span: Span | None, shape: Shape) -> int:
    if not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise SexpgpuError(
            "E-SHAPE-004",
            f"{op.label}: axis {axis} is out of range for shape {format_shape(shape)}",
            span,
            f"axes of a {ndim}-axis value run from {-ndim} to {ndim - 1}",
        )
    return axis % ndim


def _dtype_in(op: Op, node: Node, allowed: frozenset[DType], span: Span | None) -> None:
    if node.dtype not in allowed:
        names = " ".join(sorted(allowed))
        raise SexpgpuError(
            "E-SHAPE-002",
            f"{op.label}: operand of dtype {node.dtype} is not accepted (wants {names})",
            span,
            f"convert it first, e.g. (cast x :dtype {min(allowed)})",
        )


def _same_dtype(op: Op, nodes: Sequence[Node], span: Span | None) -> DType:
    dtypes = [n.dtype for n in nodes]
    if len(set(dtypes)) > 1:
        raise SexpgpuError(
            "E-SHAPE-002",
            f"{op.label}: operand dtypes differ: {' and '.join(dtypes)}",
            span,
            "cast one operand so both have the same dtype",
        )
    return dtypes[0]


@shape_rule(Op.INPUT, Op.PARAM)
def _leaf(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    assert not inputs and isinstance(attrs["name"], str)
    return DType(attrs["dtype"]), tuple(attrs["shape"]), attrs


@shape_rule(Op.CONSTANT)
def _constant(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    value, shape = attrs["value"], tuple(attrs["shape"])
    assert isinstance(value, int | float | bool | ConstArray)
    assert not isinstance(value, ConstArray) or value.array.shape == shape
    return DType(attrs["dtype"]), shape, attrs


@shape_rule(Op.IOTA)
def _iota(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    shape = tuple(attrs["shape"])
    attrs["axis"] = _axis(op, attrs["axis"], len(shape), span, shape)
    return DType(attrs["dtype"]), shape, attrs


@shape_rule(Op.NEG, Op.ABS, Op.SIGN)
def _signed(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    (x,) = inputs
    _dtype_in(op, x, _NUMBERS, span)
    return x.dtype, x.shape, attrs


@shape_rule(Op.EXP, Op.LOG, Op.SQRT, Op.RSQRT, Op.TANH, Op.SIGMOID, Op.SIN, Op.COS)
def _float_unary(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    (x,) = inputs
    _dtype_in(op, x, FLOATS, span)
    return x.dtype, x.shape, attrs


@shape_rule(Op.CAST)
def _cast(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    (x,) = inputs
    attrs["dtype"] = DType(attrs["dtype"])
    return attrs["dtype"], x.shape, attrs


@shape_rule(Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAXIMUM, Op.MINIMUM, Op.POW, *COMPARISON)
def _binary(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    a, b = inputs
    dtype = _same_dtype(op, inputs, span)
    if op in COMPARISON:
        _dtype_in(op, a, _NUMBERS if op is not Op.EQ else _NUMBERS | {DType.BOOL}, span)
    else:
        _dtype_in(op, a, FLOATS if op in (Op.DIV, Op.POW) else _NUMBERS, span)
    shape = broadcast_shapes(op, [a.shape, b.shape], span)
    return (DType.BOOL if op in COMPARISON else dtype), shape, attrs


@shape_rule(Op.WHERE)
def _where(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    cond, a, b = inputs
    _dtype_in(op, cond, frozenset({DType.BOOL}), span)
    dtype = _same_dtype(op, (a, b), span)
    return dtype, broadcast_shapes(op, [n.shape for n in inputs], span), attrs


@shape_rule(Op.UNIFORM)
def _uniform(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    key, counter = inputs
    for what, node in (("keys", key), ("counters", counter)):
        _int32("E-SHAPE-002", f"uniform: {what}", node, span, "keys and counters are int32")
    salt = attrs["salt"]
    assert isinstance(salt, int) and 0 <= salt < 2**31, salt
    return DType.F32, broadcast_shapes(op, [key.shape, counter.shape], span), {"salt": salt}


@shape_rule(Op.SUM, Op.MAX)
def _reduce(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    (x,) = inputs
    _dtype_in(op, x, _NUMBERS, span)
    axes = attrs.get("axes")
    axes = range(x.ndim) if axes is None else axes
    norm = tuple(sorted({_axis(op, a, x.ndim, span, x.shape) for a in axes}))
    if len(norm) != len(tuple(axes)):
        raise SexpgpuError(
            "E-SHAPE-004", f"{op.label}: axes {list(axes)} repeat an axis", span, "name each once"
        )
    keep = bool(attrs.get("keepdims", False))
    shape = tuple(1 if i in norm else d for i, d in enumerate(x.shape) if keep or i not in norm)
    return x.dtype, shape, {"axes": norm, "keepdims": keep}


@shape_rule(Op.RESHAPE)
def _reshape(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    (x,) = inputs
    shape = list(attrs["shape"])
    if shape.count(-1) == 1:
        rest = math.prod(d for d in shape if d != -1)
        if rest and x.size % rest == 0:
            shape[shape.index(-1)] = x.size // rest
    if math.prod(shape) != x.size or any(d < 0 for d in shape):
        raise SexpgpuError(
            "E-SHAPE-005",
            f"reshape: {format_shape(x.shape)} ({x.size} elements) cannot become "
            f"{format_shape(attrs['shape'])}",
            span,
            "the new shape must hold the same number of elements; one size may be -1",
        )
    return x.dtype, tuple(shape), {"shape": tuple(shape)}


@shape_rule(Op.TRANSPOSE)
def _transpose(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    (x,) = inputs
    axes = tuple(attrs["axes"])
    if sorted(a % x.ndim if -x.ndim <= a < x.ndim else a for a in axes) != list(range(x.ndim)):
        raise SexpgpuError(
            "E-SHAPE-004",
            f"transpose: axes {list(axes)} are not a permutation of the {x.ndim} axes "
            f"of {format_shape(x.shape)}",
            span,
            f"name each axis 0..{x.ndim - 1} once, e.g. :axes {list(reversed(range(x.ndim)))}",
        )
    axes = tuple(a % x.ndim for a in axes)
    return x.dtype, tuple(x.shape[a] for a in axes), {"axes": axes}


@shape_rule(Op.BROADCAST_TO)
def _broadcast_to(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    (x,) = inputs
    shape = tuple(attrs["shape"])
    ok = len(shape) >= x.ndim and all(
        d in (1, t) for d, t in zip(x.shape, shape[len(shape) - x.ndim :], strict=True)
    )
    if not ok:
        raise SexpgpuError(
            "E-SHAPE-001",
            f"broadcast-to: {format_shape(x.shape)} does not broadcast to {format_shape(shape)}",
            span,
            "sizes must be equal or 1 on each axis, counted from the end",
        )
    return x.dtype, shape, {"shape": shape}


def _bounds(op: Op, x: Node, axis: int, ok: bool, what: str, span: Span | None) -> None:
    if not ok:
        raise SexpgpuError(
            "E-SHAPE-007",
            f"{op.label}: {what} is out of range for axis {axis} of {format_shape(x.shape)}",
            span,
            f"bounds must satisfy 0 <= from <= to <= {x.shape[axis]}",
        )


@shape_rule(Op.SLICE)
def _slice(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    (x,) = inputs
    axis = _axis(op, attrs["axis"], x.ndim, span, x.shape)
    start, stop = attrs["start"], attrs["stop"]
    ok = 0 <= start <= stop <= x.shape[axis]
    _bounds(op, x, axis, ok, f"from {start} to {stop}", span)
    shape = (*x.shape[:axis], stop - start, *x.shape[axis + 1 :])
    return x.dtype, shape, {"axis": axis, "start": start, "stop": stop}


@shape_rule(Op.PAD)
def _pad(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    (x,) = inputs
    axis = _axis(op, attrs["axis"], x.ndim, span, x.shape)
    before, after = attrs["before"], attrs["after"]
    _bounds(op, x, axis, before >= 0 and after >= 0, f"padding {before}, {after}", span)
    shape = (*x.shape[:axis], before + x.shape[axis] + after, *x.shape[axis + 1 :])
    return x.dtype, shape, {"axis": axis, "before": before, "after": after}


@shape_rule(Op.CONCAT)
def _concat(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    assert inputs, "concat of nothing"
    first = inputs[0]
    axis = _axis(op, attrs["axis"], first.ndim, span, first.shape)
    dtype = _same_dtype(op, inputs, span)
    for x in inputs[1:]:
        if x.ndim != first.ndim or any(
            d != e for i, (d, e) in enumerate(zip(x.shape, first.shape, strict=True)) if i != axis
        ):
            raise SexpgpuError(
                "E-SHAPE-008",
                f"concat: {format_shape(first.shape)} and {format_shape(x.shape)} differ "
                f"off axis {axis}",
                span,
                "every operand needs the same sizes on all other axes",
            )
    size = sum(x.shape[axis] for x in inputs)
    return dtype, (*first.shape[:axis], size, *first.shape[axis + 1 :]), {"axis": axis}


def _int32(code: str, what: str, node: Node, span: Span | None, hint: str) -> None:
    """`code` unless `node` (`what`: ``take: indices``) holds int32 indices."""
    if node.dtype is not DType.INT32:
        raise SexpgpuError(code, f"{what} have dtype {node.dtype}, not int32", span, hint)


def _ids(op: Op, ids: Node, span: Span | None) -> None:
    hint = "row indices are int32 token ids; (cast ids :dtype int32)"
    _int32("E-SHAPE-009", f"{op.label}: indices", ids, span, hint)


@shape_rule(Op.TAKE)
def _take(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    table, ids = inputs
    _ids(op, ids, span)
    if table.ndim < 1:
        raise SexpgpuError(
            "E-SHAPE-009", "take: the table is a scalar", span, "take rows of a matrix"
        )
    return table.dtype, ids.shape + table.shape[1:], attrs


@shape_rule(Op.SCATTER_ADD)
def _scatter_add(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    ids, updates = inputs
    _ids(op, ids, span)
    if updates.shape[: ids.ndim] != ids.shape:
        raise SexpgpuError(
            "E-SHAPE-009",
            f"scatter-add: updates {format_shape(updates.shape)} do not start with the "
            f"index shape {format_shape(ids.shape)}",
            span,
            "updates hold one row per index",
        )
    return updates.dtype, (int(attrs["rows"]), *updates.shape[ids.ndim :]), attrs


@shape_rule(Op.MATMUL)
def _matmul(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    a, b = inputs
    pair = f"{format_shape(a.shape)} by {format_shape(b.shape)}"
    if a.ndim < 2 or b.ndim < 2:
        raise SexpgpuError(
            "E-SHAPE-006",
            f"matmul: {pair}: both operands need at least 2 axes",
            span,
            "reshape a vector to [1 n] or [n 1] first",
        )
    dtype = _same_dtype(op, inputs, span)
    _dtype_in(op, a, FLOATS, span)
    if a.shape[-1] != b.shape[-2]:
        raise SexpgpuError(
            "E-SHAPE-003",
            f"matmul: inner dimensions differ, {a.shape[-1]} and {b.shape[-2]} ({pair})",
            span,
            "the left operand's last axis must equal the right's second-to-last; "
            "did you mean to transpose one of them?",
        )
    batch = broadcast_shapes(op, [a.shape[:-2], b.shape[:-2]], span)
    return dtype, (*batch, a.shape[-2], b.shape[-1]), attrs


@shape_rule(Op.GELU, Op.GELU_GRAD, Op.LAYERNORM, Op.LAYERNORM_GRAD)
def _fused_unary(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    x = inputs[0]
    _dtype_in(op, x, FLOATS, span)
    if len(inputs) == 2:  # the gradient ops: (x, cotangent)
        assert inputs[1].shape == x.shape and inputs[1].dtype == x.dtype, inputs
    if op in (Op.LAYERNORM, Op.LAYERNORM_GRAD):
        _axis(op, -1, x.ndim, span, x.shape)
        attrs = {"eps": float(attrs["eps"])}
    return x.dtype, x.shape, attrs


@shape_rule(Op.SOFTMAX, Op.LOG_SOFTMAX)
def _softmax(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    (x,) = inputs
    _dtype_in(op, x, FLOATS, span)
    return x.dtype, x.shape, {"axis": _axis(op, attrs.get("axis", -1), x.ndim, span, x.shape)}


@shape_rule(Op.SOFTMAX_GRAD)
def _softmax_grad(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    y, g = inputs
    assert y.shape == g.shape and y.dtype == g.dtype, (y, g)
    return y.dtype, y.shape, {"axis": _axis(op, attrs["axis"], y.ndim, span, y.shape)}


def check_targets(op: Op, logits: Node, targets: Node, span: Span | None) -> None:
    """E-SHAPE-002 or -010 unless float `logits` ``[.. classes]`` fit int32 `targets` ``[..]``."""
    _dtype_in(op, logits, FLOATS, span)
    hint = "targets are class indices, one per row of logits"
    _int32("E-SHAPE-010", "cross-entropy: targets", targets, span, hint)
    if logits.ndim < 1 or logits.shape[:-1] != targets.shape:
        raise SexpgpuError(
            "E-SHAPE-010",
            f"cross-entropy: logits {format_shape(logits.shape)} and targets "
            f"{format_shape(targets.shape)} disagree",
            span,
            "targets must have the logits' shape without its last (class) axis",
        )


def loss_dtype(logits: DType) -> DType:
    """Cross-entropy's result dtype: f32 for bf16 logits (a loss is never bf16-quantized)."""
    return DType.F32 if logits is DType.BF16 else logits


@shape_rule(Op.CROSS_ENTROPY)
def _cross_entropy(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    logits, targets = inputs
    check_targets(op, logits, targets, span)
    return loss_dtype(logits.dtype), targets.shape, attrs


@shape_rule(Op.CROSS_ENTROPY_GRAD)
def _cross_entropy_grad(
    op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None
) -> Result:
    logits, targets, g = inputs
    check_targets(op, logits, targets, span)
    # g is the loss's cotangent: f32 for bf16 logits (a bf16 one is taken too).
    assert g.shape == targets.shape, (logits, g)
    assert g.dtype in (logits.dtype, loss_dtype(logits.dtype)), (logits, g)
    return logits.dtype, logits.shape, attrs


@shape_rule(Op.ATTENTION, Op.ATTENTION_GRAD)
def _attention(op: Op, inputs: tuple[Node, ...], attrs: Attrs, span: Span | None) -> Result:
    q, k, v = inputs[:3]
    dtype = _same_dtype(op, inputs, span)
    _dtype_in(op, q, FLOATS, span)
    fits = q.ndim >= 3 and k.shape == v.shape and k.ndim == q.ndim
    fits = fits and q.shape[:-3] == k.shape[:-3] and q.shape[-2:] == k.shape[-2:]
    heads, kv = (q.shape[-3], k.shape[-3]) if fits else (0, 0)
    if not (fits and kv and heads % kv == 0):
        listed = ", ".join(format_shape(x.shape) for x in (q, k, v))
        raise SexpgpuError(
            "E-SHAPE-011",
            f"attention: queries [.. H S D] and keys, values [.. K S D] with K dividing H "
            f"do not fit: {listed}",
            span,
            "split heads the same way for all three, e.g. [batch heads seq dim]; keys and "
            "values may have fewer heads",
        )
    if op is Op.ATTENTION_GRAD:
        assert inputs[3].shape == q.shape, inputs
    attrs = {"causal": bool(attrs["causal"]), "scale": float(attrs["scale"])}
    # The gradient packs dq, dk, dv along the head axis: [.. H+2K S D].
    shape = q.shape if op is Op.ATTENTION else (*q.shape[:-3], heads + 2 * kv, *q.shape[-2:])
    return dtype, shape, attrs
