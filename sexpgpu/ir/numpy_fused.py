"""NumPy implementations of the fused ops: softmax, cross-entropy, attention, layernorm, gelu.

Registered in `IMPL_RULES` like the others (see `sexpgpu.ir.numpy_impl`).
Each works a block of rows at a time where its plain composition would make
large temporaries: cross-entropy never holds the [rows vocab]
log-probabilities, attention never the [.. seq seq] weights.
"""

from __future__ import annotations

import numpy as np

from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.node import Node
from sexpgpu.ir.ops import Op
from sexpgpu.ir.rules import impl_rule

__all__ = ["check_ids"]

Out = np.ndarray | None

# Rows of logits handled at once by the fused cross-entropy (bounds its temporaries).
_CHUNK_ELEMENTS = 1 << 22


def check_ids(node: Node, ids: np.ndarray, size: int) -> None:
    """E-DATA-006 at `node`'s span unless every id is in ``[0, size)``.

    Ids come from the data (token ids, class labels), so only a run can find
    one past the model's vocabulary or classes; NumPy would raise an
    IndexError for it, or silently wrap a negative one around. Used by
    ``take`` and cross-entropy.
    """
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low >= 0 and high < size:
        return
    kind = "rows" if node.op is Op.TAKE else "classes"
    raise SexpgpuError(
        "E-DATA-006",
        f"{node.op.label}: the data holds id {high if high >= size else low}, "
        f"out of range for {size} {kind}",
        node.span,
        f"ids must lie in 0..{size - 1}: make the vocabulary (or the classes) as large "
        "as the data needs",
    )


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
    # d/dx = 0.5 (1 + t) + (1 - t^2) * 0.5 sqrt(2/pi) x (1 + 3 * 0.044715 x^2)
    t = _gelu_tanh(x)
    slope = np.multiply(x, x)
    slope *= 3 * _GELU_A
    slope += 1
    slope *= x
    slope *= 0.5 * _GELU_C
    square = np.multiply(t, t)
    np.subtract(1, square, out=square)
    slope *= square
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
    check_ids(node, ids, flat.shape[1])
    # f32 for bf16 logits (their arrays are f32): the result is not rounded to bf16.
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
    check_ids(node, ids, flat.shape[1])
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


def _grouped(q: np.ndarray, *kv: np.ndarray) -> list[np.ndarray]:
    """``[.. H S D]`` as ``[.. K G S D]`` and each of `kv`, ``[.. K S D]``, as ``[.. K 1 S D]``.

    Query head ``h`` reads key/value head ``h // G``; the products then
    broadcast each key/value head over its group without copying it.
    """
    heads, kv_heads = q.shape[-3], kv[0].shape[-3]
    lead, tail = q.shape[:-3], q.shape[-2:]
    wide = q.reshape(*lead, kv_heads, heads // kv_heads, *tail)
    return [wide, *(x.reshape(*lead, kv_heads, 1, *tail) for x in kv)]


@impl_rule(Op.ATTENTION)
def _attention(node: Node, q, k, v, out: Out = None) -> np.ndarray:
    # The [seq seq] weights are made one block of query rows at a time and
    # never stored; rows are normalized after the product with v (smaller).
    shape = q.shape
    q, k, v = _grouped(*_plain(q, k, v))
    whole = out is not None and out.flags.c_contiguous  # then a view of `out`, written in place
    result = out.reshape(q.shape) if whole else np.empty(q.shape, dtype=q.dtype)
    q_scaled = q * q.dtype.type(node.attrs["scale"])
    for lo, hi, keys in _blocks(node, q.shape[-2]):
        w, total = _exp_scores(node, q_scaled, k, lo, hi, keys)
        rows = np.matmul(w, v[..., :keys, :])
        rows /= total
        result[..., lo:hi, :] = rows
    if out is None:
        return result.reshape(shape)
    if not whole:
        out[...] = result.reshape(shape)
    return out


@impl_rule(Op.ATTENTION_GRAD)
def _attention_grad(node: Node, q, k, v, g, out: Out = None) -> np.ndarray:
    # Per block of query rows, recompute the weights w; then dv += w^T g,
    # ds = w * (g v^T - rowsum(w * g v^T)), dq = ds k * scale, dk += ds^T q * scale;
    # a key/value head's dk and dv sum over the query heads of its group.
    heads, kv_shape = q.shape[-3], k.shape
    q, k, v, g = _plain(q, k, v, g)
    q, k, v = _grouped(q, k, v)
    g = g.reshape(q.shape)
    dq = np.empty(q.shape, dtype=q.dtype)
    dk, dv = np.zeros(k.shape, dtype=q.dtype), np.zeros(k.shape, dtype=q.dtype)
    scale = q.dtype.type(node.attrs["scale"])
    q_scaled, k_scaled = q * scale, k * scale
    for lo, hi, keys in _blocks(node, q.shape[-2]):
        w, total = _exp_scores(node, q_scaled, k, lo, hi, keys)
        w *= np.reciprocal(total, out=total)
        dv[..., :keys, :] += _group_sum(np.matmul(np.swapaxes(w, -1, -2), g[..., lo:hi, :]))
        ds = np.matmul(g[..., lo:hi, :], np.swapaxes(v[..., :keys, :], -1, -2))
        ds -= np.sum(ds * w, axis=-1, keepdims=True)
        ds *= w
        dq[..., lo:hi, :] = np.matmul(ds, k_scaled[..., :keys, :])
        dk[..., :keys, :] += _group_sum(np.matmul(np.swapaxes(ds, -1, -2), q_scaled[..., lo:hi, :]))
    lead, tail = kv_shape[:-3], kv_shape[-2:]
    parts = [dq.reshape(*lead, heads, *tail), dk.reshape(kv_shape), dv.reshape(kv_shape)]
    return np.concatenate(parts, axis=len(lead), out=out)


def _group_sum(x: np.ndarray) -> np.ndarray:
    """``[.. K G S D]`` summed over each group, ``[.. K 1 S D]`` (itself when G is 1)."""
    return x if x.shape[-3] == 1 else x.sum(axis=-3, keepdims=True)
