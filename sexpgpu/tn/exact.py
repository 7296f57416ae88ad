"""Exact contraction and truncation of small stacks.

The randomized sweep needs three sites. A two-site stack is one matrix between
its two physical halves, so one dense SVD is cheaper and exact::

    ┌── F_0 ──b── F_1 ──┐        theta = (u0 d0, u1 d1)  ->  U S | Vh
        │ │       │ │

`fuse` also builds the per-site product cores the tests use as references.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .linalg import svd

__all__ = ["exact_two_sites", "fuse"]


def fuse(cores: Sequence[np.ndarray]) -> np.ndarray:
    """Contract one site of a stack into a single padded core.

    Parameters
    ----------
    cores : sequence of numpy.ndarray
        The padded ``(l, r, u, d)`` cores of one site, upper layer first.

    Returns
    -------
    numpy.ndarray
        ``(l_0 l_1 .., r_0 r_1 .., u, d)``, bonds fused in layer order.
    """
    fused = np.asarray(cores[-1])
    for core in reversed(cores[:-1]):
        l1, r1, up, _ = core.shape
        l2, r2, _, down = fused.shape
        # (l1, r1, u, x) . (l2, r2, x, d) -> (l1, r1, u, l2, r2, d)
        prod_ = np.tensordot(core, fused, axes=([3], [2]))
        fused = prod_.transpose(0, 3, 1, 4, 2, 5).reshape(l1 * l2, r1 * r2, up, down)
    return fused


def exact_two_sites(
    sites: Sequence[Sequence[np.ndarray]], chi_out: int, cutoff: float, dtype: np.dtype
) -> list[np.ndarray]:
    """Contract a two-site stack and truncate it by one SVD.

    Parameters
    ----------
    sites : sequence
        For each of the two sites, its padded cores, upper layer first.
    chi_out : int
        The largest bond kept.
    cutoff : float
        Singular values below ``cutoff * sigma_max`` are dropped.
    dtype : numpy.dtype
        The result's dtype.

    Returns
    -------
    list of numpy.ndarray
        Two padded cores, right-canonical.
    """
    left, right = (fuse([np.asarray(c, dtype=dtype) for c in site]) for site in sites)
    _, bond, u0, d0 = left.shape
    u1, d1 = right.shape[2:]
    theta = left.reshape(bond, u0 * d0).T @ right.reshape(bond, u1 * d1)
    u, sv, vh = svd(theta)
    rank = min(chi_out, sv.size)
    if cutoff > 0:
        rank = min(rank, max(1, int(np.count_nonzero(sv >= cutoff * sv[0]))))
    first = (u[:, :rank] * sv[:rank]).reshape(u0, d0, rank).transpose(2, 0, 1)
    return [
        np.ascontiguousarray(first)[None],
        np.ascontiguousarray(vh[:rank]).reshape(rank, 1, u1, d1),
    ]
