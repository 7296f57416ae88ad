"""NumPy implementations: the executable meaning of every op.

One plain function per op, registered in `IMPL_RULES`. Each takes the node
(for its attributes), the operand arrays, and ``out``: a dying operand's
buffer of the result's shape and dtype that the op may write into (the CPU
interpreter passes it; anything else passes None). Arithmetic on ``bf16``
values is float32; `evaluate` rounds what is stored.
"""

from __future__ import annotations

import numpy as np

from sexpgpu.ir.dtypes import DType, numpy_dtype, round_bf16
from sexpgpu.ir.node import ConstArray, Node
from sexpgpu.ir.ops import VIEW, Op
from sexpgpu.ir.rules import IMPL_RULES, impl_rule

__all__ = ["IMPL_EXEMPT", "evaluate", "stores_rounded"]

Out = np.ndarray | None

# Leaves whose values are fed by the caller, not computed.
IMPL_EXEMPT = frozenset({Op.INPUT, Op.PARAM})

# Ops whose bf16 result is already a bf16 value (it only moves or picks values).
_EXACT = VIEW | {
    Op.CONSTANT,
    Op.PAD,
    Op.CONCAT,
    Op.TAKE,
    Op.MAX,
    Op.MAXIMUM,
    Op.MINIMUM,
    Op.NEG,
    Op.ABS,
    Op.SIGN,
    Op.WHERE,
}

# Rows of logits handled at once by the fused cross-entropy (bounds its temporaries).
_CHUNK_ELEMENTS = 1 << 22


def evaluate(node: Node, *args: np.ndarray, out: Out = None) -> np.ndarray:
    """Run `node`'s op on `args`; round the result to bf16 where the node stores bf16."""
    result = IMPL_RULES[node.op](node, *args, out=out)
    if not isinstance(result, np.ndarray):  # a ufunc of rank-0 arrays gives a NumPy scalar
        result = np.array(result, dtype=numpy_dtype(node.dtype))
    if stores_rounded(node):
        if not result.flags.writeable:
            result = result.copy()
        round_bf16(result)
    assert result.shape == node.shape, (node, result.shape)
    return result


def stores_rounded(node: Node) -> bool:
    """Whether `node`'s computed result must be rounded to bf16 when stored."""
    return node.dtype is DType.BF16 and node.op not in _EXACT


# ---------------------------------------------------------------- leaves


@impl_rule(Op.CONSTANT)
def _constant(node: Node, out: Out = None) -> np.ndarray:
    value = node.attrs["value"]
    if isinstance(value, ConstArray):
        return value.array
    scalar = np.array(value, dtype=numpy_dtype(node.dtype))
    if node.dtype is DType.BF16:
        round_bf16(scalar)
    return np.broadcast_to(scalar, node.shape)


@impl_rule(Op.IOTA)
def _iota(node: Node, out: Out = None) -> np.ndarray:
    axis, shape = node.attrs["axis"], node.shape
    line = np.arange(shape[axis], dtype=numpy_dtype(node.dtype))
    return np.broadcast_to(line.reshape([-1 if i == axis else 1 for i in range(len(shape))]), shape)


# ---------------------------------------------------------------- elementwise


def _ufunc(fn: np.ufunc):
    def run(node: Node, *args: np.ndarray, out: Out = None) -> np.ndarray:
        return fn(*args, out=out)

    run.__name__ = fn.__name__
    return run


for _op, _fn in [
    (Op.NEG, np.negative),
    (Op.EXP, np.exp),
    (Op.LOG, np.log),
    (Op.SQRT, np.sqrt),
    (Op.TANH, np.tanh),
    (Op.ABS, np.absolute),
    (Op.SIGN, np.sign),
    (Op.ADD, np.add),
    (Op.SUB, np.subtract),
    (Op.MUL, np.multiply),
    (Op.DIV, np.divide),
    (Op.POW, np.power),
    (Op.MAXIMUM, np.maximum),
    (Op.MINIMUM, np.minimum),
    (Op.LT, np.less),
    (Op.LE, np.less_equal),
    (Op.EQ, np.equal),
]:
    impl_rule(_op)(_ufunc(_fn))


