"""Vocabulary entries with parameters (layers) and the losses.

Each layer's parameters are named under the call's own path segment
(``gpt/block.3/attention/wq``); see `sexpgpu.ir.trace` for the naming rule.

=============  ================================  ===================================
layer          parameters                        initial values
=============  ================================  ===================================
linear         weight ``[in n]``, bias ``[n]``   xavier, zeros
embed          weight ``[vocab width]``          (normal 0.02)
layernorm      weight, bias ``[width]``          ones, zeros
rmsnorm        weight ``[width]``                ones
attention      wq wk wv wo ``[width width]``,    xavier, zeros
               bq bk bv bo ``[width]``
=============  ================================  ===================================

Norms use ``:eps 1e-5``. ``attention`` is multi-head scaled dot-product
self-attention: ``softmax(q k^T / sqrt(d)) v`` per head with ``d = width /
heads``, masked to earlier positions when ``:causal true``, then the output
projection. The product is the IR's fused ATTENTION op, whose backward
recomputes the weights, so no ``[seq seq]`` value is kept per layer.
"""

from __future__ import annotations

import math

from sexpgpu.errors import SexpgpuError, Span
from sexpgpu.ir import builder as b
from sexpgpu.ir.dtypes import FLOATS, DType
from sexpgpu.ir.node import Node
from sexpgpu.ir.ops import Op
from sexpgpu.ir.shape_rules import check_targets, format_shape
from sexpgpu.ir.trace_call import Call
from sexpgpu.ir.trace_init import Init
from sexpgpu.ir.vocabulary_table import entry, mean_over

__all__: list[str] = []

_XAVIER = Init("xavier")
_ZEROS = Init("zeros")
_ONES = Init("ones")
_EMBED = Init("normal", (0.02,))


def _features(cx: Call, x: Node) -> int:
    if x.ndim < 1:
        raise cx.fail(
            f"{cx.name} needs a tensor with a feature axis, found a scalar",
            "pass a [.. features] tensor",
            0,
        )
    return x.shape[-1]


def _affine(x: Node, w: Node, bias: Node | None, span: Span) -> Node:
    """``x @ w + bias`` over the last axis, as one 2-D product (``[rows in] @ [in n]``)."""
    rows = x if x.ndim == 2 else b.reshape(x, (-1, x.shape[-1]), span=span)
    y = b.matmul(rows, w, span=span)
    if bias is not None:
        y = b.add(y, bias, span=span)
    return y if x.ndim == 2 else b.reshape(y, (*x.shape[:-1], w.shape[-1]), span=span)


@entry("linear", "(linear x n :bias true)", (2, 2), keywords={"bias": True}, layer=True)
def _linear(cx: Call) -> Node:
    x = cx.tensor(0)
    n_in, n_out = _features(cx, x), cx.integer(1, minimum=1)
    w = cx.param("weight", (n_in, n_out), _XAVIER)
    bias = cx.param("bias", (n_out,), _ZEROS) if cx.boolean("bias") else None
    return _affine(x, w, bias, cx.span)


@entry("embed", "(embed ids vocab width)", (3, 3), layer=True)
def _embed(cx: Call) -> Node:
    ids = cx.tensor(0)
    table = cx.param("weight", (cx.integer(1, minimum=1), cx.integer(2, minimum=1)), _EMBED)
    return b.take(table, ids, span=cx.span)


