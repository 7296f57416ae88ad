"""NumPy implementations: the executable meaning of every op.

One plain function per op, registered in `IMPL_RULES`. Each takes the node
(for its attributes), the operand arrays, and ``out``: a dying operand's
buffer of the result's shape and dtype that the op may write into (the CPU
interpreter passes it; anything else passes None). Arithmetic on ``bf16``
values is float32; `evaluate` rounds what is stored. The fused ops live in
`sexpgpu.ir.numpy_fused`.
"""

from __future__ import annotations

import numpy as np

from sexpgpu.ir.counter_rng import uniform_bits
from sexpgpu.ir.dtypes import DType, numpy_dtype, round_bf16
from sexpgpu.ir.node import ConstArray, Node
from sexpgpu.ir.numpy_fused import check_ids  # the import fills IMPL_RULES
from sexpgpu.ir.ops import ELEMENTWISE, VIEW, Op
from sexpgpu.ir.rules import IMPL_RULES, impl_rule

__all__ = ["evaluate", "stores_rounded"]

Out = np.ndarray | None

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

# Ops computed element by element, the same on a rank-0 value as on one element.
_POINTWISE = ELEMENTWISE | {Op.GELU, Op.GELU_GRAD}


def evaluate(node: Node, *args: np.ndarray, out: Out = None) -> np.ndarray:
    """Run `node`'s op on `args`; round the result to bf16 where the node stores bf16."""
    if not node.shape and node.op in _POINTWISE and args:
        # NumPy gives a scalar, not an array, for a ufunc of rank-0 operands, which an op
        # chaining `out=` (sigmoid, gelu) cannot write into: run it on one-element arrays.
        one = IMPL_RULES[node.op](node, *(a.reshape(1) for a in args), out=None)
        result = np.asarray(one).reshape(())
        if out is not None:
            np.copyto(out, result)
            result = out
    else:
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
    (Op.SIN, np.sin),
    (Op.COS, np.cos),
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


@impl_rule(Op.UNIFORM)
def _uniform(node: Node, key: np.ndarray, counter: np.ndarray, out: Out = None) -> np.ndarray:
    result = uniform_bits(key, counter, node.attrs["salt"])
    if out is None:
        return result
    np.copyto(out, result)  # a block of a split op writes into its rows
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
    check_ids(node, ids, table.shape[0])
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
