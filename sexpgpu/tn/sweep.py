"""The SRC sweep of one rank over a stack in ket form (Camaño, Epperly and Tropp,
arXiv:2504.06475).

Left to right, the sketched left environments are built and stored::

    C_0 = 1,   C_{j+1} = C_j . cores_j . omega_j        (s columns, Khatri-Rao)

Right to left, each output core is an orthonormal basis of the sketch of the
part of the network right of the cut, and the projected environment ``S``
carries the compressed right part::

    Z_j = cores_j . S_{j+1}          (e, u, d, l..)
    Y_j = Z_j C_j^T                  (e u d, s)       the sketch
    Q_j = qr(Y_j)                    output core j = Q_j^T as (c, e, u, d)
                                     (CholeskyQR2 on PyTorch, checked; see `basis`)
    S_j = conj(core_j) Z_j           (c, l..)

and the first core is ``Z_0`` itself. The result is right-canonical. Where the
basis would span every row of ``Z_j`` (without a cutoff it has ``min(e u d, s,
cap)`` columns), any unitary serves: the core is the identity and ``S_j =
Z_j``, with no sketch, QR or projection, and no ``C_j`` (the last sites).

Where the plan has room (`Plan.resident`), the left-to-right pass keeps a
site's cores on the device for the right-to-left pass, which then neither
reads nor uploads it again. Output cores go to the sink from a thread of its
own (`CoreWriter`), so the host's copies overlap the device's next site.

Several ranks split the ``s`` sketch columns into contiguous blocks. The
left-to-right pass needs no communication: rank r builds the columns of its
block. Per site of the right-to-left pass the sketch ``Y_j`` is gathered on
rank 0 for the QR, the rows of ``Q_j^H`` are scattered, and the projected
environment is gathered on every rank::

    rank r:  Y_j[:, block r] = Z_j C_j[block r]^T  --gather-->  rank 0: Q_j = qr(Y_j)
    rank 0:  Q_j^H by rows   --scatter-->  rank r: S_j[rows r] = Q_j^H[rows r] Z_j
    rank r:  S_j[rows r]     --allgather-->  S_j on every rank

Rank 0 alone decides each bond (``cutoff``), so every rank agrees on it. Each
product runs in tiles fixed by the plan; a tile that runs out of memory is
computed in halves through `sexpgpu.runtime.oom.run_with_split`, and the split
is kept for the rest of the sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from time import perf_counter

import numpy as np

from sexpgpu.runtime.oom import SplitState, add_up, run_with_split

from .backend import Array, Backend
from .comm import Context
from .contractions import env_step, right_block, right_columns
from .feed import site_feed
from .plan import Plan, column_blocks, row_blocks
from .sink import CoreSink, CoreWriter
from .sketch import SharedSketches
from .store import EnvironmentStore
from .trains import Stack

__all__ = ["RankReport", "SweepJob", "basis", "sweep_rank"]

logger = logging.getLogger(__name__)


@dataclass
class SweepJob:
    """Everything one sweep shares between its ranks.

    Attributes
    ----------
    stack : Stack
        At least three sites, validated.
    sketches : SharedSketches
        The seeded test tensors.
    work : numpy.dtype
        The dtype of the environments and the result.
    cutoff : float
        Relative singular-value cutoff of each sketch's basis (0 when a final
        truncation pass follows).
    plan : Plan
        Tiles, blocks and tiers.
    scratch_dir : pathlib.Path
        Where environments on disk go.
    sink : CoreSink
        Receives the output cores (rank 0 writes).
    """

    stack: Stack
    sketches: SharedSketches
    work: np.dtype
    cutoff: float
    plan: Plan
    scratch_dir: Path
    sink: CoreSink


@dataclass
class RankReport:
    """What a rank measured: its peaks, by place."""

    device_peak: int | None = None
    store_peak: dict[str, int] = field(default_factory=dict)
    splits: list[str] = field(default_factory=list)


def sweep_rank(ctx: Context, xp: Backend, job: SweepJob) -> RankReport:
    """Run both passes of one rank; rank 0 writes the right-canonical cores to the sink."""
    xp.reset_peak()
    env_state, row_state = SplitState(), SplitState()
    tiers = job.plan.tiers[ctx.rank]
    resident: dict[int, list[Array]] = {}  # cores kept for the right-to-left pass
    with EnvironmentStore(xp, tiers, job.scratch_dir, ctx.rank) as store:
        start = perf_counter()
        _left_to_right(ctx, xp, job, store, env_state, resident)
        xp.synchronize()
        middle = perf_counter()
        logger.debug("rank %d: left-to-right pass: %.3f s", ctx.rank, middle - start)
        _right_to_left(ctx, xp, job, store, row_state, resident)
        xp.synchronize()
        logger.debug("rank %d: right-to-left pass: %.3f s", ctx.rank, perf_counter() - middle)
        peaks = dict(store.peak)
    return RankReport(xp.device_peak(), peaks, env_state.events + row_state.events)


def _left_to_right(
    ctx: Context,
    xp: Backend,
    job: SweepJob,
    store: EnvironmentStore,
    state: SplitState,
    resident: dict[int, list[Array]],
) -> None:
    """Build and store this rank's columns of ``C_1 .. C_{n-1}``; keep the resident cores."""
    stack, plan = job.stack, job.plan
    lo, _hi = plan.blocks[ctx.rank]
    read = _columns_read(job, ctx.rank)
    k = len(stack.layers)
    env = xp.ones((read[1],) + (1,) * k, job.work)
    # No result leaves the device before the pass ends: its NaN checks are read then.
    feed = site_feed(ctx, xp, stack, range(stack.n_sites - 1), job.work, defer_checks=True)
    for j, cores in feed:
        up, down = cores[0].shape[2], cores[-1].shape[3]
        # C_{j+1}'s columns that a right-to-left site reads; each column is its own chain
        cols = read[j + 1]
        env = env[:cols]
        omega = job.sketches.take(j, up, down)[lo : lo + cols]
        if j in plan.resident:
            resident[j] = cores
        if cols == 0:  # no site from j + 1 on reads C_{j+1}: each keeps its whole space
            continue
        omega = xp.upload(np.ascontiguousarray(omega, dtype=job.work), non_blocking=True)

        def per_piece(piece: tuple[Array, Array], cores: list[Array] = cores) -> Array:
            return env_step(xp, piece[0], piece[1], cores)

        blocks = row_blocks(cols, plan.env_tile)
        out = None if len(blocks) == 1 else xp.empty((cols, *(c.shape[1] for c in cores)), job.work)
        for a, b in blocks:
            part = run_with_split(
                per_piece,
                (env[a:b], omega[a:b]),
                state,
                xp.concat,
                what=f"site {j}'s left-to-right product",
            )
            if out is None:  # one block: it is the environment, uncopied
                out = part
            else:
                xp.copy_into(out[a:b], part)
            del part
        env = out
        store.put(j + 1, env)
        del cores, omega, per_piece
        logger.debug("rank %d: left-to-right: site %d of %d", ctx.rank, j + 1, stack.n_sites - 1)


