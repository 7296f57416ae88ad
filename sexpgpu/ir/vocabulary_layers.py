"""Vocabulary entries with parameters (layers), the attention pieces, dropout and the losses.

Each layer's parameters are named under the call's own path segment
(``gpt/block.3/attention/wq``); see `sexpgpu.ir.trace` for the naming rule.

=============  ================================  ===================================
layer          parameters                        initial values
=============  ================================  ===================================
linear         weight ``[in n]``, bias ``[n]``   xavier (or ``:init``), zeros
embed          weight ``[vocab width]``          (normal 0.02) (or ``:init``)
layernorm      weight, bias ``[width]``          ones, zeros (``:bias false``: none)
rmsnorm        weight ``[width]``                ones
attention      wq wo ``[width width]``,          xavier, zeros (``:bias false``:
               wk wv ``[width kv*d]``, biases    no biases)
=============  ================================  ===================================

Norms use ``:eps 1e-5``. ``attention`` is multi-head scaled dot-product
self-attention composed of the pieces users can call themselves: the
projections, `rotary` (``rope``) on queries and keys when ``:rope BASE``,
``sdpa`` (``softmax(q k^T / sqrt(d)) v`` per head, key and value heads
shared by groups of query heads), then the output projection. The product
is the IR's fused ATTENTION op, which takes the grouped heads as they are
and whose backward recomputes the weights, so no ``[seq seq]`` value is
kept per layer.
``dropout`` draws its masks from the microbatch's random key (docs/ir.md,
"Random numbers") and is replaced by its operand in evaluation.
"""

from __future__ import annotations

import math

from sexpgpu.errors import SexpgpuError, Span
from sexpgpu.ir import builder as b
from sexpgpu.ir.dtypes import FLOATS, DType
from sexpgpu.ir.node import Node
from sexpgpu.ir.ops import Op
from sexpgpu.ir.shape_rules import check_targets, format_shape
from sexpgpu.ir.trace_call import Call, describe_value
from sexpgpu.ir.trace_init import Init
from sexpgpu.ir.vocabulary_table import entry, mean_over

__all__ = ["dropped", "rotary"]

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


@entry(
    "linear",
    "(linear x n :bias true :init xavier)",
    (2, 2),
    keywords={"bias": True, "init": None},
    layer=True,
)
def _linear(cx: Call) -> Node:
    x = cx.tensor(0)
    n_in, n_out = _features(cx, x), cx.integer(1, minimum=1)
    w = cx.param("weight", (n_in, n_out), _init_of(cx, _XAVIER))
    bias = cx.param("bias", (n_out,), _ZEROS) if cx.boolean("bias") else None
    return _affine(x, w, bias, cx.span)


def _init_of(cx: Call, default: Init) -> Init:
    """The call's ``:init`` (read by the tracer as `param` reads one), else `default`."""
    init = cx.get("init")
    return default if init is None else init


@entry(
    "embed",
    "(embed ids vocab width :init (normal 0.02))",
    (3, 3),
    keywords={"init": None},
    layer=True,
)
def _embed(cx: Call) -> Node:
    ids = cx.tensor(0)
    shape = (cx.integer(1, minimum=1), cx.integer(2, minimum=1))
    table = cx.param("weight", shape, _init_of(cx, _EMBED))
    return b.take(table, ids, span=cx.span)


