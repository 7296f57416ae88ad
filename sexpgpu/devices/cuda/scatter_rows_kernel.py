"""The Triton kernel of `sexpgpu.devices.cuda.scatter_rows` (loaded by `triton_support.kernel`)."""

import triton
import triton.language as tl

__all__ = ["scatter_rows_kernel"]


@triton.jit
def scatter_rows_kernel(
    ids_ptr, order_ptr, rows_ptr, row_stride, out_ptr, out_stride, n, width,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # One program: one position of the sorted ids and BLOCK columns. The
    # program at the first position of an id's run sums that id's rows in the
    # order they came (the sort is stable) and writes the sum once: no two
    # programs write one element, so the sum is the same every run.
    at = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    mine = tl.load(ids_ptr + at)
    before = tl.load(ids_ptr + at - 1, mask=at > 0, other=-1)
    if (at == 0) | (before != mine):
        total = tl.zeros((BLOCK,), out_ptr.dtype.element_ty)
        current = mine
        while current == mine:
            row = tl.load(order_ptr + at)
            x = tl.load(rows_ptr + row * row_stride + cols, mask=inside, other=0.0)
            total += x.to(out_ptr.dtype.element_ty)
            at += 1
            current = tl.load(ids_ptr + at, mask=at < n, other=-1)
        tl.store(out_ptr + mine * out_stride + cols, total, mask=inside)