def _columns_read(job: SweepJob, rank: int) -> list[int]:
    """How many of this rank's columns of each ``C_j`` the right-to-left pass reads.

    Site ``j`` reads the first `_sketch_width` columns of ``C_j``, none where
    it keeps its whole space (`_keeps_whole_space`), and column ``c`` of
    ``C_{j+1}`` is made from column ``c`` of ``C_j`` alone (the Khatri-Rao
    sketch), so ``C_j`` needs the widest of the widths of sites ``j`` to
    ``n - 1``: none for the last sites, which keep their whole space, and
    fewer than the sketch where only cuts of thin bonds are left. Index ``j``
    for ``C_j``; index 0 is unused.
    """
    stack, size = job.stack, job.sketches.size
    caps, n = stack.cut_ranks, stack.n_sites
    read = [0] * n
    widest, bond = 0, 1  # the bond right of site j, as the right-to-left pass leaves it
    for j in range(n - 1, 0, -1):
        shapes = stack.shapes(j)
        rows = bond * shapes[0][2] * shapes[-1][3]
        if not _keeps_whole_space(job, rows, caps[j - 1]):
            widest = max(widest, _sketch_width(job, rank, caps[j - 1]))
        read[j] = widest
        bond = min(rows, size, caps[j - 1])  # the basis's width without a cutoff
    return read


