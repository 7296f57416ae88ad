"""Fused ops as subgraphs of primitive ops: `DECOMPOSE[op](node, *inputs) -> Node`.

A backend lowers the fused ops it has kernels for and rewrites the rest
with `decompose`. Each rule builds, from the (possibly rewritten) operand
nodes, a subgraph computing what the fused op's NumPy implementation
computes (`sexpgpu.ir.numpy_fused`), in the same order where it matters
(attention scales ``q`` first and normalizes after the product with ``v``).
Every new node carries the fused node's span.

Dtypes: a fused op on ``bf16`` computes in f32 and rounds once, so a
decomposition casts bf16 operands to f32, works in f32 and casts the result
back (to the fused node's dtype: cross-entropy's is f32). The rewritten
graph therefore holds the [rows classes] or [.. seq seq] temporaries the
fused op avoids: decomposition trades memory for portability.

What decomposition loses: cross-entropy's check that every target id is a
class (E-DATA-006); an id out of range picks no logit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sexpgpu.ir import builder as b
from sexpgpu.ir.dtypes import DType
from sexpgpu.ir.node import Graph, Node
from sexpgpu.ir.ops import FUSED, Op

__all__ = ["DECOMPOSE", "decompose", "decomposition"]

DECOMPOSE: dict[Op, Callable[..., Node]] = {}

_GELU_C = math.sqrt(2 / math.pi)
_GELU_A = 0.044715


def decomposition(*ops: Op) -> Callable:
    """Register the decorated function as the decomposition of `ops`."""

    def decorate(fn: Callable[..., Node]) -> Callable[..., Node]:
        for op in ops:
            assert op not in DECOMPOSE, f"{op} decomposed twice"
            DECOMPOSE[op] = fn
        return fn

    return decorate


def decompose(graph: Graph, keep: Callable[[Op], bool]) -> Graph:
    """`graph` with every fused op that `keep` refuses rewritten into primitive ops.

    Parameters
    ----------
    graph
        The program.
    keep
        Whether a backend lowers fused `op` itself (True: the node stays).

    Returns
    -------
    Graph
        The same inputs, parameters and outputs (by name); nodes that
        neither are nor depend on a rewritten node are the same objects.
    """
    new: dict[int, Node] = {}
    for node in graph.nodes():
        inputs = tuple(new[id(x)] for x in node.inputs)
        if node.op in FUSED and not keep(node.op):
            result = DECOMPOSE[node.op](node, *inputs)
            assert result.shape == node.shape and result.dtype == node.dtype, (node, result)
        elif all(a is x for a, x in zip(inputs, node.inputs, strict=True)):
            result = node
        else:
            result = Node(node.op, node.dtype, node.shape, inputs, node.attrs, node.span)
        new[id(node)] = result
    leaves = [new[id(n)] for n in (*graph.inputs.values(), *graph.params.values())]
    return Graph.of({name: new[id(n)] for name, n in graph.outputs.items()}, leaves)


# ---------------------------------------------------------------- helpers


class _Build:
    """Builders bound to one fused node: its span, and its arithmetic dtype (bf16 -> f32)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.span = node.span
        self.dtype = DType.F32 if node.inputs[0].dtype is DType.BF16 else node.inputs[0].dtype

    def wide(self, x: Node) -> Node:
        """`x` in the arithmetic dtype."""
        return x if x.dtype == self.dtype else b.cast(x, self.dtype, span=self.span)

    def result(self, x: Node) -> Node:
        """`x` in the fused node's dtype (one rounding, as the fused op)."""
        return x if x.dtype == self.node.dtype else b.cast(x, self.node.dtype, span=self.span)

    def const(self, value: float) -> Node:
        return b.constant(value, self.dtype, span=self.span)

    def __getattr__(self, name: str) -> Callable[..., Node]:
        """``bld.mul(a, c)`` is ``b.mul(a, c, span=...)``."""
        fn = getattr(b, name)
        return lambda *args, **kwargs: fn(*args, span=self.span, **kwargs)


def _softmax_parts(bld: _Build, x: Node, axis: int) -> tuple[Node, Node]:
    """(exp(x - max), its sum) along `axis`, the sum with the axis kept."""
    top = bld.max(x, axes=axis, keepdims=True)
    e = bld.exp(bld.sub(x, top))
    return e, bld.sum(e, axes=axis, keepdims=True)


def _mean(bld: _Build, x: Node) -> Node:
    """The mean over the last axis, kept."""
    return bld.div(bld.sum(x, axes=-1, keepdims=True), bld.const(x.shape[-1]))


