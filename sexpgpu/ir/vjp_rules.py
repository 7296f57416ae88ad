"""VJP rules: each op's operand cotangents as IR nodes.

A rule gets the forward node, the cotangent `g` of its result and `needs`
(which operands want a cotangent) and returns one node or None per operand.
Every node it builds carries the forward node's span, so an error in the
backward pass points at the form that made the forward value. Operands that
were broadcast get their cotangent summed back to their own shape.
"""

from __future__ import annotations

from sexpgpu.errors import Span
from sexpgpu.ir import builder as b
from sexpgpu.ir.dtypes import FLOATS
from sexpgpu.ir.node import Node, Shape
from sexpgpu.ir.ops import Op
from sexpgpu.ir.rules import vjp_rule

__all__ = ["unbroadcast"]

Grads = tuple[Node | None, ...]
Needs = tuple[bool, ...]


def unbroadcast(g: Node, shape: Shape, span: Span | None) -> Node:
    """Sum `g` over the axes that broadcasting added or stretched, down to `shape`.

    The new nodes take `span`: the forward node's, not the cotangent's (which
    points at whatever used the forward value).
    """
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = [*range(lead)] + [
        lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1
    ]
    summed = b.sum(g, axes=axes, span=span) if axes else g
    return b.reshape(summed, shape, span=span) if summed.shape != shape else summed


def _const(node: Node, value: float) -> Node:
    return b.constant(value, node.dtype, span=node.span)


@vjp_rule(Op.NEG)
def _neg(node: Node, g: Node, needs: Needs) -> Grads:
    return (b.neg(g, span=node.span),)


@vjp_rule(Op.EXP)
def _exp(node: Node, g: Node, needs: Needs) -> Grads:
    return (b.mul(g, node, span=node.span),)


@vjp_rule(Op.LOG)
def _log(node: Node, g: Node, needs: Needs) -> Grads:
    return (b.div(g, node.inputs[0], span=node.span),)


@vjp_rule(Op.SQRT)
def _sqrt(node: Node, g: Node, needs: Needs) -> Grads:
    s = node.span
    return (b.div(b.mul(g, _const(node, 0.5), span=s), node, span=s),)


@vjp_rule(Op.RSQRT)
def _rsqrt(node: Node, g: Node, needs: Needs) -> Grads:
    # d/dx x^-1/2 = -1/2 x^-3/2 = -1/2 y / x
    s = node.span
    scaled = b.mul(g, _const(node, -0.5), span=s)
    return (b.mul(scaled, b.div(node, node.inputs[0], span=s), span=s),)


@vjp_rule(Op.TANH)
def _tanh(node: Node, g: Node, needs: Needs) -> Grads:
    s = node.span
    slope = b.sub(_const(node, 1.0), b.mul(node, node, span=s), span=s)
    return (b.mul(g, slope, span=s),)


@vjp_rule(Op.SIN)
def _sin(node: Node, g: Node, needs: Needs) -> Grads:
    return (b.mul(g, b.cos(node.inputs[0], span=node.span), span=node.span),)


@vjp_rule(Op.COS)
def _cos(node: Node, g: Node, needs: Needs) -> Grads:
    s = node.span
    return (b.neg(b.mul(g, b.sin(node.inputs[0], span=s), span=s), span=s),)


@vjp_rule(Op.SIGMOID)
def _sigmoid(node: Node, g: Node, needs: Needs) -> Grads:
    s = node.span
    slope = b.mul(node, b.sub(_const(node, 1.0), node, span=s), span=s)
    return (b.mul(g, slope, span=s),)


@vjp_rule(Op.ABS)
def _abs(node: Node, g: Node, needs: Needs) -> Grads:
    return (b.mul(g, b.sign(node.inputs[0], span=node.span), span=node.span),)


@vjp_rule(Op.CAST)
def _cast(node: Node, g: Node, needs: Needs) -> Grads:
    (x,) = node.inputs
    if x.dtype not in FLOATS or g.dtype not in FLOATS:
        return (None,)
    return (b.cast(g, x.dtype, span=node.span),)


@vjp_rule(Op.ADD, Op.SUB)
def _add(node: Node, g: Node, needs: Needs) -> Grads:
    a, c = node.inputs
    gc = b.neg(g, span=node.span) if node.op is Op.SUB and needs[1] else g
    return unbroadcast(g, a.shape, node.span), unbroadcast(gc, c.shape, node.span)


