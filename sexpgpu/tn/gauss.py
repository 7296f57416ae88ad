"""A complex matrix product from three real ones (Gauss's trick), on a PyTorch device.

A complex GEMM is four real ones: ``(Ar + i Ai)(Br + i Bi)`` has real part
``Ar Br - Ai Bi`` and imaginary part ``Ar Bi + Ai Br``. The imaginary part is
also ``(Ar + Ai)(Br + Bi) - Ar Br - Ai Bi``, which reuses the real part's two
products: three real GEMMs instead of four, a quarter fewer multiply-adds for
a few passes over the operands and the result (splitting them into real and
imaginary planes, two sums, the planes back into complex numbers). The
sweep's large products (``(1400, 1000) @ (1000, 4000)`` and the like, at chi
1000) are bound by the multiply-adds, so the passes cost little.

Accuracy. The real part is computed as by the complex GEMM; the imaginary
part's error is bounded by the norms of the sums, ``|Ar + Ai| |Br + Bi|``, at
most twice the complex product's bound ``|A| |B|``: the method is stable
norm-wise (Higham, *Stability of a method for multiplying complex matrices
with three real matrix multiplications*, SIMAX 13, 1992), though an
imaginary part much smaller than the real part is computed with less
relative accuracy than a complex GEMM gives.

Memory. Beside the operands and the result: the operands' planes (as large
as the operands), then the result's planes and a third of them, then the
result itself while its planes are interleaved: at most the operands plus
one and a half results.
"""

from __future__ import annotations

from typing import Any

__all__ = ["gauss_mm", "gauss_worth"]

# Below these the passes over the operands outweigh the multiply-adds saved
# (a product must be compute bound for the trick to pay).
GAUSS_MIN_DIM = 512
GAUSS_MIN_MACS = 1 << 30


def gauss_worth(m: int, k: int, n: int) -> bool:
    """Whether an ``(m, k) @ (k, n)`` complex product is large enough for `gauss_mm`."""
    return min(m, k, n) >= GAUSS_MIN_DIM and m * k * n >= GAUSS_MIN_MACS


def _planes(x: Any) -> Any:
    """``x``'s real and imaginary parts as ``(2, rows, cols)`` planes, in ``x``'s layout.

    A transposed operand (BLAS reads it as it is) stays transposed: its
    planes are split from the transpose and viewed back.
    """
    import torch

    flip = not x.is_contiguous() and x.mT.is_contiguous()
    base = (x.mT if flip else x).resolve_conj()
    planes = torch.view_as_real(base).permute(2, 0, 1).contiguous()
    return planes.mT if flip else planes


def gauss_mm(a: Any, b: Any) -> Any:
    """``a @ b`` for complex 2-D tensors ``a``, ``b``, by three real GEMMs.

    Returns a C-contiguous complex tensor, as ``torch.mm`` does.
    """
    import torch

    pa, pb = _planes(a), _planes(b)
    out = torch.empty((2, a.shape[0], b.shape[1]), dtype=pa.dtype, device=a.device)
    torch.mm(pa[0], pb[0], out=out[0])  # T1 = Ar Br
    t2 = torch.mm(pa[1], pb[1])  # T2 = Ai Bi
    torch.add(out[0], t2, out=out[1])  # T1 + T2
    out[0].sub_(t2)  # real part: T1 - T2
    del t2
    pa[0].add_(pa[1])  # Ar + Ai, in place: the planes are not read again
    pb[0].add_(pb[1])
    out[1].addmm_(pa[0], pb[0], beta=-1)  # imaginary part: (Ar + Ai)(Br + Bi) - T1 - T2
    del pa, pb
    return torch.view_as_complex(out.permute(1, 2, 0).contiguous())
