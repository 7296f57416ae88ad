"""Split one large op over the CPU cores.

NumPy runs a ufunc on one core. For an op of at least `MIN_ELEMENTS` whose
result is independent along one axis (elementwise ops, row-wise fused ops,
the rows or batch of a matmul, the heads of attention), the interpreter cuts
that axis into one block per worker and runs the op's own NumPy
implementation on each block in a thread (NumPy releases the GIL inside its
loops and in BLAS). The interpreter keeps BLAS itself to one thread while it
does this (see `sexpgpu.devices.cpu`), so the cores are not oversubscribed.
Each block's arithmetic is the unsplit arithmetic: elementwise and row-wise
results are identical bit for bit; a split matmul may differ in the last
bit, as BLAS blocks its sums differently.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Executor

import numpy as np

from sexpgpu.ir.dtypes import numpy_dtype, round_bf16
from sexpgpu.ir.node import Node
from sexpgpu.ir.numpy_impl import stores_rounded
from sexpgpu.ir.ops import BINARY, UNARY, Op
from sexpgpu.ir.rules import IMPL_RULES

__all__ = ["MIN_ELEMENTS", "evaluate_split", "split_axis"]

MIN_ELEMENTS = 1 << 18

# Ops that reduce along one axis (kept whole) and are independent across the others.
_ROWWISE = frozenset({Op.SOFTMAX, Op.LOG_SOFTMAX, Op.SOFTMAX_GRAD, Op.LAYERNORM, Op.LAYERNORM_GRAD})
_SPLITTABLE = (
    (UNARY - {Op.CAST})
    | BINARY
    | {Op.WHERE, Op.UNIFORM, Op.GELU, Op.GELU_GRAD, Op.MATMUL, Op.ATTENTION, Op.ATTENTION_GRAD}
    | {Op.CROSS_ENTROPY, Op.CROSS_ENTROPY_GRAD}
    | _ROWWISE
)
# Ops whose operands share their leading axes with the result (not their trailing ones).
_LEADING = frozenset({Op.CROSS_ENTROPY, Op.CROSS_ENTROPY_GRAD})


def split_axis(node: Node, workers: int) -> int | None:
    """The axis to cut `node`'s op along for `workers` threads, or None to run it whole."""
    if workers < 2 or node.op not in _SPLITTABLE:
        return None
    if max(node.size, *(x.size for x in node.inputs)) < MIN_ELEMENTS:
        return None
    return next((a for a in _candidate_axes(node) if node.shape[a] >= workers), None)


def _candidate_axes(node: Node) -> list[int]:
    axes = list(range(node.ndim))
    if node.op in _ROWWISE:
        axes.remove(node.attrs.get("axis", node.ndim - 1))
    elif node.op is Op.MATMUL:
        axes = axes[:-1]  # batch axes, then the rows of the left operand
    elif node.op is Op.ATTENTION and node.inputs[0].shape == node.inputs[1].shape:
        axes = axes[:-2]  # batch and head axes
    elif node.op in (Op.ATTENTION, Op.ATTENTION_GRAD):
        axes = axes[:-3]  # batch axes: not grouped heads, nor the heads [dq dk dv] fill
    elif node.op is Op.CROSS_ENTROPY_GRAD:
        axes = axes[:-1]  # not the classes
    return axes


def _block(x: np.ndarray, k: int, node: Node, axis: int, lo: int, hi: int) -> np.ndarray:
    """Operand `k` (`x`)'s part for result rows lo:hi of `axis` (all of it where it broadcasts)."""
    own = axis if node.op in _LEADING else axis - (node.ndim - x.ndim)
    if node.op is Op.MATMUL and own >= x.ndim - 2 and (k == 1 or own == x.ndim - 1):
        return x  # cutting the left operand's rows: the right operand is shared
    if own < 0 or x.shape[own] != node.shape[axis]:
        return x
    return x[(slice(None),) * own + (slice(lo, hi),)]


def evaluate_split(
    node: Node,
    args: tuple[np.ndarray, ...],
    out: np.ndarray | None,
    pool: Executor,
    workers: int,
    axis: int,
) -> np.ndarray:
    """`evaluate(node, *args, out=out)` with `axis` cut into `workers` blocks run on `pool`."""
    result = out if out is not None else np.empty(node.shape, numpy_dtype(node.dtype))
    bounds = np.linspace(0, node.shape[axis], workers + 1).astype(int)
    rounded = stores_rounded(node)

    def part(lo: int, hi: int) -> None:
        with np.errstate(all="ignore"):  # error state does not cross threads
            dst = result[(slice(None),) * axis + (slice(lo, hi),)]
            parts = (_block(x, k, node, axis, lo, hi) for k, x in enumerate(args))
            got = IMPL_RULES[node.op](node, *parts, out=dst)
            assert got is dst or np.shares_memory(got, dst), node
            if rounded:
                round_bf16(dst)

    futures = [pool.submit(part, lo, hi) for lo, hi in itertools.pairwise(bounds)]
    for future in futures:
        future.result()
    return result
