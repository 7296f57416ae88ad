"""Complex matrix products as three real ones (the 3M method), on PyTorch.

A complex GEMM ``C = A B`` is four real products; three suffice::

    T1 = Ar Br        T2 = Ai Bi        T3 = (Ar + Ai)(Br + Bi)
    Re C = T1 - T2                      Im C = T3 - T1 - T2

It saves a quarter of the flops where SGEMM and DGEMM run at CGEMM's and
ZGEMM's rate per real flop (CGEMM does not use TF32), less the passes over
memory that split the operands into real planes (``view_as_real``
interleaves them) and join the result: one copy of each operand into its two
planes, one in-place sum of each, and two subtractions into the result, the
third GEMM folding ``- T1`` in as its ``beta``. On an H200 that trade wins
only for the widest products (`three_m_pays`; the figures beside it).

Accuracy (Higham, *Stability of a method for multiplying complex matrices
with three real matrix multiplications*, SIMAX 13, 1992): the real part is
computed as by the plain product; the imaginary part's error is bounded
normwise by a small multiple of the plain product's bound, but not
componentwise: an imaginary part much smaller than ``|A| |B|`` loses
relative accuracy. The sweep's errors are normwise (a train's relative
Frobenius error), so the result is as accurate to a small constant.

Which products take this path is `TorchBackend`'s choice (`THREE_M`), from the
shapes alone, so every budget still runs the same products bit for bit.
"""

from __future__ import annotations

from typing import Any

__all__ = ["THREE_M", "THREE_M_INTENSITY", "THREE_M_MIN", "matmul_3m", "three_m_pays"]

# How `TorchBackend` computes complex products, read when a backend is made:
# "auto": by `matmul_3m` on a GPU where `three_m_pays`, else one complex GEMM;
# "always": by `matmul_3m`, every one, on any torch device (the tests run the
# GPU's path on the CPU with it; dev/tn_profile.py times both); "never".
THREE_M = "auto"
MODES = ("auto", "always", "never")

# Measured on an H200 (dev/tn_profile.py --parts gemm, chi=1000): SGEMM and
# DGEMM run a little below CGEMM's and ZGEMM's rate per real flop, so the three
# real GEMMs alone save 19% (complex64) and 23% (complex128) at 4000x4000x1000
# but only 5% and 18% at the sweep's tiles (1396x1000x4000); the passes over
# the planes take 0.1 to 0.3 ms more. The whole product by 3M: 1.11x and 1.05x
# at 4000x4000x1000 (667 multiply-adds per element moved), 0.86x to 1.05x at
# the tiles (up to 509). The threshold, per complex64 element and doubled for
# complex128 (twice the bytes for the same flops saved), takes 3M only where
# it measured faster. Below THREE_M_MIN multiply-adds the ten kernel launches
# cost about what it could save.
THREE_M_INTENSITY = 600
THREE_M_MIN = 1 << 30


def three_m_pays(m: int, k: int, n: int, batch: int = 1, itemsize: int = 8) -> bool:
    """Whether ``batch`` complex products ``(m, k) @ (k, n)`` run faster by 3M on a GPU.

    ``itemsize`` is the complex dtype's (8 for complex64, 16 for complex128).
    """
    madds = batch * m * k * n
    moved = batch * (m * k + k * n + m * n)
    return madds >= THREE_M_MIN and 8 * madds >= THREE_M_INTENSITY * itemsize * moved


def _planes(x: Any) -> Any:
    """``x``'s real and imaginary parts as one real tensor ``(2, *x.shape)``, in one copy.

    A transposed matrix (an adjoint, or a view BLAS takes as it is) keeps its
    layout, so the copy streams; the planes come back as transposed views. A
    conjugate view is read as its plain view and its imaginary plane negated.
    """
    import torch

    conj = x.is_conj()
    if conj:
        x = x.conj()  # the same memory without the conjugate bit
    x = x.resolve_neg()
    flip = x.dim() >= 2 and not x.is_contiguous() and x.mT.is_contiguous()
    if flip:
        x = x.mT
    planes = torch.view_as_real(x).movedim(-1, 0).contiguous()  # (2, ...)
    if conj:
        planes[1].neg_()
    return planes.mT if flip else planes


def matmul_3m(a: Any, b: Any) -> Any:
    """``a @ b`` for complex matrices ``(m, k) @ (k, n)`` or batches ``(p, m, k) @ (p, k, n)``.

    Three real GEMMs (the module docstring). Beside the operands and the
    result it holds as many bytes again as the three of them, at most
    (`sexpgpu.tn.plan` counts them): the planes of ``a`` and of ``b``, and
    ``T1`` and ``T2``.
    """
    import torch

    assert a.is_complex() and a.dtype == b.dtype and a.dim() == b.dim() in (2, 3)
    pa, pb = _planes(a), _planes(b)  # (2, .., m, k), (2, .., k, n)
    t1 = torch.matmul(pa[0], pb[0])
    t2 = torch.matmul(pa[1], pb[1])
    out = torch.empty(t1.shape, dtype=a.dtype, device=a.device)
    parts = torch.view_as_real(out)  # (.., m, n, 2): the real and imaginary parts, strided
    torch.sub(t1, t2, out=parts[..., 0])
    pa[0] += pa[1]
    pb[0] += pb[1]
    # T3 - T1 in one GEMM, T1 as its C with beta = -1
    if t1.dim() == 2:
        t1.addmm_(pa[0], pb[0], beta=-1)
    else:
        t1.baddbmm_(pa[0], pb[0], beta=-1)
    del pa, pb
    torch.sub(t1, t2, out=parts[..., 1])
    return out