@vjp_rule(Op.MUL)
def _mul(node: Node, g: Node, needs: Needs) -> Grads:
    a, c = node.inputs
    s = node.span
    ga = unbroadcast(b.mul(g, c, span=s), a.shape, s) if needs[0] else None
    gc = unbroadcast(b.mul(g, a, span=s), c.shape, s) if needs[1] else None
    return ga, gc


@vjp_rule(Op.DIV)
def _div(node: Node, g: Node, needs: Needs) -> Grads:
    a, c = node.inputs
    s = node.span
    ga = unbroadcast(b.div(g, c, span=s), a.shape, s) if needs[0] else None
    gc = None
    if needs[1]:  # -g * a / c^2 = -(g * y) / c
        gc = unbroadcast(b.neg(b.div(b.mul(g, node, span=s), c, span=s), span=s), c.shape, s)
    return ga, gc


@vjp_rule(Op.POW)
def _pow(node: Node, g: Node, needs: Needs) -> Grads:
    a, c = node.inputs
    s = node.span
    ga = gc = None
    if needs[0]:  # g * c * a^(c-1)
        lower = b.pow(a, b.sub(c, _const(node, 1.0), span=s), span=s)
        ga = unbroadcast(b.mul(g, b.mul(c, lower, span=s), span=s), a.shape, s)
    if needs[1]:  # g * y * log(a)
        gc = unbroadcast(b.mul(b.mul(g, node, span=s), b.log(a, span=s), span=s), c.shape, s)
    return ga, gc


@vjp_rule(Op.MAXIMUM, Op.MINIMUM)
def _extremum(node: Node, g: Node, needs: Needs) -> Grads:
    # The winner takes the cotangent; ties share it equally (as PyTorch does).
    a, c = node.inputs
    s = node.span
    wins = b.lt(c, a, span=s) if node.op is Op.MAXIMUM else b.lt(a, c, span=s)
    ties = b.mul(b.cast(b.eq(a, c, span=s), node.dtype, span=s), _const(node, 0.5), span=s)
    share = b.add(b.cast(wins, node.dtype, span=s), ties, span=s)
    ga = unbroadcast(b.mul(g, share, span=s), a.shape, s) if needs[0] else None
    rest = b.sub(_const(node, 1.0), share, span=s)
    gc = unbroadcast(b.mul(g, rest, span=s), c.shape, s) if needs[1] else None
    return ga, gc


@vjp_rule(Op.WHERE)
def _where(node: Node, g: Node, needs: Needs) -> Grads:
    cond, a, c = node.inputs
    s = node.span
    zero = _const(node, 0.0)
    ga = unbroadcast(b.where(cond, g, zero, span=s), a.shape, s) if needs[1] else None
    gc = unbroadcast(b.where(cond, zero, g, span=s), c.shape, s) if needs[2] else None
    return None, ga, gc


def _keep(node: Node, value: Node) -> Node:
    """A reduction's result (or cotangent) with its reduced axes kept as size 1."""
    (x,) = node.inputs
    axes = node.attrs["axes"]
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    return value if value.shape == shape else b.reshape(value, shape, span=node.span)


@vjp_rule(Op.SUM)
def _sum(node: Node, g: Node, needs: Needs) -> Grads:
    (x,) = node.inputs
    return (b.broadcast_to(_keep(node, g), x.shape, span=node.span),)


@vjp_rule(Op.MAX)
def _max(node: Node, g: Node, needs: Needs) -> Grads:
    # Spread the cotangent evenly over the positions that hold the maximum.
    (x,) = node.inputs
    s = node.span
    hits = b.cast(b.eq(x, _keep(node, node), span=s), x.dtype, span=s)
    count = b.sum(hits, axes=node.attrs["axes"], keepdims=True, span=s)
    return (b.mul(hits, b.div(_keep(node, g), count, span=s), span=s),)


@vjp_rule(Op.RESHAPE)
def _reshape(node: Node, g: Node, needs: Needs) -> Grads:
    return (b.reshape(g, node.inputs[0].shape, span=node.span),)


@vjp_rule(Op.TRANSPOSE)
def _transpose(node: Node, g: Node, needs: Needs) -> Grads:
    axes = node.attrs["axes"]
    inverse = sorted(range(len(axes)), key=axes.__getitem__)
    return (b.transpose(g, inverse, span=node.span),)