def _keeps_whole_space(job: SweepJob, rows: int, cap: int) -> bool:
    """Whether a right-to-left site's basis is its whole space, ``rows`` wide.

    Without a cutoff the basis has ``min(rows, s, cap)`` columns; where that
    is ``rows``, it spans every row of ``Z`` (a square unitary, whatever the
    sketch), so the site needs no sketch, QR or projection: the identity is
    the basis and ``Z`` is the projected environment. The last sites of a
    sweep (their bonds toward the right end, times the physical legs, are
    within the sketch and the cut ranks) are such sites.
    """
    return job.cutoff <= 0 and rows <= min(job.sketches.size, cap)


def _sketch_width(job: SweepJob, rank: int, cap: int) -> int:
    """How many of this rank's sketch columns the right-to-left site uses.

    The sketch has rank at most ``cap`` (the cut's rank bound), and the first
    ``cap`` Gaussian columns already span its range, so where ``cap`` is below
    the sketch size only those are used: their QR is the basis, with no SVD
    (on a GPU, cuSOLVER's Jacobi SVD of ``R`` cost more than the rest of the
    sweep). A ``cutoff`` reads the singular values of the whole sketch, so
    then every column is used.
    """
    lo, hi = job.plan.blocks[rank]
    if job.cutoff <= 0:
        hi = max(lo, min(hi, cap))
    return hi - lo


def basis(
    xp: Backend, sketch: Array, cutoff: float, cap: int, exact: bool = False
) -> tuple[Array, Array | None]:
    """An orthonormal basis of the sketch's range, cut at ``cutoff * sigma_max``.

    ``cap`` bounds the rank the sketch can have (the bond left of the cut); a
    basis wider than that would only span rounding noise. The QR is
    `Backend.gemm_qr` (CholeskyQR2 on PyTorch), or Householder's when
    ``exact``. Returns the basis and a device flag, set when the GEMM QR
    failed: the caller reads it (`Backend.flag`) once the next work is
    queued, and on failure calls again with ``exact``.
    """
    narrow = cutoff <= 0 and cap >= min(sketch.shape)
    if exact:
        (q, r), failed = xp.qr(sketch), None
    else:
        q, r, failed = xp.gemm_qr(sketch, with_r=not narrow)
    if narrow:
        return q, failed
    if xp.flag(failed)():  # read now: the SVD below waits for the device anyway
        q, r = xp.qr(sketch)
    u, sv, _ = xp.svd(r)
    rank = min(cap, sv.size)
    if cutoff > 0:
        rank = min(rank, max(1, int(np.count_nonzero(sv >= cutoff * sv[0]))))
    return xp.dot(q, xp.contiguous(u[:, :rank])), None


