"""A singular value decomposition that does not give up, and a thin QR straight from LAPACK.

LAPACK's divide-and-conquer SVD (``gesdd``, what ``np.linalg.svd`` calls) now
and then fails to converge on finite matrices with clusters of tiny singular
values, which the sketches of nearly low-rank products have. The same matrix
conjugate-transposed, or LAPACK's QR-iteration SVD (``gesvd``), converges.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np

__all__ = ["qr", "qr_basis", "svd"]

logger = logging.getLogger(__name__)

# Columns per block LAPACK may use in the QR (its own choice is 32).
_QR_BLOCK = 64


def svd(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Thin SVD ``matrix = u @ diag(s) @ vh``, with fallbacks when LAPACK fails.

    Parameters
    ----------
    matrix : numpy.ndarray
        A finite 2-D array.

    Returns
    -------
    u, s, vh : numpy.ndarray
        As ``np.linalg.svd(matrix, full_matrices=False)``.
    """
    try:
        return np.linalg.svd(matrix, full_matrices=False)
    except np.linalg.LinAlgError:
        logger.debug("SVD of a %s matrix did not converge; trying its adjoint", matrix.shape)
    try:
        u, s, vh = np.linalg.svd(matrix.conj().T, full_matrices=False)
        return vh.conj().T, s, u.conj().T
    except np.linalg.LinAlgError:
        logger.debug("SVD of the adjoint did not converge either; using gesvd")
    try:
        from scipy.linalg import svd as scipy_svd  # optional: only on this rare path
    except ImportError:
        return _svd_by_eigh(matrix)
    return scipy_svd(matrix, full_matrices=False, lapack_driver="gesvd")


def qr(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Thin Householder QR, ``matrix = q @ r``, by LAPACK's ``geqrf`` and ``ungqr``.

    ``np.linalg.qr`` calls the same routines but copies around them and forms
    ``r`` apart; at the sweep's sketch sizes (a few hundred rows) that costs
    a third of the factorization. Here ``q`` comes back in Fortran order, so
    its transpose (the output core) is C-contiguous without a copy. Without
    SciPy, NumPy's QR.
    """
    q, r = _householder(matrix, lambda factors, k: np.triu(factors[:k]))
    if q is None:
        return tuple(np.linalg.qr(matrix))
    return q, r


def qr_basis(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`qr`'s ``q`` and the diagonal of its ``r``, without forming ``r``."""
    q, diagonal = _householder(matrix, lambda factors, _k: np.diagonal(factors).copy())
    if q is None:
        q, r = np.linalg.qr(matrix)
        return q, np.diagonal(r).copy()
    return q, diagonal


def _householder(
    matrix: np.ndarray, keep: Callable[[np.ndarray, int], np.ndarray]
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``q``, and ``keep(factors, k)`` read from LAPACK's factors before ``q`` replaces them.

    ``r`` lies in the factors' upper triangle. ``ungqr`` writes ``q`` over the
    factors (a fresh array, ours) rather than over a copy of them, so the
    QR allocates no array beyond its result. Without SciPy, ``(None, None)``.
    """
    routines = _qr_routines(matrix.dtype.char)
    if routines is None:
        return None, None
    geqrf, ungqr = routines
    k = min(matrix.shape)
    # SciPy's default workspace (3n) would keep LAPACK unblocked where it
    # blocks (from 128 columns); room for _QR_BLOCK columns lets it.
    factors, tau, _work, info = geqrf(matrix, lwork=max(1, _QR_BLOCK * matrix.shape[1]))
    assert info == 0, f"geqrf: info={info}"
    kept = keep(factors, k)
    q, _work, info = ungqr(factors[:, :k], tau, lwork=max(1, _QR_BLOCK * k), overwrite_a=1)
    assert info == 0, f"ungqr: info={info}"
    return q, kept


@cache
def _qr_routines(char: str) -> tuple[Any, Any] | None:
    """LAPACK's ``geqrf`` and ``ungqr`` (``orgqr``) for a dtype, looked up once."""
    try:
        from scipy.linalg import lapack  # optional: NumPy's QR otherwise
    except ImportError:
        return None
    probe = np.empty((1, 1), dtype=char)
    real = probe.dtype.kind != "c"
    return tuple(lapack.get_lapack_funcs(("geqrf", "orgqr" if real else "ungqr"), (probe,)))


def _svd_by_eigh(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The SVD from the eigenvectors of ``m m^H`` (loses the smallest values' digits)."""
    w, u = np.linalg.eigh(matrix @ matrix.conj().T)
    order = np.argsort(w)[::-1][: min(matrix.shape)]
    s = np.sqrt(np.clip(w[order], 0.0, None))
    u = u[:, order]
    safe = np.where(s > s[0] * np.finfo(s.dtype).eps, s, np.inf)
    vh = (u.conj().T @ matrix) / safe[:, None]
    return u, s, vh