def _rms_normalize(x: Node, eps: float, span: Span) -> Node:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis."""
    power = mean_over(b.mul(x, x, span=span), (-1,), True, span)
    inv = b.rsqrt(b.add(power, b.constant(eps, x.dtype, span=span), span=span), span=span)
    return b.mul(x, inv, span=span)


@entry("layernorm", "(layernorm x :eps 1e-5)", keywords={"eps": 1e-5}, layer=True)
def _layernorm(cx: Call) -> Node:
    x = cx.tensor(0)
    width = _features(cx, x)
    w, bias = cx.param("weight", (width,), _ONES), cx.param("bias", (width,), _ZEROS)
    y = b.layernorm(x, cx.number("eps"), span=cx.span)  # fused: the VJP recomputes the statistics
    return b.add(b.mul(y, w, span=cx.span), bias, span=cx.span)


@entry("rmsnorm", "(rmsnorm x :eps 1e-5)", keywords={"eps": 1e-5}, layer=True)
def _rmsnorm(cx: Call) -> Node:
    x = cx.tensor(0)
    w = cx.param("weight", (_features(cx, x),), _ONES)
    return b.mul(_rms_normalize(x, cx.number("eps"), cx.span), w, span=cx.span)


@entry(
    "attention",
    "(attention x :heads H :causal false)",
    keywords={"heads": 1, "causal": False},
    layer=True,
)
def _attention(cx: Call) -> Node:
    x, span = cx.tensor(0), cx.span
    heads, causal = cx.integer("heads", minimum=1), cx.boolean("causal")
    if x.ndim < 2:
        raise cx.fail(
            f"attention needs a [.. seq width] tensor, found {format_shape(x.shape)}",
            "pass the sequence as the second-to-last axis",
            0,
        )
    seq, width = x.shape[-2:]
    if width % heads:
        raise cx.fail(
            f"attention: width {width} does not split into {heads} heads",
            f"choose :heads dividing {width}",
            "heads",
        )
    d = width // heads
    lead = math.prod(x.shape[:-2])

    def project(name: str) -> Node:  # (N S W) -> (N S H D)
        w = cx.param(f"w{name}", (width, width), _XAVIER)
        bias = cx.param(f"b{name}", (width,), _ZEROS)
        return b.reshape(_affine(x, w, bias, span), (lead, seq, heads, d), span=span)

    q, k, v = (b.transpose(project(n), (0, 2, 1, 3), span=span) for n in "qkv")  # (N H S D)
    # Fused: the (N H S S) weights are never stored; the backward recomputes them.
    y = b.attention(q, k, v, causal, scale=1.0 / math.sqrt(d), span=span)  # (N H S D)
    y = b.reshape(b.transpose(y, (0, 2, 1, 3), span=span), (*x.shape[:-1], width), span=span)
    wo, bo = cx.param("wo", (width, width), _XAVIER), cx.param("bo", (width,), _ZEROS)
    return _affine(y, wo, bo, span)


# ---------------------------------------------------------------- losses


@entry("cross-entropy", "(cross-entropy logits targets)", (2, 2))
def _cross_entropy(cx: Call) -> Node:
    logits, targets = cx.tensor(0), cx.tensor(1)
    # Checked before the rows are flattened, which could make other shapes agree.
    check_targets(Op.CROSS_ENTROPY, logits, targets, cx.span)
    if logits.ndim != 2:
        logits = b.reshape(logits, (-1, logits.shape[-1]), span=cx.span)
        targets = b.reshape(targets, (-1,), span=cx.span)
    return mean_over(b.cross_entropy(logits, targets, span=cx.span), None, False, cx.span)


@entry("mse", "(mse prediction target)", (2, 2))
def _mse(cx: Call) -> Node:
    pred, target = cx.tensors([0, 1])
    _check_mse(cx, pred, target)
    diff = b.sub(pred, target, span=cx.span)
    if diff.dtype is DType.BF16:  # the loss and its sum are f32, as cross-entropy's
        diff = b.cast(diff, DType.F32, span=cx.span)
    return mean_over(b.mul(diff, diff, span=cx.span), None, False, cx.span)


def _check_mse(cx: Call, pred: Node, target: Node) -> None:
    """E-SHAPE-002 unless both are floats of one dtype; E-SHAPE-013 unless one shape.

    NumPy would broadcast ``[32 1]`` against ``[32]`` to ``[32 32]`` and
    average the wrong thing, so the loss takes no broadcast; a number as
    either operand (a rank-0 constant) is the one exception.
    """
    for i, node in enumerate((pred, target)):
        if node.dtype not in FLOATS:
            raise SexpgpuError(
                "E-SHAPE-002",
                f"mse: the {('prediction', 'target')[i]} {cx.text(i)} has dtype {node.dtype}, "
                "not a float",
                cx.where(i),
                f"cast it first: (cast {cx.text(i)} :dtype {cx.dtype})",
            )
    if pred.dtype != target.dtype:
        raise SexpgpuError(
            "E-SHAPE-002",
            f"mse: prediction and target dtypes differ: {pred.dtype} and {target.dtype}",
            cx.span,
            f"cast one: (cast {cx.text(1)} :dtype {pred.dtype})",
        )
    if pred.shape != target.shape and pred.ndim and target.ndim:
        fix = (
            f"reshape the target: (reshape {cx.text(1)} {format_shape(pred.shape)})"
            if pred.size == target.size
            else "make the prediction and the target the same shape"
        )
        raise SexpgpuError(
            "E-SHAPE-013",
            f"mse: prediction {format_shape(pred.shape)} and target "
            f"{format_shape(target.shape)} differ in shape (a loss does not broadcast)",
            cx.span,
            fix,
        )