def _onehot(bld: _Build, logits: Node, targets: Node) -> Node:
    """True where the class (last axis of `logits`) is the row's target: ``[.. classes]``."""
    classes = bld.iota(logits.shape, logits.ndim - 1, "int32")
    return bld.eq(classes, bld.reshape(targets, (*targets.shape, 1)))


# ---------------------------------------------------------------- softmax family


@decomposition(Op.SOFTMAX)
def _softmax(node: Node, x: Node) -> Node:
    bld = _Build(node)
    e, total = _softmax_parts(bld, bld.wide(x), node.attrs["axis"])
    return bld.result(bld.div(e, total))


@decomposition(Op.LOG_SOFTMAX)
def _log_softmax(node: Node, x: Node) -> Node:
    # (x - max) - log(sum(exp(x - max)))
    bld = _Build(node)
    x, axis = bld.wide(x), node.attrs["axis"]
    shifted = bld.sub(x, bld.max(x, axes=axis, keepdims=True))
    total = bld.sum(bld.exp(shifted), axes=axis, keepdims=True)
    return bld.result(bld.sub(shifted, bld.log(total)))


@decomposition(Op.SOFTMAX_GRAD)
def _softmax_grad(node: Node, y: Node, g: Node) -> Node:
    # y * (g - sum(g * y))
    bld = _Build(node)
    y, g = bld.wide(y), bld.wide(g)
    dot = bld.sum(bld.mul(g, y), axes=node.attrs["axis"], keepdims=True)
    return bld.result(bld.mul(bld.sub(g, dot), y))


@decomposition(Op.CROSS_ENTROPY)
def _cross_entropy(node: Node, logits: Node, targets: Node) -> Node:
    # log(sum(exp(x - max))) + max - x[target], per row
    bld = _Build(node)
    x = bld.wide(logits)
    top = bld.max(x, axes=-1, keepdims=True)
    total = bld.sum(bld.exp(bld.sub(x, top)), axes=-1)
    picked = bld.sum(bld.where(_onehot(bld, x, targets), x, bld.const(0.0)), axes=-1)
    lse = bld.add(bld.log(total), bld.reshape(top, targets.shape))
    return bld.result(bld.sub(lse, picked))


@decomposition(Op.CROSS_ENTROPY_GRAD)
def _cross_entropy_grad(node: Node, logits: Node, targets: Node, g: Node) -> Node:
    # g[..., None] * (softmax(x) - onehot(targets))
    bld = _Build(node)
    x = bld.wide(logits)
    e, total = _softmax_parts(bld, x, -1)
    hot = bld.cast(_onehot(bld, x, targets), bld.dtype)
    scale = bld.reshape(bld.wide(g), (*g.shape, 1))
    return bld.result(bld.mul(bld.sub(bld.div(e, total), hot), scale))


# ---------------------------------------------------------------- attention


def _attention_weights(bld: _Build, node: Node, q: Node, k: Node) -> tuple[Node, Node]:
    """(exp(q k^T * scale [masked] - rowmax), its row sums kept): ``[.. S S]``, ``[.. S 1]``."""
    scaled = bld.mul(q, bld.const(node.attrs["scale"]))
    s = bld.matmul(scaled, bld.transpose(k))  # (.. S S)
    if node.attrs["causal"]:
        n = q.shape[-2]
        rows, cols = bld.iota((n, n), 0, "int32"), bld.iota((n, n), 1, "int32")
        s = bld.where(bld.le(cols, rows), s, bld.const(float("-inf")))
    return _softmax_parts(bld, s, -1)


