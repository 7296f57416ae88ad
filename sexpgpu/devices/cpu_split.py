"""Split one large elementwise or row-wise op over the CPU cores.

NumPy runs a ufunc on one core; BLAS already uses them all. For an op of at
least `MIN_ELEMENTS` whose result is elementwise (or row by row) in one
axis, the interpreter cuts that axis into one block per worker and runs the
op's own NumPy implementation on each block in a thread (NumPy releases the
GIL inside its loops). Each block's arithmetic is exactly the unsplit
arithmetic, so results are identical bit for bit.
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
_SPLITTABLE = (UNARY - {Op.CAST}) | BINARY | {Op.WHERE, Op.GELU, Op.GELU_GRAD} | _ROWWISE


def split_axis(node: Node, workers: int) -> int | None:
    """The axis to cut `node`'s op along for `workers` threads, or None to run it whole."""
    if workers < 2 or node.op not in _SPLITTABLE or node.size < MIN_ELEMENTS:
        return None
    kept = {node.attrs.get("axis", node.ndim - 1)} if node.op in _ROWWISE else set()
    return next((a for a, d in enumerate(node.shape) if a not in kept and d >= workers), None)


def _block(x: np.ndarray, node: Node, axis: int, lo: int, hi: int) -> np.ndarray:
    """Operand `x`'s part for result rows lo:hi of `axis` (all of it where it broadcasts)."""
    own = axis - (node.ndim - x.ndim)
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
            got = IMPL_RULES[node.op](node, *(_block(x, node, axis, lo, hi) for x in args), out=dst)
            assert got is dst or np.shares_memory(got, dst), node
            if rounded:
                round_bf16(dst)

    futures = [pool.submit(part, lo, hi) for lo, hi in itertools.pairwise(bounds)]
    for future in futures:
        future.result()
    return result
