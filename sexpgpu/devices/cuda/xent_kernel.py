"""The Triton kernel of `sexpgpu.devices.cuda.xent` (loaded by `triton_support.kernel`)."""

import triton
import triton.language as tl

__all__ = ["xent_rows_kernel"]


@triton.jit
def xent_rows_kernel(
    logits_ptr, row_stride, ids_ptr, g_ptr, g_stride, loss_ptr, grad_ptr, grad_stride, V,
    BLOCK: tl.constexpr, WITH_GRAD: tl.constexpr,
):  # fmt: skip
    # One program: one row. The first pass keeps a running maximum and the
    # sum of exponentials below it (one exp per logit); the second reads the
    # row again and writes g * (softmax - onehot). (Fewer rows in flight, to
    # find the row in L2 the second time, measured slower: dev/xent_sweep.py.)
    # Without WITH_GRAD the loss alone: the first pass.
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    target = tl.load(ids_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
    for start in range(0, V, BLOCK):
        at = start + cols
        x = tl.load(base + at, mask=at < V, other=float("-inf")).to(tl.float32)
        high = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - high) + tl.sum(tl.exp(x - high), axis=0)
        m = high
    lse = m + tl.log(s)
    picked = tl.load(base + target).to(tl.float32)
    tl.store(loss_ptr + row, lse - picked)
    if not WITH_GRAD:
        return
    g = tl.load(g_ptr + row * g_stride).to(tl.float32)
    out = grad_ptr + row * grad_stride
    for start in range(0, V, BLOCK):
        at = start + cols
        x = tl.load(base + at, mask=at < V, other=0.0).to(tl.float32)
        p = tl.exp(x - lse) - tl.where(at == target, 1.0, 0.0)
        tl.store(out + at, (p * g).to(grad_ptr.dtype.element_ty), mask=at < V)
