"""Cross-entropy and its gradient in one pass over the logits: ``sexpgpu::cross_entropy_rows``.

Where a training graph has both and the gradient's cotangent does not
depend on the loss (a mean over rows: a constant), the executor runs them
as this one op. Per row of ``[rows vocab]`` logits it returns the loss
``logsumexp(x) - x[id]`` (f32) and the gradient ``g * (softmax(x) -
onehot(id))`` in the logits' dtype, so the logits are read from memory once
and the gradient written once: Inductor's kernel for the two reads each row
again from memory, since the rows its programs hold at once (100 KB each at
GPT-2's vocabulary) do not fit in L2.

On CUDA it is the Triton kernel below: a persistent grid of a few programs
per SM, each taking rows in turn; the first loop keeps a running maximum and
sum of exponentials, the second reads the row again (from L2, where it
still is) and writes the gradient. The block size, warps and programs per
SM are Triton's autotuner's pick at the first call of each vocabulary size
(the trace's, never under a capture). Elsewhere it is the same arithmetic in torch
ops, so the CPU tests run the executor's pairing; the kernel itself is
tested on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
Both compute in f32 (f64 for f64 logits, which take the torch ops on CUDA too).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

__all__ = ["cross_entropy_rows", "rows_in_torch", "rows_in_triton"]

# The interpreter's one configuration, and the autotuner's candidates on a GPU:
# (columns per load, warps, programs per SM). Enough bytes must be in flight
# per SM to keep memory busy, and few enough rows at once to stay in L2.
_INTERPRETED = (128, 1, 1)
_CONFIGS = [(8192, 16, 2), (16384, 32, 1), (8192, 8, 4), (16384, 16, 2)]


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, made on first use (Triton is imported only then)."""
    import triton
    import triton.language as tl

    def rows_kernel(
        logits,
        ids,
        cotangents,
        losses,
        grads,
        n_rows,
        n_cols,
        stride,
        BLOCK: tl.constexpr,
        PER_SM: tl.constexpr,
    ):
        # Offsets in int64: rows times vocab passes 2**31 at a few hundred thousand rows.
        for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
            x_row = logits + row * stride
            top = tl.full([BLOCK], float("-inf"), tl.float32)
            total = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < n_cols
                x = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
                new_top = tl.maximum(top, x)
                # -inf (padding, or a masked logit) adds 0 and leaves the sum as it is,
                # never -inf minus -inf.
                scale = tl.where(top == new_top, 1.0, tl.exp(top - new_top))
                total = total * scale + tl.where(x == float("-inf"), 0.0, tl.exp(x - new_top))
                top = new_top
            row_top = tl.max(top, 0)
            lse = row_top + tl.log(tl.sum(total * tl.exp(top - row_top), 0))
            target = tl.load(ids + row)
            picked = tl.load(x_row + target).to(tl.float32)
            tl.store(losses + row, lse - picked)
            g = tl.load(cotangents + row)
            g_row = grads + row * n_cols
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < n_cols
                x = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
                p = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
                tl.store(g_row + cols, (p * g).to(grads.dtype.element_ty), mask=inside)

    kernel = triton.jit(rows_kernel)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return kernel
    configs = [
        triton.Config({"BLOCK": block, "PER_SM": per_sm}, num_warps=warps)
        for block, warps, per_sm in _CONFIGS
    ]
    return triton.autotune(configs, key=["n_cols"])(kernel)


def rows_in_triton(
    logits: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, grad_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on ``[rows vocab]`` `logits` (rows contiguous), int `ids`, f32 `g`."""
    rows, cols = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    grads = torch.empty((rows, cols), dtype=grad_dtype, device=logits.device)
    args = (logits, ids, g, losses, grads, rows, cols, logits.stride(0))
    if logits.device.type != "cuda":  # Triton's interpreter
        block, warps, per_sm = _INTERPRETED
        _kernel()[(min(rows, 2),)](*args, BLOCK=block, PER_SM=per_sm, num_warps=warps)
        return losses, grads
    sms = torch.cuda.get_device_properties(logits.device).multi_processor_count

    def grid(meta: dict) -> tuple[int]:
        return (max(1, min(rows, meta["PER_SM"] * sms)),)

    _kernel()[grid](*args)
    return losses, grads


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rows_in_torch(
    logits: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, grad_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same arithmetic in torch ops (f32, or f64 for f64 logits)."""
    x = logits.to(_wide(logits.dtype))
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, ids[:, None].long())[:, 0]
    probs = (x - lse[:, None]).exp_()
    probs.sub_((torch.arange(x.shape[1], device=x.device) == ids[:, None]).to(probs.dtype))
    return lse - picked, probs.mul_(g[:, None].to(x.dtype)).to(grad_dtype)


@torch.library.custom_op("sexpgpu::cross_entropy_rows", mutates_args=())
def cross_entropy_rows(
    logits: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, grad_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row losses (f32; f64 for f64) and the gradient (`grad_dtype`) of `logits`.

    `logits` is ``[rows vocab]``; `ids` (int, ``[rows]``) must lie in ``[0,
    vocab)``: the caller checks them. `g` is each row's cotangent.
    """
    return rows_in_torch(logits, ids, g, grad_dtype)


@cross_entropy_rows.register_kernel("cuda")
def _on_cuda(
    logits: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, grad_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dtype == torch.float64:
        return rows_in_torch(logits, ids, g, grad_dtype)
    g = g.to(torch.float32).contiguous()
    return rows_in_triton(logits.contiguous(), ids.contiguous(), g, grad_dtype)


@cross_entropy_rows.register_fake
def _shapes(
    logits: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, grad_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    losses = logits.new_empty(logits.shape[0], dtype=_wide(logits.dtype))
    return losses, logits.new_empty(logits.shape, dtype=grad_dtype)
