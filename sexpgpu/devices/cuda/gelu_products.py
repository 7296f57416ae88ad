"""A linear layer's gelu inside its products: ``sexpgpu::linear_gelu``, ``sexpgpu::gelu_grad_mm``.

Apart, a layer ``gelu(x w + b)`` writes the product, reads it back for the
gelu and writes that; its gradient writes ``g w2^T``, reads it with the
product for gelu's derivative and writes the result. On a GPU cuBLASLt
does each half in its product's epilogue (`sexpgpu.devices.cuda.cublaslt`):
the forward writes the gelu and, for the backward, its input; the
backward's product applies gelu's derivative as it writes. The bias's
gradient stays a sum of its own: cuBLASLt's ``DGELU_BGRAD`` ran a second
kernel over the result, 0.44 ms against 0.23 ms apart at GPT-2 small's
width on an H200 (`dev/gelu_epilogue_probe.py`). A rewrite of the traced
step (`sexpgpu.devices.cuda.fx_rewrites.gelu_into_products`) puts them in.

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
    return _in_torch(x, w, b)


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
    return _in_torch(x, w, b)


def _in_torch(x, w, b):
    h = torch.addmm(b, x, w)
    return torch.nn.functional.gelu(h, approximate="tanh"), h


@torch.library.custom_op("sexpgpu::gelu_grad_mm", mutates_args=())
def gelu_grad_mm(dy: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``(dy w) * gelu'(h)`` for `dy` ``[M K]``, `w` ``[K N]``, `h` ``[M N]`` (gelu's input)."""
    return _grad_in_torch(dy, w, h)


@gelu_grad_mm.register_fake
def _(dy, w, h):
    return dy.new_empty((dy.shape[0], w.shape[1]))


@gelu_grad_mm.register_kernel("cuda")
def _(dy, w, h):
    if cublaslt.available(dy.device) and h.is_contiguous() and h.dtype == dy.dtype:
        dh = cublaslt.matmul(dy, w, cublaslt.Epilogue.DGELU, aux=h)
        if dh is not None:
            return dh
    return _grad_in_torch(dy, w, h)


def _grad_in_torch(dy, w, h):
    return torch.ops.aten.gelu_backward(dy @ w, h, approximate="tanh")