def _right_to_left(
    ctx: Context,
    xp: Backend,
    job: SweepJob,
    store: EnvironmentStore,
    state: SplitState,
    resident: dict[int, list[Array]],
) -> None:
    """Build the output cores from the last site down; rank 0 sinks them."""
    stack, k = job.stack, len(job.stack.layers)
    proj = xp.ones((1,) * (k + 1), job.work)
    caps = stack.cut_ranks
    read = _columns_read(job, ctx.rank)
    order = range(stack.n_sites - 1, -1, -1)
    checks = [0.0]  # seconds spent reading the QR's flags
    # Each output core is copied to the host on a side stream while the next
    # site computes, and sunk by the writer's thread: the GPU never waits for
    # the host's copies.
    with CoreWriter(job.sink, staged=not xp.is_host) as writer:
        # the left-to-right pass checked every site but the last
        feed = site_feed(ctx, xp, stack, order, job.work, range(stack.n_sites - 1), resident)
        for j, cores in feed:  # run to its end, so the reading thread's log comes
            if j == 0:
                if ctx.rank == 0:
                    z = right_block(xp, proj, cores)
                    writer.put(0, xp.download(z.reshape(1, *z.shape[:3])))  # (1, e, u, d)
                continue
            stored = read[j] > 0  # whether the first pass made C_j (`_columns_read`)
            proj, core = _rtl_step(
                ctx, xp, job, store, state, j, cores, proj, caps[j - 1], stored, checks
            )
            del cores
            if core is not None:
                writer.put(j, core)
    logger.debug("rank %d: the QR checks waited %.3f s for the device", ctx.rank, checks[0])


def _rtl_step(
    ctx: Context,
    xp: Backend,
    job: SweepJob,
    store: EnvironmentStore,
    state: SplitState,
    j: int,
    cores: list[Array],
    proj: Array,
    cap: int,
    stored: bool,
    checks: list[float],
) -> tuple[Array, Callable[[], np.ndarray] | None]:
    """One site of the right-to-left pass.

    Returns the next projected environment, and on rank 0 the output core's
    download (`Backend.download`). ``stored``: whether the store holds this
    rank's ``C_j`` (none where no site from ``j`` on reads a column of it).
    ``checks[0]`` adds up the time spent reading the QR's flag.
    """
    plan = job.plan
    # Z's left legs in the order its last product makes them; C_j's columns to match
    columns = right_columns(xp, proj, cores)
    e, lefts = proj.shape[0], [c.shape[0] for c in cores]
    up, down = cores[0].shape[2], cores[-1].shape[3]
    ud = up * down
    blocks = row_blocks(e, plan.row_tile)

    def z_of(rows: Array) -> Array:  # (b, r..) -> (b u d, l..)
        z = right_block(xp, rows, cores, columns)
        return z.reshape(z.shape[0] * ud, -1)

    what = f"site {j}'s right-to-left product"
    env = store.take(j) if stored else xp.empty((0, *lefts), job.work)
    if _keeps_whole_space(job, e * ud, cap):
        # The basis is the identity, the core one; Z is S_j: no sketch, QR or projection.
        pieces = [run_with_split(z_of, proj[a:b], state, xp.concat, what=what) for a, b in blocks]
        z = xp.concat(pieces)  # (e u d, l..)
        download = None
        if ctx.rank == 0:
            eye = np.eye(e * ud, dtype=job.work).reshape(e * ud, e, up, down)  # (c, e, u, d)
            download = xp.download(xp.upload(eye))
        logger.debug("rank %d: right-to-left: site %d, its whole space", ctx.rank, j)
        return _left_legs_in_order(xp, z, lefts, columns), download
    env = env[: _sketch_width(job, ctx.rank, cap)]
    if columns != tuple(range(len(cores))):
        env = xp.contiguous(xp.permute(env, (0, *(1 + i for i in columns))))
    env_t = xp.permute(env.reshape(env.shape[0], prod(env.shape[1:])), (1, 0))  # (l.., s_r)
    held, parts = [], []
    for a, b in blocks:
        if plan.hold_z:
            held.append(run_with_split(z_of, proj[a:b], state, xp.concat, what=what))
            parts.append(xp.dot(held[-1], env_t))
        else:

            def y_of(rows: Array) -> Array:
                return xp.dot(z_of(rows), env_t)

            parts.append(run_with_split(y_of, proj[a:b], state, xp.concat, what=what))
    y_mine = xp.concat(parts)  # (e u d, s_r)
    del parts
    sketches = ctx.gather(y_mine, root=0)
    del y_mine
    sketch = xp.concat(sketches, axis=1) if ctx.rank == 0 else None  # (e u d, s)
    del sketches

    def finish(exact: bool) -> tuple[Array, Callable[[], np.ndarray] | None, Callable[[], bool]]:
        """The basis, its output core's download, ``S_j`` on every rank, the QR's check."""
        download, failed, chunks = None, xp.flag(None), None
        if ctx.rank == 0:
            q, flag = basis(xp, sketch, job.cutoff, cap, exact)  # (e u d, c)
            failed = xp.flag(flag)  # its copy to the host is queued before the projection
            core = xp.contiguous(xp.permute(q, (1, 0))).reshape(-1, e, up, down)  # (c, e, u, d)
            download = xp.download(core)
            qh = xp.adjoint(q)  # (c, e u d)
            chunks = [qh[lo:hi] for lo, hi in column_blocks(qh.shape[0], ctx.size)]
            del q, core, qh
        qh_mine = ctx.scatter(chunks, root=0)  # (c_r, e u d)
        mine = _project(xp, job, state, qh_mine, proj, held, blocks, ud, z_of, what)
        return xp.concat(ctx.allgather(mine)), download, failed  # (c, l..)

    full, download, failed = finish(exact=False)
    # Read with the projection queued behind the QR, so the device keeps busy
    # while the host waits (and the host has nothing else to do: the writer
    # and the reader are threads of their own); rank 0 decides for every rank.
    start = perf_counter()
    bad = failed() if ctx.rank == 0 else None
    checks[0] += perf_counter() - start
    if ctx.broadcast(bad, root=0):
        logger.debug("rank %d: site %d: CholeskyQR2 failed; Householder QR", ctx.rank, j)
        if download is not None:
            download()  # the discarded core's copy is done before its buffer goes
        full, download, _ = finish(exact=True)
    logger.debug("rank %d: right-to-left: site %d, bond %d", ctx.rank, j, full.shape[0])
    return _left_legs_in_order(xp, full, lefts, columns), download


