"""A linear layer's gelu inside its products: ``sexpgpu::linear_gelu``, ``sexpgpu::gelu_grad_mm``.

Apart, a layer ``gelu(x w + b)`` writes the product, reads it back for the
gelu and writes that; its gradient writes ``g w2^T``, reads it with the
product for gelu's derivative, writes the result and reads it once more for
the bias's gradient. On a GPU cuBLASLt does each half in its product's
epilogue (`sexpgpu.devices.cuda.cublaslt`): the forward writes the gelu
and, for the backward, its input; the backward's product applies gelu's
derivative and sums the bias's gradient as it writes. A rewrite of the
traced step (`sexpgpu.devices.cuda.fx_rewrites.gelu_into_products`) puts
them in.

Both are PyTorch custom ops, so traces and Inductor keep each as one call.
Elsewhere (the CPU, a shape or dtype cuBLASLt refuses) they are the same
arithmetic in torch calls. Gelu is the tanh approximation, as the IR's.
On a GPU the epilogue takes gelu and its derivative of the product before it
is rounded to the operands' type, so bf16 results differ from the calls'
by a rounding.
"""

from __future__ import annotations

import torch

from sexpgpu.devices.cuda import cublaslt

__all__ = ["gelu_grad_mm", "linear_gelu"]


@torch.library.custom_op("sexpgpu::linear_gelu", mutates_args=())
def linear_gelu(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``gelu(x w + b)``, ``x w + b``) for 2-D `x` ``[M K]``, `w` ``[K N]`` and `b` ``[N]``."""
    h = torch.addmm(b, x, w)
    return torch.nn.functional.gelu(h, approximate="tanh"), h


@linear_gelu.register_fake
def _(x, w, b):
    return x.new_empty((x.shape[0], w.shape[1])), x.new_empty((x.shape[0], w.shape[1]))


@linear_gelu.register_kernel("cuda")
def _(x, w, b):
    if cublaslt.available(x.device) and b.is_contiguous() and b.dtype == x.dtype:
        h = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)
        g = cublaslt.matmul(x, w, cublaslt.Epilogue.GELU_AUX_BIAS, bias=b, aux=h)
        if g is not None:
            return g, h
    h = torch.addmm(b, x, w)
    return torch.nn.functional.gelu(h, approximate="tanh"), h


@torch.library.custom_op("sexpgpu::gelu_grad_mm", mutates_args=())
def gelu_grad_mm(
    dy: torch.Tensor, w: torch.Tensor, h: torch.Tensor, bias_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``(dy w) * gelu'(h)``, its column sums where `bias_grad`, else an empty tensor).

    `dy` ``[M K]``, `w` ``[K N]``, `h` ``[M N]`` (the forward's gelu input).
    """
    return _grad_in_torch(dy, w, h, bias_grad)


@gelu_grad_mm.register_fake
def _(dy, w, h, bias_grad):
    n = w.shape[1]
    return dy.new_empty((dy.shape[0], n)), dy.new_empty((n,) if bias_grad else (0,))


@gelu_grad_mm.register_kernel("cuda")
def _(dy, w, h, bias_grad):
    if cublaslt.available(dy.device) and h.is_contiguous() and h.dtype == dy.dtype:
        n = w.shape[1]
        db = torch.empty((n,) if bias_grad else (0,), dtype=dy.dtype, device=dy.device)
        epilogue = cublaslt.Epilogue.DGELU_BGRAD if bias_grad else cublaslt.Epilogue.DGELU
        dh = cublaslt.matmul(dy, w, epilogue, bias=db if bias_grad else None, aux=h)
        if dh is not None:
            return dh, db
    return _grad_in_torch(dy, w, h, bias_grad)


def _grad_in_torch(dy, w, h, bias_grad):
    dh = torch.ops.aten.gelu_backward(dy @ w, h, approximate="tanh")
    return dh, dh.sum(0) if bias_grad else dh.new_empty((0,))
