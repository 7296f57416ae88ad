"""The final pass after an oversampled sweep: truncate to ``chi_out`` by SVDs.

The right-to-left pass leaves a right-canonical train whose bonds are the
sketch size. One left-to-right pass of SVDs truncates it to ``chi_out``
exactly (and applies ``cutoff``), leaving it left-canonical with the norm on
the last site::

    centre_j (l, r, u, d) -> (l u d, r) = [Q] U S Vh -> core_j = U[:, :rank]
    centre_{j+1} = S Vh[:rank] . core_{j+1}

It reads the cores one at a time from a sink and writes the result to
another, on the backend of rank 0.
"""

from __future__ import annotations

import numpy as np

from .backend import Backend
from .sink import CoreSink

__all__ = ["truncate"]


def truncate(
    xp: Backend, source: CoreSink, dest: CoreSink, n_sites: int, chi_out: int, cutoff: float
) -> None:
    """Truncate the right-canonical padded train in ``source`` into ``dest``.

    Parameters
    ----------
    xp : Backend
        Where the SVDs run.
    source, dest : CoreSink
        The right-canonical cores, read in site order; the truncated cores.
    n_sites : int
        The number of sites.
    chi_out : int
        The largest bond kept.
    cutoff : float
        Singular values below ``cutoff * sigma_max`` are dropped.
    """
    centre = xp.upload(source.get(0))
    for j in range(n_sites - 1):
        left, right, up, down = centre.shape
        matrix = xp.contiguous(xp.permute(centre, (0, 2, 3, 1))).reshape(left * up * down, right)
        q = None
        if matrix.shape[0] > right:  # a tall matrix: the SVD sees only its R factor
            q, matrix = xp.qr(matrix)
        u, sv, vh = xp.svd(matrix)
        rank = min(chi_out, sv.size)
        if cutoff > 0:
            rank = min(rank, max(1, int(np.count_nonzero(sv >= cutoff * sv[0]))))
        u = u[:, :rank] if q is None else xp.dot(q, xp.contiguous(u[:, :rank]))
        core = xp.contiguous(xp.permute(u.reshape(left, up, down, rank), (0, 3, 1, 2)))
        dest.put(j, xp.to_host(core))
        carry = xp.scale_rows(sv[:rank], vh[:rank])  # (rank, r)
        nxt = xp.upload(source.get(j + 1))
        centre = xp.dot(carry, nxt.reshape(nxt.shape[0], -1)).reshape(rank, *nxt.shape[1:])
    dest.put(n_sites - 1, xp.to_host(centre))