def _left_legs_in_order(
    xp: Backend, full: Array, lefts: list[int], columns: tuple[int, ...]
) -> Array:
    """``S_j`` as ``(c, l_0, .., l_{k-1})``, a view of ``full`` ``(c, l..)`` in Z's column order."""
    full = full.reshape(-1, *(lefts[i] for i in columns))
    return xp.permute(full, (0, *(1 + columns.index(i) for i in range(len(columns)))))


def _project(
    xp: Backend,
    job: SweepJob,
    state: SplitState,
    qh: Array,
    proj: Array,
    held: list[Array],
    blocks: list[tuple[int, int]],
    ud: int,
    z_of: Callable[[Array], Array],
    what: str,
) -> Array:
    """``S_j[rows] = Q^H[rows] Z``, block by block of ``Z``'s rows, summed in order."""
    total = None
    for i, (a, b) in enumerate(blocks):
        q_block = xp.contiguous(qh[:, a * ud : b * ud])  # (c_r, (b-a) u d)
        if held:
            part = xp.dot(q_block, held[i])
        else:
            # (b-a, c_r, u d): the block's rows first, so the split can cut them.
            q_rows = xp.permute(q_block.reshape(qh.shape[0], b - a, ud), (1, 0, 2))

            def per_piece(piece: tuple[Array, Array]) -> Array:
                rows, q_piece = piece
                n = rows.shape[0]
                qm = xp.contiguous(xp.permute(q_piece, (1, 0, 2))).reshape(-1, n * ud)
                return xp.dot(qm, z_of(rows))

            part = run_with_split(per_piece, (proj[a:b], q_rows), state, add_up, what=what)
        total = part if total is None else total + part
    assert total is not None
    return total
