"""Input sites for one pass: read ahead on the host, uploaded to every rank.

Rank 0 reads the sites of a pass in order, the next one in a background
thread while the current one computes (a memmap, HDF5 or zarr site is read
from its file there and converted to the work dtype; on a single GPU it is
staged into page-locked memory and copied to the device on a side stream, and
a sum behind the copy, on the device, checks it for NaN). Sites the plan keeps
on the device between the passes (``resident``) are not read again. With
several ranks the cores are cut into one flat slice per rank, each rank
uploads its slice, and an allgather over the group (peer copies between GPUs)
puts the whole site on every rank; GPUs without peer access upload the whole
site each instead.

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
    defer_checks: bool,
) -> Iterator[tuple[int, Any]]:
    """``(j, cores)`` in ``order``, the next site read (and uploaded) in a thread.

    On PyTorch (``upload``) a site is checked for NaN on the device (`_settle`):
    before it is handed out, or with ``defer_checks`` once, after the last site.
    """
    if not order:
        return

    staged = upload and isinstance(xp, TorchBackend)
    busy = 0.0  # the reading thread's time

    def load(j: int) -> tuple[Any, list[tuple[int, Any]]]:
        """Site ``j``'s cores, and its device sums to check (with their site)."""
        nonlocal busy
        start = perf_counter()
        check = j not in checked
        sums: list[tuple[int, Any]] = []
        if not staged:
            cores = read_site(stack, j, work, check)
        else:
            cores = []
            for core in read_site(stack, j, work, check=False):
                tensor, token, total = xp.upload_async(core, check)
                cores.append((tensor, token))
                if total is not None:
                    sums.append((j, total))
        busy += perf_counter() - start
        return cores, sums

    if not staged and xp.is_host and stack.in_memory:
        # Arrays in memory on a host backend: reading is a view or a cast, with
        # nothing to overlap; a thread's handoffs would cost more than the read.
        for j in order:
            yield j, load(j)[0]
        return
    waited = 0.0  # the sweep's time blocked on a site not yet read (and staged)
    unread: list[tuple[int, Any]] = []  # device sums not yet read (the main thread's)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sexpgpu-tn-read") as pool:
            pending: Future[Any] = pool.submit(load, order[0])
            for i, j in enumerate(order):
                start = perf_counter()
                ready, sums = pending.result()
                waited += perf_counter() - start
                if i + 1 < len(order):
                    pending = pool.submit(load, order[i + 1])
                unread += sums
                if not defer_checks:
                    _settle(xp, stack, unread)
                yield j, ready
                del ready
        _settle(xp, stack, unread)  # not reached when the sweep stops early (an error)
    finally:
        logger.debug(
            "%d sites read: %.3f s in the reading thread, the sweep waited %.3f s for them",
            len(order),
            busy,
            waited,
        )


def _settle(xp: Backend, stack: Stack, unread: list[tuple[int, Any]]) -> None:
    """Read the device sums of `TorchBackend.upload_async` (one copy) and forget them.

    A site whose sum is not finite is read again with the host's full check,
    which raises the error a host backend raises (`Layer.read`: the train,
    the site, the count); a finite site whose sum overflowed passes it.
    """
    if not unread:
        return
    assert isinstance(xp, TorchBackend)
    finite = xp.finite([total for _j, total in unread])
    bad = dict.fromkeys(j for (j, _total), ok in zip(unread, finite, strict=True) if not ok)
    unread.clear()  # the sites in the order read: the first bad one raises
    for j in bad:
        stack.read(j, check=True)


def site_feed(
    ctx: Context,
    xp: Backend,
    stack: Stack,
    order: Sequence[int],
    work: np.dtype,
    checked: Container[int] = (),
    resident: dict[int, list[Array]] | None = None,
    defer_checks: bool = False,
) -> Iterator[tuple[int, list[Array]]]:
    """Yield ``(j, cores)`` for the sites in ``order``, the cores on this rank's device.

    Every rank of ``ctx`` iterates the same order; only rank 0 reads. Sites in
    ``checked`` were checked for NaN and infinities by an earlier pass; sites
    in ``resident`` (the same on every rank) are handed out from it, and
    dropped from it, without a read or a collective.

    A site uploaded to a single PyTorch device is checked there: a sum behind
    its upload, read before the site is handed out, or with ``defer_checks``
    once, when the sweep asks for the site after the last (for a pass whose
    results stay on the device until it ends: the host never waits per site).
    Either way a bad site raises the host's error (`Layer.read`).
    """
    single = ctx.size == 1
    kept = resident if resident is not None else {}
    to_read = [j for j in order if j not in kept]
    source = None
    if ctx.rank == 0:
        source = _prefetched(stack, to_read, work, xp, single, checked, defer_checks)
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
        if source is not None:
            rest = next(source, None)  # runs the deferred checks
            assert rest is None
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
