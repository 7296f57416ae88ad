"""The SRC sweep over a stack in ket form (Camaño, Epperly and Tropp, arXiv:2504.06475).

Left to right, the sketched left environments are built and stored::

    C_0 = 1,   C_{j+1} = C_j . cores_j . omega_j        (s columns, Khatri-Rao)

Right to left, each output core is an orthonormal basis of the sketch of the
part of the network right of the cut, and the projected environment ``S``
carries the compressed right part::

    Z_j = cores_j . S_{j+1}          (e, u, d, l..)
    Y_j = Z_j C_j^T                  (e u d, s)       the sketch
    Q_j = qr(Y_j)                    output core j = Q_j^T as (c, e, u, d)
    S_j = conj(core_j) Z_j           (c, l..)

and the first core is ``Z_0`` itself. The result is right-canonical. With an
oversampled sketch a final left-to-right SVD pass truncates it to ``chi_out``
and leaves it left-canonical.

Each site is read twice, once per pass, when the pass reaches it; no pass holds
more than one site of the input.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from math import prod
from pathlib import Path
from time import perf_counter

import numpy as np

from .kernels import env_peak_per_column, env_step, right_block
from .linalg import svd
from .sketch import SketchSource
from .store import EnvironmentStore
from .trains import Stack

__all__ = ["Plan", "make_plan", "sweep", "truncate"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """How one sweep uses host memory.

    Attributes
    ----------
    env_batch : int
        Sketch columns per product of the left-to-right pass.
    proj_batch : int
        Rows of the projected environment per block of the right-to-left pass;
        a site with more rows computes its block ``Z`` twice, once for the
        sketch and once for the projection, rather than holding all of it.
    env_bytes : int
        Bytes of all stored environments.
    store_budget : int
        Bytes of those kept in memory; the rest go to ``scratch_dir``.
    work_bytes : int
        The estimated working set of either pass.
    """

    env_batch: int
    proj_batch: int
    env_bytes: int
    store_budget: int
    work_bytes: int


def make_plan(stack: Stack, size: int, work: np.dtype, host_budget: int) -> Plan:
    """Size the batches and the in-memory share of the environments to a host budget."""
    item = work.itemsize
    # A sketch column on the left and a projected row on the right run through
    # the same chain of products, so one bound serves both passes.
    per_line = max(env_peak_per_column(stack.shapes(j)) for j in range(stack.n_sites)) * item
    env_batch = int(min(size, max(1, (host_budget // 2) // per_line)))
    proj_batch = int(min(size, max(1, (host_budget // 2) // per_line)))
    env_bytes, rtl = 0, 0
    for j in range(stack.n_sites):
        shapes = stack.shapes(j)
        lefts = prod(s[0] for s in shapes)
        rows = min(size, prod(s[1] for s in shapes)) * shapes[0][2] * shapes[-1][3]
        if j > 0:
            env_bytes += size * lefts * item
        # the sketch, the environment read back, and the new projected environment
        rtl = max(rtl, (rows * size + 2 * size * lefts) * item)
    work_bytes = max(env_batch, proj_batch) * per_line + rtl
    return Plan(env_batch, proj_batch, env_bytes, max(0, host_budget - work_bytes), work_bytes)


def _read(stack: Stack, j: int, work: np.dtype) -> list[np.ndarray]:
    # One dtype for every operand keeps np.dot on its BLAS path.
    return [core.astype(work, copy=False) for core in stack.read(j)]


def _left_to_right(
    stack: Stack, sketches: SketchSource, work: np.dtype, plan: Plan, store: EnvironmentStore
) -> None:
    """Build and store ``C_1 .. C_{n-1}``."""
    size, k = sketches.size, len(stack.layers)
    env = np.ones((size,) + (1,) * k, dtype=work)
    batch = plan.env_batch
    for j in range(stack.n_sites - 1):
        cores = _read(stack, j, work)
        up, down = cores[0].shape[2], cores[-1].shape[3]
        omega = sketches.draw(up, down).astype(work, copy=False)
        out = store.allocate(j + 1, (size, *(c.shape[1] for c in cores)), work)
        lo = 0
        while lo < size:
            hi = min(lo + batch, size)
            try:
                out[lo:hi] = env_step(env[lo:hi], omega[lo:hi], cores)
            except MemoryError:
                # The columns are independent: halve the batch for the rest of the sweep.
                if hi - lo == 1:
                    raise
                batch = (hi - lo + 1) // 2
                logger.debug(
                    "out of memory in a batch of %d columns; %d from now on", hi - lo, batch
                )
                continue
            lo = hi
        env = out
        del cores, omega  # released before the next site is read
        logger.debug("left-to-right: site %d of %d", j + 1, stack.n_sites - 1)


def _basis(sketch: np.ndarray, cutoff: float, cap: int) -> np.ndarray:
    """An orthonormal basis of the sketch's range, cut at ``cutoff * sigma_max``.

    ``cap`` bounds the rank the sketch can have (the bond left of the cut); a
    basis wider than that would only span rounding noise.
    """
    q, r = np.linalg.qr(sketch)
    if cutoff <= 0 and cap >= q.shape[1]:
        return q
    u, sv, _ = svd(r)
    rank = min(cap, sv.size)
    if cutoff > 0:
        rank = min(rank, max(1, int(np.count_nonzero(sv >= cutoff * sv[0]))))
    return q @ u[:, :rank]


def _left_ranks(stack: Stack) -> list[int]:
    """For every cut ``j | j+1``, a bound on the product's rank there.

    The smaller of the product of the bonds crossing the cut and the product of
    the physical dimensions left of it.
    """
    bounds, phys = [], 1
    for j in range(stack.n_sites - 1):
        shapes = stack.shapes(j)
        phys = min(phys * shapes[0][2] * shapes[-1][3], 2**62)
        bounds.append(min(phys, prod(s[1] for s in shapes)))
    return bounds


def _right_to_left(
    stack: Stack, size: int, work: np.dtype, cutoff: float, plan: Plan, store: EnvironmentStore
) -> list[np.ndarray]:
    """Build the right-canonical output cores from the last site down."""
    k = len(stack.layers)
    proj = np.ones((1,) * (k + 1), dtype=work)
    caps = _left_ranks(stack)
    reversed_cores: list[np.ndarray] = []
    for j in range(stack.n_sites - 1, 0, -1):
        cores = _read(stack, j, work)
        env = store.take(j).reshape(size, -1)  # (s, l..)
        e, lefts = proj.shape[0], [c.shape[0] for c in cores]
        up, down = cores[0].shape[2], cores[-1].shape[3]
        if e <= plan.proj_batch:
            z = right_block(proj, cores).reshape(e * up * down, -1)  # (e u d, l..)
            q = _basis(z @ env.T, cutoff, caps[j - 1])  # (e u d, c)
            proj_next = q.T.conj() @ z
        else:
            q, proj_next = _blocked_step(proj, cores, env, cutoff, caps[j - 1], plan.proj_batch)
        del env
        core = np.ascontiguousarray(q.T).reshape(-1, e, up, down)  # (c, e, u, d)
        reversed_cores.append(core)
        proj = proj_next.reshape(-1, *lefts)  # (c, l..)
        del cores
        logger.debug("right-to-left: site %d, bond %d", j, core.shape[0])
    z = right_block(proj, _read(stack, 0, work))
    first = z.reshape(1, *z.shape[:3])  # (1, e, u, d)
    return [first, *reversed(reversed_cores)]


def _blocked_step(
    proj: np.ndarray,
    cores: list[np.ndarray],
    env: np.ndarray,
    cutoff: float,
    cap: int,
    rows: int,
) -> tuple[np.ndarray, np.ndarray]:
    """One right-to-left step with ``Z`` in blocks of ``rows`` projected rows.

    The rows of ``Z`` are ``(e, u, d)``, so a block of ``e`` is a block of rows
    of the sketch and of columns of ``Q^H``. Each block is computed twice.
    """
    blocks = [(lo, min(lo + rows, proj.shape[0])) for lo in range(0, proj.shape[0], rows)]

    def z_block(lo: int, hi: int) -> np.ndarray:
        z = right_block(proj[lo:hi], cores)
        return z.reshape(z.shape[0] * z.shape[1] * z.shape[2], -1)

    q = _basis(np.concatenate([z_block(lo, hi) @ env.T for lo, hi in blocks]), cutoff, cap)
    qh = q.T.conj()
    ud = q.shape[0] // proj.shape[0]
    proj_next = sum(qh[:, lo * ud : hi * ud] @ z_block(lo, hi) for lo, hi in blocks)
    return q, proj_next


def truncate(cores: list[np.ndarray], chi_out: int, cutoff: float) -> list[np.ndarray]:
    """Truncate a right-canonical padded train to ``chi_out`` by SVDs, left to right.

    The result is left-canonical, with the norm on the last site.
    """
    out: list[np.ndarray] = []
    centre = cores[0]
    for j in range(len(cores) - 1):
        left, right, up, down = centre.shape
        matrix = centre.transpose(0, 2, 3, 1).reshape(left * up * down, right)
        q = None
        if matrix.shape[0] > right:  # a tall matrix: the SVD sees only its R factor
            q, matrix = np.linalg.qr(matrix)
        u, sv, vh = svd(matrix)
        rank = min(chi_out, sv.size)
        if cutoff > 0:
            rank = min(rank, max(1, int(np.count_nonzero(sv >= cutoff * sv[0]))))
        u = u[:, :rank] if q is None else q @ u[:, :rank]
        out.append(np.ascontiguousarray(u.reshape(left, up, down, rank).transpose(0, 3, 1, 2)))
        carry = sv[:rank, None] * vh[:rank]  # (rank, r)
        nxt = cores[j + 1]
        centre = (carry @ nxt.reshape(nxt.shape[0], -1)).reshape(rank, *nxt.shape[1:])
    out.append(centre)
    return out


def sweep(
    stack: Stack,
    sketches: SketchSource,
    work: np.dtype,
    *,
    cutoff: float,
    truncate_to: int | None,
    host_budget: int,
    scratch_dir: Path,
) -> list[np.ndarray]:
    """Contract and compress a stack in ket form with one SRC sweep.

    Parameters
    ----------
    stack : Stack
        At least three sites, validated.
    sketches : SketchSource
        The seeded test tensors; their size bounds the output bonds.
    work : numpy.dtype
        The dtype of the environments and the result.
    cutoff : float
        Relative singular-value cutoff: on the sketch, or in the final pass
        when ``truncate_to`` is set.
    truncate_to : int or None
        If set, truncate to this bond by a final left-to-right SVD pass.
    host_budget : int
        Bytes of host memory for the working set and the environments.
    scratch_dir : pathlib.Path
        Where environments beyond the budget are written.

    Returns
    -------
    list of numpy.ndarray
        Padded ``(l, r, u, d)`` output cores, right-canonical, or
        left-canonical when ``truncate_to`` is set.
    """
    plan = make_plan(stack, sketches.size, work, host_budget)
    logger.debug(
        "SRC plan: sites=%d, layers=%d, sketch=%d, dtype=%s, env batch=%d, "
        "projected rows per block=%d, environments=%d B (in memory up to %d B), "
        "working set=%d B",
        stack.n_sites,
        len(stack.layers),
        sketches.size,
        work,
        plan.env_batch,
        plan.proj_batch,
        plan.env_bytes,
        plan.store_budget,
        plan.work_bytes,
    )
    with EnvironmentStore(plan.store_budget, scratch_dir) as store:
        start = perf_counter()
        _left_to_right(stack, sketches, work, plan, store)
        middle = perf_counter()
        logger.debug("left-to-right pass: %.3f s", middle - start)
        if store.spilled_bytes:
            logger.debug("environments on disk: %d B", store.spilled_bytes)
        cutoff_here = 0.0 if truncate_to else cutoff
        cores = _right_to_left(stack, sketches.size, work, cutoff_here, plan, store)
        logger.debug("right-to-left pass: %.3f s", perf_counter() - middle)
    if truncate_to is not None:
        start = perf_counter()
        cores = truncate(cores, truncate_to, cutoff)
        logger.debug("truncation pass: %.3f s", perf_counter() - start)
    return cores
