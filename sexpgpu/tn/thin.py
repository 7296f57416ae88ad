"""The product of a wide partial result with a thin core, written in its final layout (Triton).

`right_block` ends, for a site of a wide and a thin layer, with a product
whose contraction is tiny (the thin core's bond times one physical leg, 8
for a bond-4 MPO) and whose result must be rearranged for the sketch's
GEMM. As a reshape, a GEMM and a rearrangement that is three passes over
``Z`` (the largest array of the site), two of them permuted copies whose
innermost runs are 2 to 4 elements long, which copy far below the memory's
bandwidth. This kernel reads the partial result once, in place, and writes
``Z`` once, where it belongs::

    out[e, x, w, l, m] = sum_{r, y} z[e, r, l, x, y] * g[m, r, y, w]

``z`` may have any strides (it is the previous GEMM's result, viewed), ``g``
is small, and ``out`` is written through the strides the caller gives, so
one kernel serves the top-down chain (the thin layer below) and the
bottom-up one (the thin layer above). Real and complex; complex numbers are
pairs of floats, since Triton has no complex type. Accumulation is in the operands' precision, as
a BLAS product's.
"""

from __future__ import annotations

import os
from functools import cache
from math import prod
from typing import Any

__all__ = ["available", "fits", "thin_product"]

# Beyond these the unrolled loops outgrow the kernel (the contraction is
# meant to be a bond of a few and one physical leg).
MAX_CONTRACTED = 64
MAX_BOND = 32


def available(device: Any) -> bool:
    """Whether `thin_product` runs on this torch device: a GPU, or Triton's interpreter (tests)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fits(contracted: int, bond: int, free_phys: int) -> bool:
    """Whether a thin core of these sizes is small enough for the kernel."""
    return contracted <= MAX_CONTRACTED and bond <= MAX_BOND and free_phys <= 16


@cache
def _kernel() -> Any:
    """The jitted kernel, imported on first use (Triton reads its interpreter setting then)."""
    from .thin_kernel import thin_kernel

    return thin_kernel


def thin_product(z: Any, g: Any, out: Any) -> Any:
    """``out[e, x, w, l, m] = sum_{r, y} z[e, r, l, x, y] g[m, r, y, w]``; returns `out`.

    Parameters
    ----------
    z : torch.Tensor
        ``(E, R, L, X, Y)``, real or complex, any strides.
    g : torch.Tensor
        ``(M, R, Y, W)``, the same dtype (copied contiguous: it is small).
    out : torch.Tensor
        ``(E, X, W, L, M)``, the same dtype, any strides (a permuted view of
        the array the caller keeps), written in full.
    """
    import torch
    import triton

    e_, r_, l_, x_, y_ = z.shape
    m_, w_ = g.shape[0], g.shape[3]
    assert g.shape == (m_, r_, y_, w_) and out.shape == (e_, x_, w_, l_, m_), (z.shape, g.shape)
    assert z.dtype == g.dtype == out.dtype, (z.dtype, g.dtype, out.dtype)
    if prod(out.shape) == 0:
        return out
    cplx = z.is_complex()
    flat = torch.view_as_real if cplx else (lambda t: t)
    block = 64 if m_ <= 8 else 32  # the best of 32 to 512 on an H200 at a bond-4 layer
    grid = (e_, triton.cdiv(l_, block))
    _kernel()[grid](
        flat(z), flat(g.contiguous()), flat(out), l_,
        *z.stride(), *out.stride(),
        R=r_, X=x_, Y=y_, W=w_, M=m_,
        K2=triton.next_power_of_2(r_ * y_), M2=triton.next_power_of_2(m_), BL=block, CPLX=cplx,
    )  # fmt: skip
    return out
