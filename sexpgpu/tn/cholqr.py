"""The QR of a tall sketch from GEMMs (CholeskyQR2), on a PyTorch device.

Householder QR of a tall matrix (cuSOLVER's ``geqrf``) spends its time in
narrow panel kernels: on an H200 a 4000x1000 complex128 sketch took 11.4 ms,
five times a 4000x4000x1000 GEMM. CholeskyQR factors the Gram matrix
instead, in two GEMMs, a small Cholesky and a triangular solve::

    G = Y^H Y = R^H R   (Cholesky)      Q = Y R^{-1}   (triangular solve)

One pass loses orthogonality as ``u kappa(Y)^2``; a second pass on ``Q``
(CholeskyQR2) restores it to rounding whenever ``kappa(Y) <~ u^{-1/2}``
(Yamamoto, Nakatsukasa, Yanagisawa and Fukaya, *Roundoff error analysis of the
CholeskyQR2 algorithm*, ETNA 44, 2015). ``R`` is ``R2 R1``, with a real
positive diagonal: the phases `Backend.qr` fixes.

Precision. Single-precision sketches are factored in double (as in Yamazaki,
Tomov and Dongarra, *Mixed-precision Cholesky QR factorization*, SISC 37,
2015): on the H200 ZGEMM runs as fast as CGEMM, and the double Gram matrix
takes CholeskyQR2 from ``kappa <~ 3e3`` to ``kappa <~ 7e7``, past the point
where a single-precision sketch is numerically rank deficient anyway. Double
sketches have no wider type on a GPU: ``kappa <~ 1e7``. On a GPU whose double
precision runs at a small fraction of its single (`backend.wide_pays`), a
single sketch is factored in single (``wide=False``): ``kappa <~ 3e3``, and
the sketches beyond fall back to Householder QR.

The second pass. ``E = Q1^H Q1 - I`` measures how far the first pass left
``Q1`` from orthonormal (``u kappa^2``, with ``u`` the unit roundoff of the
precision the pass ran in); its norm is read on the host, the one sync of
the factorization, to pick the cheapest second pass that is exact to the
result's rounding ``eps``: none where ``||E||_F <= eps`` (a single sketch of
``kappa <~ 1e4``, factored in double, needs only one pass); where
``||E||_F <= eps^(1/2)``, the first-order Cholesky factor ``I + U`` of
``I + E`` (``U`` the upper triangle of ``E``, its diagonal halved) and
``Q = Q1 (I - U)``, one GEMM, whose error ``O(||E||^2)`` is below ``eps``; and
otherwise the full second pass. On an H200 a 4000x1000 sketch's QR took
5.5 ms with the full pass, 4.1 ms with the first-order one, and in
complex64 3.3 ms with the first pass alone.

Failure. Beyond that, or for a sketch whose exact rank is below its width,
the Cholesky factorization breaks down or ``Q1`` comes out far from
orthonormal. Both are caught on the device: either
Cholesky reports a non-positive pivot, or ``||Q1^H Q1 - I||_F`` (the second
pass's own Gram matrix) exceeds 1/2, which also catches NaN and Inf. When it
is at most 1/2, ``kappa(Q1)^2 <= 3``, so the second pass is accurate: ``Q``
is orthonormal and ``Y = Q R`` to rounding, as from Householder QR. The
caller reads the flag when it can without stalling the device and falls back
to Householder QR (`sexpgpu.tn.sweep.basis`). Shifted CholeskyQR3 (Fukaya,
Kannan, Nakatsukasa, Zhang and Yamamoto, SISC 42, 2020) would rescue
``1e7 <~ kappa <~ 1e11`` in double too, at a third pass on every site; the
fallback covers those sketches, and rank-deficient ones fail either way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cholesky_qr2"]

# ||Q1^H Q1 - I||_F above this fails the factorization (see the module docstring).
ORTHOGONALITY_SLACK = 0.5


def _wider(dtype: Any) -> Any:
    """The double-precision dtype of the same kind as ``dtype``."""
    import torch

    return {torch.float32: torch.float64, torch.complex64: torch.complex128}.get(dtype, dtype)


def _cholesky_qr(y: Any, gram: Any) -> tuple[Any, Any, Any]:
    """One pass from the Gram matrix ``y^H y``: ``Q``, ``R``, Cholesky's ``info`` (0: ok)."""
    import torch

    r, info = torch.linalg.cholesky_ex(gram, upper=True)  # no host sync on failure
    q = torch.linalg.solve_triangular(r, y, upper=True, left=False)  # q r = y
    return q, r, info


def cholesky_qr2(x: Any, *, with_r: bool, wide: bool = True) -> tuple[Any, Any | None, Any]:
    """Thin QR of a tall matrix ``x`` (rows >= columns) by CholeskyQR2.

    Parameters
    ----------
    x : torch.Tensor
        ``(m, n)`` with ``m >= n``, float32, float64, complex64 or complex128.
    with_r : bool
        Whether to form ``R`` (one more small GEMM).
    wide : bool
        Whether a single-precision ``x`` is factored in double (the default;
        False on a GPU whose double-precision products are slow: then in its
        own precision, where more sketches fall back to Householder).

    Returns
    -------
    q : torch.Tensor
        ``(m, n)``, ``x``'s dtype; orthonormal unless ``failed``.
    r : torch.Tensor or None
        ``(n, n)`` upper triangular with a real positive diagonal, ``x = q r``.
    failed : torch.Tensor
        A device boolean: set when ``q`` must not be used (fall back to Householder).
    """
    import torch

    assert x.shape[0] >= x.shape[1], x.shape
    y = x.to(_wider(x.dtype)) if wide else x  # a copy only in single precision
    q1, r1, info1 = _cholesky_qr(y, y.mH @ y)
    del y
    gram = q1.mH @ q1
    gram.diagonal().sub_(1)  # E = Q1^H Q1 - I
    slack = torch.linalg.matrix_norm(gram)  # Frobenius; NaN where anything went non-finite
    failed = (info1 != 0) | ~(slack <= ORTHOGONALITY_SLACK)
    eps = float(torch.finfo(x.dtype).eps)
    size = float(slack)  # the one host sync: it picks the second pass
    if size <= eps:  # Q1 is orthonormal to the result's own rounding
        q, r = q1, (r1.to(x.dtype) if with_r else None)
    elif size <= eps**0.5:
        # chol(I + E) = I + U + O(E^2) for U = triu(E) with half its diagonal,
        # and (I + U)^-1 = I - U + O(E^2): O(E^2) is below the result's
        # rounding, and one GEMM replaces a Cholesky and a TRSM.
        u = gram.triu_()
        u.diagonal().mul_(0.5)
        q = torch.addmm(q1, q1, u, alpha=-1)
        u.diagonal().add_(1)
        r = (u @ r1).to(x.dtype) if with_r else None
    else:
        gram.diagonal().add_(1)
        q, r2, info2 = _cholesky_qr(q1, gram)
        failed |= info2 != 0
        r = (r2 @ r1).to(x.dtype) if with_r else None
    return q.to(x.dtype), r, failed
