"""A product written straight into a step's sum: ``sexpgpu::mm_into`` and ``sexpgpu::mm_f32``.

A weight's gradient is a product (``x^T dy``); traced as it is, a bf16 step
writes it in bf16, reads it back, casts it to f32 and writes it into the
gradient's f32 buffer (or adds it there): a pass of its own over every
weight. ``mm_into(a, b, out, accumulate)`` has the product do it: on a GPU
cuBLASLt (`sexpgpu.devices.cuda.cublaslt`) writes the f32 sums into `out`
(``beta`` 0) or adds them to it (``beta`` 1), rounded once to f32 instead of
once to bf16 and once more in the sum. A rewrite of the traced step
(`sexpgpu.devices.cuda.fx_rewrites.products_into_sums`) puts it in; the op
mutates `out`, so Inductor calls it on the caller's buffer, with no copy.
Where the step returns its gradients instead (a step of one call),
``mm_f32(a, b)`` makes the f32 product the same way into a tensor of its
own, allocated when the product runs: a gradient exists from the moment it
is made, not for the whole step.

Elsewhere (the CPU, a layout cuBLASLt refuses) it is the traced arithmetic
in torch calls: the product in the operands' dtype, then the cast and the
write or add, so the CPU's results are the step's as traced, bit for bit.
"""

from __future__ import annotations

import torch

from sexpgpu.devices.cuda import cublaslt

__all__ = ["mm_f32", "mm_into"]


@torch.library.custom_op("sexpgpu::mm_into", mutates_args=("out",))
def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """``out = a @ b`` (``out += a @ b`` with `accumulate`) for 2-D `a` ``[M K]``, `b` ``[K N]``."""
    _in_torch(a, b, out, accumulate)


@mm_into.register_fake
def _(a, b, out, accumulate):
    return None


@mm_into.register_kernel("cuda")
def _(a, b, out, accumulate):
    if cublaslt.available(a.device):
        done = cublaslt.matmul(a, b, cublaslt.Epilogue.DEFAULT, out=out, accumulate=accumulate)
        if done is not None:
            return
    _in_torch(a, b, out, accumulate)


@torch.library.custom_op("sexpgpu::mm_f32", mutates_args=())
def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D `a` ``[M K]``, `b` ``[K N]``, in f32, made as `mm_into` makes it."""
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)
    mm_into(a, b, out, False)
    return out


@mm_f32.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)


def _in_torch(a, b, out, accumulate):
    product = torch.mm(a, b)
    if accumulate:
        out.add_(product)
    else:
        out.copy_(product)