@vjp_rule(Op.BROADCAST_TO)
def _broadcast_to(node: Node, g: Node, needs: Needs) -> Grads:
    return (unbroadcast(g, node.inputs[0].shape, node.span),)


@vjp_rule(Op.SLICE)
def _slice(node: Node, g: Node, needs: Needs) -> Grads:
    axis, start, stop = (node.attrs[k] for k in ("axis", "start", "stop"))
    size = node.inputs[0].shape[axis]
    return (b.pad(g, axis, start, size - stop, span=node.span),)


@vjp_rule(Op.PAD)
def _pad(node: Node, g: Node, needs: Needs) -> Grads:
    axis, before = node.attrs["axis"], node.attrs["before"]
    size = node.inputs[0].shape[axis]
    return (b.slice(g, axis, before, before + size, span=node.span),)


@vjp_rule(Op.CONCAT)
def _concat(node: Node, g: Node, needs: Needs) -> Grads:
    axis, start, grads = node.attrs["axis"], 0, []
    for x, need in zip(node.inputs, needs, strict=True):
        stop = start + x.shape[axis]
        grads.append(b.slice(g, axis, start, stop, span=node.span) if need else None)
        start = stop
    return tuple(grads)


@vjp_rule(Op.TAKE)
def _take(node: Node, g: Node, needs: Needs) -> Grads:
    table, ids = node.inputs
    return b.scatter_add(ids, g, rows=table.shape[0], span=node.span), None


@vjp_rule(Op.SCATTER_ADD)
def _scatter_add(node: Node, g: Node, needs: Needs) -> Grads:
    ids, _ = node.inputs
    return None, b.take(g, ids, span=node.span)


@vjp_rule(Op.MATMUL)
def _matmul(node: Node, g: Node, needs: Needs) -> Grads:
    a, c = node.inputs
    s = node.span
    ga = gc = None
    if needs[0]:  # g @ c^T, summed over broadcast batch axes
        ga = unbroadcast(b.matmul(g, b.transpose(c, span=s), span=s), a.shape, s)
    if needs[1] and c.ndim == 2 and a.ndim > 2:
        # A weight shared by every row: one (K, rows) @ (rows, N) product.
        rows_a = b.reshape(a, (-1, a.shape[-1]), span=s)
        rows_g = b.reshape(g, (-1, g.shape[-1]), span=s)
        gc = b.matmul(b.transpose(rows_a, span=s), rows_g, span=s)
    elif needs[1]:
        gc = unbroadcast(b.matmul(b.transpose(a, span=s), g, span=s), c.shape, s)
    return ga, gc


@vjp_rule(Op.SOFTMAX)
def _softmax(node: Node, g: Node, needs: Needs) -> Grads:
    return (b.softmax_grad(node, g, node.attrs["axis"], span=node.span),)


@vjp_rule(Op.LOG_SOFTMAX)
def _log_softmax(node: Node, g: Node, needs: Needs) -> Grads:
    # g - softmax(x) * sum(g)
    s, axis = node.span, node.attrs["axis"]
    total = b.sum(g, axes=axis, keepdims=True, span=s)
    return (b.sub(g, b.mul(b.exp(node, span=s), total, span=s), span=s),)


@vjp_rule(Op.CROSS_ENTROPY)
def _cross_entropy(node: Node, g: Node, needs: Needs) -> Grads:
    logits, targets = node.inputs
    return b.cross_entropy_grad(logits, targets, g, span=node.span), None


@vjp_rule(Op.ATTENTION)
def _attention(node: Node, g: Node, needs: Needs) -> Grads:
    s, (q, k, _) = node.span, node.inputs
    packed = b.attention_grad(*node.inputs, g, **node.attrs, span=s)  # [.. H+2K S D]
    heads, kv, axis = q.shape[-3], k.shape[-3], q.ndim - 3
    bounds = ((0, heads), (heads, heads + kv), (heads + kv, heads + 2 * kv))
    return tuple(
        b.slice(packed, axis, lo, hi, span=s) if need else None
        for (lo, hi), need in zip(bounds, needs, strict=True)
    )


@vjp_rule(Op.LAYERNORM)
def _layernorm(node: Node, g: Node, needs: Needs) -> Grads:
    return (b.layernorm_grad(node.inputs[0], g, node.attrs["eps"], span=node.span),)


@vjp_rule(Op.GELU)
def _gelu(node: Node, g: Node, needs: Needs) -> Grads:
    return (b.gelu_grad(node.inputs[0], g, span=node.span),)