def _rms_normalize(x: Node, eps: float, span: Span) -> Node:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis."""
    power = mean_over(b.mul(x, x, span=span), (-1,), True, span)
    inv = b.rsqrt(b.add(power, b.constant(eps, x.dtype, span=span), span=span), span=span)
    return b.mul(x, inv, span=span)


@entry(
    "layernorm",
    "(layernorm x :eps 1e-5 :bias true)",
    keywords={"eps": 1e-5, "bias": True},
    layer=True,
)
def _layernorm(cx: Call) -> Node:
    x = cx.tensor(0)
    width = _features(cx, x)
    w = cx.param("weight", (width,), _ONES)
    bias = cx.param("bias", (width,), _ZEROS) if cx.boolean("bias") else None
    eps = cx.number("eps", positive=True)
    y = b.layernorm(x, eps, span=cx.span)  # fused: the VJP recomputes the statistics
    y = b.mul(y, w, span=cx.span)
    return y if bias is None else b.add(y, bias, span=cx.span)


@entry("rmsnorm", "(rmsnorm x :eps 1e-5)", keywords={"eps": 1e-5}, layer=True)
def _rmsnorm(cx: Call) -> Node:
    x = cx.tensor(0)
    w = cx.param("weight", (_features(cx, x),), _ONES)
    return b.mul(_rms_normalize(x, cx.number("eps", positive=True), cx.span), w, span=cx.span)


@entry(
    "attention",
    "(attention x :heads H :kv-heads K :bias true :rope false :causal false)",
    keywords={"heads": 1, "kv-heads": None, "bias": True, "rope": False, "causal": False},
    layer=True,
)
def _attention(cx: Call) -> Node:
    x, span = cx.tensor(0), cx.span
    heads, causal, bias = cx.integer("heads", minimum=1), cx.boolean("causal"), cx.boolean("bias")
    kv = heads if cx.get("kv-heads") is None else cx.integer("kv-heads", minimum=1)
    base = _rope_option(cx)
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
    if heads % kv:
        raise cx.fail(
            f"attention: {kv} key/value heads do not divide {heads} query heads",
            f"choose :kv-heads dividing {heads} (1 for multi-query attention)",
            "kv-heads",
        )
    d = width // heads
    if base is not None and d % 2:
        raise cx.fail(
            f"attention: `:rope` needs an even head size, found {d} "
            f"(width {width} / {heads} heads)",
            "choose :heads so that width / heads is even, or :rope false",
            "rope",
        )
    lead = math.prod(x.shape[:-2])

    def project(name: str, count: int) -> Node:  # (N S W) -> (N S count D)
        w = cx.param(f"w{name}", (width, count * d), _XAVIER)
        bias_ = cx.param(f"b{name}", (count * d,), _ZEROS) if bias else None
        return b.reshape(_affine(x, w, bias_, span), (lead, seq, count, d), span=span)

    q, k, v = project("q", heads), project("k", kv), project("v", kv)
    if base is not None:
        q, k = rotary(q, base, span), rotary(k, base, span)
    q, k, v = (b.transpose(t, (0, 2, 1, 3), span=span) for t in (q, k, v))  # (N H S D)
    y = b.attention(q, k, v, causal, scale=1.0 / math.sqrt(d), span=span)  # (N H S D)
    y = b.reshape(b.transpose(y, (0, 2, 1, 3), span=span), (*x.shape[:-1], width), span=span)
    wo = cx.param("wo", (width, width), _XAVIER)
    bo = cx.param("bo", (width,), _ZEROS) if bias else None
    return _affine(y, wo, bo, span)


def _rope_option(cx: Call) -> float | None:
    """``:rope``: false (None), or a positive base such as 10000.0."""
    value = cx.get("rope")
    if value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise cx.fail(
            f"attention: `:rope` must be false or a positive base, found {describe_value(value)}",
            "write :rope 10000.0 (Llama's base) or :rope false",
            "rope",
        )
    return float(value)


# ---------------------------------------------------------------- attention pieces


def rotary(x: Node, base: float, span: Span | None = None) -> Node:
    """Rotary position embeddings on ``[.. seq heads d]``: the half-split rotation.

    With ``x1, x2`` the first and second halves of the last axis and
    ``theta[s, i] = s * base ** (-2 i / d)``, the result is
    ``concat(x1 cos - x2 sin, x2 cos + x1 sin)`` (Llama's and GPT-NeoX's
    convention, not GPT-J's interleaved pairs). The tables are made in f32
    (f64 for f64) from iotas, folded to constants at compile time, and cast
    to x's dtype.
    """
    seq, d = x.shape[-3], x.shape[-1]
    half = d // 2
    wide = DType.F64 if x.dtype is DType.F64 else DType.F32  # the tables' arithmetic
    pos = b.cast(b.iota((seq, 1, half), 0, span=span), wide, span=span)
    index = b.cast(b.iota((seq, 1, half), 2, span=span), wide, span=span)
    exponent = b.mul(index, b.constant(2.0 / d, wide, span=span), span=span)
    inv_freq = b.div(
        b.constant(1.0, wide, span=span),
        b.pow(b.constant(base, wide, span=span), exponent, span=span),
        span=span,
    )
    theta = b.mul(pos, inv_freq, span=span)  # (S 1 d/2)
    cos, sin = (b.cast(fn(theta, span=span), x.dtype, span=span) for fn in (b.cos, b.sin))
    x1, x2 = b.slice(x, -1, 0, half, span=span), b.slice(x, -1, half, d, span=span)
    first = b.sub(b.mul(x1, cos, span=span), b.mul(x2, sin, span=span), span=span)
    second = b.add(b.mul(x2, cos, span=span), b.mul(x1, sin, span=span), span=span)
    return b.concat([first, second], -1, span=span)


@entry("rope", "(rope x :base 10000.0)", keywords={"base": 10000.0})
def _rope(cx: Call) -> Node:
    x = cx.tensor(0)
    if x.ndim < 3 or x.shape[-1] % 2:
        raise cx.fail(
            f"rope needs a [.. seq heads d] tensor with an even d, found {format_shape(x.shape)}",
            "split the heads first: (reshape q [batch seq heads d])",
            0,
        )
    if x.dtype not in FLOATS:
        raise cx.fail(f"rope: {describe_value(x)} is not a float tensor", "cast it first", 0)
    base = cx.number("base")
    if not base > 0:
        raise cx.fail(f"rope: `:base` must be positive, found {base:g}", "write 10000.0", "base")
    return rotary(x, base, cx.span)


@entry(
    "sdpa", "(sdpa q k v :causal false :scale S)", (3, 3), keywords={"causal": False, "scale": None}
)
def _sdpa(cx: Call) -> Node:
    q, k, v = cx.tensor(0), cx.tensor(1), cx.tensor(2)
    _check_sdpa(cx, q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if cx.get("scale") is None else cx.number("scale")
    return b.attention(q, k, v, cx.boolean("causal"), scale=scale, span=cx.span)


def _check_sdpa(cx: Call, q: Node, k: Node, v: Node) -> None:
    """E-SHAPE-011 unless q is ``[.. H S D]`` and k, v are ``[.. K S D]`` with K dividing H."""
    listed = ", ".join(format_shape(t.shape) for t in (q, k, v))
    ok = q.ndim >= 3 and k.shape == v.shape and k.ndim == q.ndim
    ok = ok and q.shape[:-3] == k.shape[:-3] and q.shape[-2:] == k.shape[-2:]
    if not ok:
        raise SexpgpuError(
            "E-SHAPE-011",
            f"sdpa: queries [.. H S D] and keys, values [.. K S D] do not fit: {listed}",
            cx.span,
            "split heads the same way for all three, e.g. [batch heads seq dim]; keys and "
            "values may have fewer heads",
        )
    if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
        raise SexpgpuError(
            "E-SHAPE-011",
            f"sdpa: {k.shape[-3]} key/value heads do not divide {q.shape[-3]} query heads "
            f"({listed})",
            cx.where(1),
            "each group of query heads shares one key/value head: K must divide H",
        )


# ---------------------------------------------------------------- regularization


@entry("dropout", "(dropout x :p 0.1)", keywords={"p": 0.1}, layer=True)
def _dropout(cx: Call) -> Node:
    """Inverted dropout: zero each element with probability p, scale the rest by 1 / (1 - p).

    The training graph draws the mask from the microbatch's key and each
    element's position (`sexpgpu.ir.counter_rng`); evaluation takes `x`.
    """
    x, span = cx.tensor(0), cx.span
    p = cx.number("p")
    if not 0.0 <= p < 1.0:
        raise cx.fail(f"dropout: `:p` must lie in [0, 1), found {p:g}", "write e.g. :p 0.1", "p")
    if x.dtype not in FLOATS:
        raise cx.fail(f"dropout: {describe_value(x)} is not a float tensor", "cast it first", 0)
    if p == 0.0:
        return x
    if x.size >= 2**31:
        raise cx.fail(
            f"dropout: {format_shape(x.shape)} has {x.size} elements; positions are int32",
            "use a smaller :batch or split the tensor",
            0,
        )
    assert cx.random_key is not None and cx.train_only is not None
    key, salt = cx.random_key()
    return cx.train_only(dropped(x, key, salt, p, span), x)


def dropped(x: Node, key: Node, salt: int, p: float, span: Span | None = None) -> Node:
    """`x` with each element zeroed where ``uniform(key, position, salt) < p``, the rest / (1-p).

    The position is the element's index in `x` flattened (int32), so the mask
    depends on the key, the salt and the element alone (docs/ir.md).
    """
    counter = b.reshape(b.iota((x.size,), 0, span=span), x.shape, span=span)
    u = b.uniform(key, counter, salt, span=span)
    keep = b.le(b.constant(p, DType.F32, span=span), u, span=span)  # u >= p: kept with 1 - p
    # bf16 is scaled in f32 and rounded once (a bf16 scale would be rounded first: a bias).
    wide = DType.F32 if x.dtype is DType.BF16 else x.dtype
    scaled = b.mul(
        x if wide is x.dtype else b.cast(x, wide, span=span),
        b.constant(1.0 / (1.0 - p), wide, span=span),
        span=span,
    )
    scaled = scaled if wide is x.dtype else b.cast(scaled, x.dtype, span=span)
    return b.where(keep, scaled, b.constant(0.0, x.dtype, span=span), span=span)


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