def _repeated(bld: _Build, x: Node, heads: int) -> Node:
    """Keys or values ``[.. K S D]`` repeated for their query heads, ``[.. H S D]``."""
    kv, lead, tail = x.shape[-3], x.shape[:-3], x.shape[-2:]
    if kv == heads:
        return x
    wide = bld.broadcast_to(bld.reshape(x, (*lead, kv, 1, *tail)), (*lead, kv, heads // kv, *tail))
    return bld.reshape(wide, (*lead, heads, *tail))


def _group_sum(bld: _Build, x: Node, kv: int) -> Node:
    """A gradient ``[.. H S D]`` summed over each key/value head's group, ``[.. K S D]``."""
    heads, lead, tail = x.shape[-3], x.shape[:-3], x.shape[-2:]
    if kv == heads:
        return x
    grouped = bld.reshape(x, (*lead, kv, heads // kv, *tail))
    return bld.sum(grouped, axes=len(lead) + 1)


@decomposition(Op.ATTENTION)
def _attention(node: Node, q: Node, k: Node, v: Node) -> Node:
    # Rows normalized after the product with v, as the fused op.
    bld = _Build(node)
    heads = q.shape[-3]
    q, k, v = bld.wide(q), _repeated(bld, bld.wide(k), heads), _repeated(bld, bld.wide(v), heads)
    e, total = _attention_weights(bld, node, q, k)
    return bld.result(bld.div(bld.matmul(e, v), total))


@decomposition(Op.ATTENTION_GRAD)
def _attention_grad(node: Node, q: Node, k: Node, v: Node, g: Node) -> Node:
    # w = softmax(q k^T s); dv = w^T g; ds = w * (g v^T - rowsum(w * g v^T));
    # dq = ds (k s); dk = ds^T (q s); dk, dv summed over each group of query
    # heads; [dq dk dv] joined on the head axis.
    bld = _Build(node)
    heads, kv = q.shape[-3], k.shape[-3]
    q, g = bld.wide(q), bld.wide(g)
    k, v = _repeated(bld, bld.wide(k), heads), _repeated(bld, bld.wide(v), heads)
    e, total = _attention_weights(bld, node, q, k)
    w = bld.div(e, total)
    dv = bld.matmul(bld.transpose(w), g)
    ds = bld.matmul(g, bld.transpose(v))
    ds = bld.mul(bld.sub(ds, bld.sum(bld.mul(ds, w), axes=-1, keepdims=True)), w)
    scale = bld.const(node.attrs["scale"])
    dq = bld.matmul(ds, bld.mul(k, scale))
    dk = bld.matmul(bld.transpose(ds), bld.mul(q, scale))
    parts = [dq, _group_sum(bld, dk, kv), _group_sum(bld, dv, kv)]
    return bld.result(bld.concat(parts, axis=q.ndim - 3))


# ---------------------------------------------------------------- layernorm, gelu


def _normalized(bld: _Build, x: Node, eps: float) -> tuple[Node, Node]:
    """((x - mean) * rstd, rstd) over the last axis, rstd = 1 / sqrt(var + eps)."""
    centered = bld.sub(x, _mean(bld, x))
    var = _mean(bld, bld.mul(centered, centered))
    rstd = bld.rsqrt(bld.add(var, bld.const(eps)))
    return bld.mul(centered, rstd), rstd


@decomposition(Op.LAYERNORM)
def _layernorm(node: Node, x: Node) -> Node:
    bld = _Build(node)
    return bld.result(_normalized(bld, bld.wide(x), node.attrs["eps"])[0])


@decomposition(Op.LAYERNORM_GRAD)
def _layernorm_grad(node: Node, x: Node, g: Node) -> Node:
    # rstd * (g - mean(g) - xhat * mean(g * xhat))
    bld = _Build(node)
    x, g = bld.wide(x), bld.wide(g)
    xhat, rstd = _normalized(bld, x, node.attrs["eps"])
    proj = _mean(bld, bld.mul(g, xhat))
    rest = bld.sub(bld.sub(g, _mean(bld, g)), bld.mul(xhat, proj))
    return bld.result(bld.mul(rest, rstd))


def _gelu_tanh(bld: _Build, x: Node) -> Node:
    """tanh(sqrt(2/pi) x (1 + 0.044715 x^2))."""
    square = bld.mul(x, x)
    inner = bld.mul(bld.add(bld.mul(square, bld.const(_GELU_A)), bld.const(1.0)), x)
    return bld.tanh(bld.mul(inner, bld.const(_GELU_C)))


@decomposition(Op.GELU)
def _gelu(node: Node, x: Node) -> Node:
    # 0.5 x (1 + t)
    bld = _Build(node)
    x = bld.wide(x)
    t = _gelu_tanh(bld, x)
    return bld.result(bld.mul(bld.mul(bld.add(t, bld.const(1.0)), x), bld.const(0.5)))


@decomposition(Op.GELU_GRAD)
def _gelu_grad(node: Node, x: Node, g: Node) -> Node:
    # g * (0.5 (1 + t) + (1 - t^2) * 0.5 sqrt(2/pi) x (1 + 3 * 0.044715 x^2))
    bld = _Build(node)
    x, g = bld.wide(x), bld.wide(g)
    t = _gelu_tanh(bld, x)
    slope = bld.add(bld.mul(bld.mul(x, x), bld.const(3 * _GELU_A)), bld.const(1.0))
    slope = bld.mul(bld.mul(slope, x), bld.const(0.5 * _GELU_C))
    slope = bld.mul(slope, bld.sub(bld.const(1.0), bld.mul(t, t)))
    half = bld.mul(bld.add(t, bld.const(1.0)), bld.const(0.5))
    return bld.result(bld.mul(g, bld.add(slope, half)))


assert frozenset(DECOMPOSE) == FUSED