@impl_rule(Op.RSQRT)
def _rsqrt(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    y = np.sqrt(x, out=out)
    return np.divide(1, y, out=y)


@impl_rule(Op.SIGMOID)
def _sigmoid(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    # 1 / (1 + exp(-x)): exp overflows to inf for very negative x, giving 0.
    y = np.negative(x, out=out)
    np.exp(y, out=y)
    y += 1
    return np.reciprocal(y, out=y)


@impl_rule(Op.CAST)
def _cast(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    return x.astype(numpy_dtype(node.dtype))  # always a copy: never aliases x


@impl_rule(Op.WHERE)
def _where(node: Node, cond: np.ndarray, a: np.ndarray, b: np.ndarray, out: Out = None):
    # Into `out`: when it is the buffer of `a` (or `b`), only the other side's picks move.
    if out is None:
        return np.where(cond, a, b)
    if np.may_share_memory(out, b) and not np.may_share_memory(out, a):
        np.copyto(out, a, where=cond)
        return out
    if not np.may_share_memory(out, a):
        np.copyto(out, a)
    np.copyto(out, b, where=np.logical_not(cond))
    return out


# ---------------------------------------------------------------- reductions


@impl_rule(Op.SUM)
def _sum(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    axes, keep = node.attrs["axes"], node.attrs["keepdims"]
    return np.asarray(np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype))


@impl_rule(Op.MAX)
def _max(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    axes, keep = node.attrs["axes"], node.attrs["keepdims"]
    return np.asarray(np.max(x, axis=axes, keepdims=keep))


# ---------------------------------------------------------------- movement


@impl_rule(Op.RESHAPE)
def _reshape(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    return x.reshape(node.shape)


@impl_rule(Op.TRANSPOSE)
def _transpose(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    return x.transpose(node.attrs["axes"])


@impl_rule(Op.BROADCAST_TO)
def _broadcast_to(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    return np.broadcast_to(x, node.shape)


def _index(axis: int, start: int, stop: int) -> tuple[slice, ...]:
    return (slice(None),) * axis + (slice(start, stop),)


@impl_rule(Op.SLICE)
def _slice(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    return x[_index(node.attrs["axis"], node.attrs["start"], node.attrs["stop"])]


@impl_rule(Op.PAD)
def _pad(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    axis, before = node.attrs["axis"], node.attrs["before"]
    result = np.zeros(node.shape, dtype=x.dtype)
    result[_index(axis, before, before + x.shape[axis])] = x
    return result


@impl_rule(Op.CONCAT)
def _concat(node: Node, *xs: np.ndarray, out: Out = None) -> np.ndarray:
    return np.concatenate(xs, axis=node.attrs["axis"])


@impl_rule(Op.TAKE)
def _take(node: Node, table: np.ndarray, ids: np.ndarray, out: Out = None) -> np.ndarray:
    return np.take(table, ids, axis=0)


@impl_rule(Op.SCATTER_ADD)
def _scatter_add(node: Node, ids: np.ndarray, updates: np.ndarray, out: Out = None):
    # Sort the rows by id and add each run of equal ids with one reduceat:
    # much faster than np.add.at for embedding gradients.
    flat_ids = ids.reshape(-1)
    rows = updates.reshape(flat_ids.size, -1)
    result = np.zeros((node.shape[0], rows.shape[1]), dtype=updates.dtype)
    if flat_ids.size:
        order = np.argsort(flat_ids, kind="stable")
        sorted_ids = flat_ids[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
        result[sorted_ids[starts]] = np.add.reduceat(rows[order], starts, axis=0)
    return result.reshape(node.shape)


# ---------------------------------------------------------------- products


@impl_rule(Op.MATMUL)
def _matmul(node: Node, a: np.ndarray, b: np.ndarray, out: Out = None) -> np.ndarray:
    if b.ndim == 2 and a.ndim > 2 and a.flags.c_contiguous:
        # One large GEMM instead of a loop of small ones.
        flat_out = (
            out.reshape(-1, b.shape[1]) if out is not None and out.flags.c_contiguous else None
        )
        result = np.matmul(a.reshape(-1, a.shape[-1]), b, out=flat_out)
        result = result.reshape((*a.shape[:-1], b.shape[1]))
    else:
        if a.ndim > 2 or b.ndim > 2:
            # NumPy's stacked matmul reaches BLAS only for plainly laid out
            # matrices; a strided view (a head split out of a fused qkv) is
            # far slower than copying it first.
            a, b = _blas_ready(a), _blas_ready(b)
        result = np.matmul(a, b, out=out)
    if out is not None and result is not out and not np.shares_memory(result, out):
        np.copyto(out, result)
        return out
    return result


def _blas_ready(x: np.ndarray) -> np.ndarray:
    if x.flags.c_contiguous or np.swapaxes(x, -1, -2).flags.c_contiguous:
        return x
    return np.ascontiguousarray(x)


# ---------------------------------------------------------------- fused

_GELU_C = np.sqrt(2 / np.pi)
_GELU_A = 0.044715


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """tanh(sqrt(2/pi) (x + 0.044715 x^3)) in a new array."""
    t = np.multiply(x, x)
    t *= _GELU_A
    t += 1
    t *= x
    t *= _GELU_C
    return np.tanh(t, out=t)


@impl_rule(Op.GELU)
def _gelu(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    t = _gelu_tanh(x)
    t += 1
    y = np.multiply(t, x, out=out)
    y *= 0.5
    return y


@impl_rule(Op.GELU_GRAD)
def _gelu_grad(node: Node, x: np.ndarray, g: np.ndarray, out: Out = None) -> np.ndarray:
    # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    t = _gelu_tanh(x)
    inner = np.multiply(x, x)
    inner *= 3 * _GELU_A
    inner += 1
    inner *= x
    inner *= 0.5 * _GELU_C
    slope = np.multiply(t, t)
    np.subtract(1, slope, out=slope)
    slope *= inner
    t += 1
    t *= 0.5
    slope += t
    return np.multiply(g, slope, out=out)


def _normalized(x: np.ndarray, eps: float, out: Out) -> tuple[np.ndarray, np.ndarray]:
    """((x - mean) / sqrt(var + eps), 1 / sqrt(var + eps)) over the last axis."""
    centered = np.subtract(x, x.mean(axis=-1, keepdims=True, dtype=x.dtype), out=out)
    var = np.einsum("...i,...i->...", centered, centered)[..., None] / x.shape[-1]
    rstd = 1 / np.sqrt(var + x.dtype.type(eps))
    centered *= rstd
    return centered, rstd


@impl_rule(Op.LAYERNORM)
def _layernorm(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    return _normalized(x, node.attrs["eps"], out)[0]


@impl_rule(Op.LAYERNORM_GRAD)
def _layernorm_grad(node: Node, x: np.ndarray, g: np.ndarray, out: Out = None) -> np.ndarray:
    # rstd * (g - mean(g) - xhat * mean(g * xhat)); `out` may be g's buffer.
    xhat, rstd = _normalized(x, node.attrs["eps"], None)
    n = x.shape[-1]
    proj = np.einsum("...i,...i->...", g, xhat)[..., None] / n
    mean = g.mean(axis=-1, keepdims=True, dtype=g.dtype)
    xhat *= proj
    result = np.subtract(g, mean, out=out)
    result -= xhat
    result *= rstd
    return result


@impl_rule(Op.SOFTMAX)
def _softmax(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    axis = node.attrs["axis"]
    y = np.subtract(x, x.max(axis=axis, keepdims=True), out=out)
    np.exp(y, out=y)
    y /= y.sum(axis=axis, keepdims=True)
    return y


@impl_rule(Op.LOG_SOFTMAX)
def _log_softmax(node: Node, x: np.ndarray, out: Out = None) -> np.ndarray:
    axis = node.attrs["axis"]
    y = np.subtract(x, x.max(axis=axis, keepdims=True), out=out)
    y -= np.log(np.exp(y).sum(axis=axis, keepdims=True))
    return y


@impl_rule(Op.SOFTMAX_GRAD)
def _softmax_grad(node: Node, y: np.ndarray, g: np.ndarray, out: Out = None) -> np.ndarray:
    # y * (g - sum(g * y)); `out` may be g's buffer (never y's).
    axis = node.attrs["axis"]
    dot = np.sum(np.multiply(g, y), axis=axis, keepdims=True)
    result = np.subtract(g, dot, out=out)
    result *= y
    return result


def _row_chunks(logits: np.ndarray):
    """(2-D view of the logits, row step) with about _CHUNK_ELEMENTS per step."""
    flat = logits.reshape(-1, logits.shape[-1])
    return flat, max(1, _CHUNK_ELEMENTS // max(1, flat.shape[1]))


@impl_rule(Op.CROSS_ENTROPY)
def _cross_entropy(node: Node, logits: np.ndarray, targets: np.ndarray, out: Out = None):
    flat, step = _row_chunks(logits)
    ids = targets.reshape(-1)
    loss = np.empty(flat.shape[0], dtype=logits.dtype)
    if out is not None and out.flags.c_contiguous:
        loss = out.reshape(-1)
    for lo in range(0, flat.shape[0], step):
        rows = flat[lo : lo + step]
        top = rows.max(axis=1, keepdims=True)
        total = np.exp(rows - top).sum(axis=1)
        picked = rows[np.arange(rows.shape[0]), ids[lo : lo + step]]
        loss[lo : lo + step] = np.log(total) + top[:, 0] - picked
    result = loss.reshape(targets.shape)
    if out is not None and not np.shares_memory(result, out):
        np.copyto(out, result)
        return out
    return result


@impl_rule(Op.CROSS_ENTROPY_GRAD)
def _cross_entropy_grad(
    node: Node, logits: np.ndarray, targets: np.ndarray, g: np.ndarray, out: Out = None
) -> np.ndarray:
    # g * (softmax(logits) - onehot(targets)); `out` may be the logits' buffer.
    usable = out is not None and out.flags.c_contiguous
    result = out if usable else np.empty(logits.shape, dtype=logits.dtype)
    flat, step = _row_chunks(logits)
    dst = result.reshape(flat.shape)
    ids, scale = targets.reshape(-1), g.reshape(-1, 1)
    for lo in range(0, flat.shape[0], step):
        hi = min(lo + step, flat.shape[0])
        rows = dst[lo:hi]
        np.subtract(flat[lo:hi], flat[lo:hi].max(axis=1, keepdims=True), out=rows)
        np.exp(rows, out=rows)
        rows /= rows.sum(axis=1, keepdims=True)
        rows[np.arange(hi - lo), ids[lo:hi]] -= 1
        rows *= scale[lo:hi]
    if out is not None and result is not out:
        np.copyto(out, result)
        return out
    return result


# Query rows handled at once by fused attention: with a causal mask the keys
# past a block's last row are skipped, and a block's weights stay small.
_ATTENTION_ROWS = 256


def _blocks(node: Node, seq: int):
    """(first row, end row, keys seen) per block of queries (causal: keys stop at the end row)."""
    for lo in range(0, seq, _ATTENTION_ROWS):
        hi = min(lo + _ATTENTION_ROWS, seq)
        yield lo, hi, (hi if node.attrs["causal"] else seq)


def _exp_scores(node: Node, q_scaled, k, lo: int, hi: int, keys: int):
    """exp(q k^T * scale - rowmax) for query rows lo:hi against keys :keys, and its row sums.

    All leading (batch, head) axes at once: ``[..., hi - lo, keys]``.
    """
    w = np.matmul(q_scaled[..., lo:hi, :], np.swapaxes(k[..., :keys, :], -1, -2))
    if node.attrs["causal"]:
        # Only the block on the diagonal sees keys past its rows.
        w[..., lo:hi] += np.triu(np.full((hi - lo, hi - lo), -np.inf, dtype=w.dtype), 1)
    w -= w.max(axis=-1, keepdims=True)
    np.exp(w, out=w)
    return w, w.sum(axis=-1, keepdims=True)


def _plain(*xs: np.ndarray) -> list[np.ndarray]:
    return [np.ascontiguousarray(x) for x in xs]


@impl_rule(Op.ATTENTION)
def _attention(node: Node, q, k, v, out: Out = None) -> np.ndarray:
    # The [seq seq] weights are made one block of query rows at a time and
    # never stored; rows are normalized after the product with v (smaller).
    q, k, v = _plain(q, k, v)
    result = np.empty(q.shape, dtype=q.dtype) if out is None else out
    q_scaled = q * q.dtype.type(node.attrs["scale"])
    for lo, hi, keys in _blocks(node, q.shape[-2]):
        w, total = _exp_scores(node, q_scaled, k, lo, hi, keys)
        rows = np.matmul(w, v[..., :keys, :])
        rows /= total
        result[..., lo:hi, :] = rows
    return result


@impl_rule(Op.ATTENTION_GRAD)
def _attention_grad(node: Node, q, k, v, g, out: Out = None) -> np.ndarray:
    # Per block of query rows, recompute the weights w; then dv += w^T g,
    # ds = w * (g v^T - rowsum(w * g v^T)), dq = ds k * scale, dk += ds^T q * scale.
    q, k, v, g = _plain(q, k, v, g)
    result = np.zeros((3, *q.shape), dtype=q.dtype) if out is None else out
    if out is not None:
        result[...] = 0
    dq, dk, dv = result
    scale = q.dtype.type(node.attrs["scale"])
    q_scaled, k_scaled = q * scale, k * scale
    for lo, hi, keys in _blocks(node, q.shape[-2]):
        w, total = _exp_scores(node, q_scaled, k, lo, hi, keys)
        w *= np.reciprocal(total, out=total)
        dv[..., :keys, :] += np.matmul(np.swapaxes(w, -1, -2), g[..., lo:hi, :])
        ds = np.matmul(g[..., lo:hi, :], np.swapaxes(v[..., :keys, :], -1, -2))
        ds -= np.sum(ds * w, axis=-1, keepdims=True)
        ds *= w
        dq[..., lo:hi, :] = np.matmul(ds, k_scaled[..., :keys, :])
        dk[..., :keys, :] += np.matmul(np.swapaxes(ds, -1, -2), q_scaled[..., lo:hi, :])
    return result
