"""Input sites for one pass: read ahead on the host, uploaded to every rank.

Rank 0 reads the sites of a pass in order, the next one in a background
thread while the current one computes (a memmap, HDF5 or zarr site is read
from its file there, converted to the work dtype and, on a single GPU, staged
into page-locked memory, checked for NaN on the way, and copied to the device
on a side stream). Sites the plan keeps on the device between the passes
(``resident``) are not read again. With several ranks the cores are cut into
one flat slice per rank, each rank uploads its slice, and an allgather over
the group (peer copies between GPUs) puts the whole site on every rank; GPUs
without peer access upload the whole site each instead.

::

    disk --read (thread)--> host cores --slice r--> rank r --allgather--> cores on r
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from math import prod
from time import perf_counter
from typing import Any

import numpy as np

from .backend import Array, Backend, TorchBackend
from .comm import Context
from .trains import Stack

__all__ = ["read_site", "site_feed"]

logger = logging.getLogger(__name__)


def read_site(stack: Stack, j: int, work: np.dtype, check: bool = True) -> list[np.ndarray]:
    """Site ``j`` of every layer on the host, in the work dtype, C-contiguous."""
    # One dtype for every operand keeps the products on their BLAS path.
    return [np.ascontiguousarray(core, dtype=work) for core in stack.read(j, check)]


def _prefetched(
    stack: Stack,
    order: Sequence[int],
    work: np.dtype,
    xp: Backend,
    upload: bool,
    checked: Container[int],
) -> Iterator[tuple[int, Any]]:
    """``(j, cores)`` in ``order``, the next site read (and uploaded) in a thread."""
    if not order:
        return

    staged = upload and isinstance(xp, TorchBackend) and xp.device.is_cuda
    busy = 0.0  # the reading thread's time

    def load(j: int) -> Any:
        nonlocal busy
        start = perf_counter()
        if not staged:
            cores = read_site(stack, j, work, check=j not in checked)
        else:
            # The NaN check rides on the staging copy (`copy_parallel`); a site
            # that fails it is read again with the full check, which says where.
            check = j not in checked
            cores = [xp.upload_async(c, check) for c in read_site(stack, j, work, check=False)]
            if not all(finite for _t, _token, finite in cores):
                stack.read(j, check=True)
            cores = [(t, token) for t, token, _finite in cores]
        busy += perf_counter() - start
        return cores

    waited = 0.0  # the sweep's time blocked on a site not yet read (and staged)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sexpgpu-tn-read") as pool:
            pending: Future[Any] = pool.submit(load, order[0])
            for i, j in enumerate(order):
                start = perf_counter()
                ready = pending.result()
                waited += perf_counter() - start
                if i + 1 < len(order):
                    pending = pool.submit(load, order[i + 1])
                yield j, ready
                del ready
    finally:
        logger.debug(
            "%d sites read: %.3f s in the reading thread, the sweep waited %.3f s for them",
            len(order),
            busy,
            waited,
        )


def site_feed(
    ctx: Context,
    xp: Backend,
    stack: Stack,
    order: Sequence[int],
    work: np.dtype,
    checked: Container[int] = (),
    resident: dict[int, list[Array]] | None = None,
) -> Iterator[tuple[int, list[Array]]]:
    """Yield ``(j, cores)`` for the sites in ``order``, the cores on this rank's device.

    Every rank of ``ctx`` iterates the same order; only rank 0 reads. Sites in
    ``checked`` were checked for NaN and infinities by an earlier pass; sites
    in ``resident`` (the same on every rank) are handed out from it, and
    dropped from it, without a read or a collective.
    """
    single = ctx.size == 1
    kept = resident if resident is not None else {}
    to_read = [j for j in order if j not in kept]
    source = _prefetched(stack, to_read, work, xp, single, checked) if ctx.rank == 0 else None
    try:
        for j in order:
            if j in kept:
                yield j, kept.pop(j)
                continue
            host = None
            if source is not None:
                got, host = next(source)
                assert got == j
            if single:
                yield j, _on_device(xp, host)
            else:
                yield j, _distribute(ctx, xp, stack, j, work, host)
    finally:
        if source is not None:
            source.close()  # stops the read-ahead thread


def _on_device(xp: Backend, cores: list[Any]) -> list[Array]:
    """Cores read by `_prefetched` as arrays of the device."""
    if cores and isinstance(cores[0], tuple):  # started by upload_async
        assert isinstance(xp, TorchBackend)
        return [xp.wait(token, tensor) for tensor, token in cores]
    return [xp.upload(c) for c in cores]


def _distribute(
    ctx: Context, xp: Backend, stack: Stack, j: int, work: np.dtype, host: list[np.ndarray] | None
) -> list[Array]:
    """Whole cores on every rank: slices uploaded by their rank, then an allgather."""
    shapes = stack.shapes(j)
    if not _peer_access(ctx, xp):
        cores = ctx.broadcast(host, root=0)
        return [xp.upload(c) for c in cores]
    chunks = None
    if ctx.rank == 0:
        assert host is not None
        flat = [c.reshape(-1) for c in host]
        chunks = [
            [f[lo:hi] for f, (lo, hi) in zip(flat, _cuts(shapes, r, ctx.size), strict=True)]
            for r in range(ctx.size)
        ]
    mine = ctx.scatter(chunks, root=0)
    uploaded = [xp.upload(np.ascontiguousarray(c)) for c in mine]
    everyone = ctx.allgather(uploaded)
    return [
        xp.concat([parts[i] for parts in everyone]).reshape(shape) for i, shape in enumerate(shapes)
    ]


def _cuts(shapes: Sequence[tuple[int, ...]], rank: int, size: int) -> list[tuple[int, int]]:
    """Rank ``rank``'s flat slice of each core: contiguous, sizes differing by one at most."""
    cuts = []
    for shape in shapes:
        n = prod(shape)
        base, extra = divmod(n, size)
        lo = rank * base + min(rank, extra)
        cuts.append((lo, lo + base + (1 if rank < extra else 0)))
    return cuts


def _peer_access(ctx: Context, xp: Backend) -> bool:
    """Whether this rank can read every other rank's device memory directly."""
    if not xp.device.is_cuda:
        return True  # simulated ranks share the host
    import torch

    others = {d.index for d in ctx.devices if d.is_cuda and d.index != xp.device.index}
    return all(torch.cuda.can_device_access_peer(xp.device.index, o) for o in others)
