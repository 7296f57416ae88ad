"""`DeviceGroup`: one thread per device, collectives between them, abort on failure.

::

    group = DeviceGroup(["cuda:0", "cuda:1"])      # or ["cpu:0", "cpu:1"]
    results = group.run(step)                      # step(ctx) on one thread per rank
    # inside step: ctx.all_reduce(grads), ctx.broadcast(params, root=0), ...
    #              ctx.reduce_scatter([chunk for each rank]), ctx.allgather(x)

Every collective is a rendezvous of all ranks at a barrier: each rank puts its
value in its slot, waits for the others, takes what it needs (copied onto its
own device), and waits again so that no slot is reused while it is read.
Simulated ``cpu:N`` ranks copy NumPy arrays; GPU ranks copy tensors between
devices with PyTorch, synchronizing their streams around the copies. Sums are
taken on the root in rank order, so a result never depends on thread timing.

A rank that raises aborts the group: ranks waiting at a barrier, or arriving
at one later, raise `GroupAborted` naming the failed rank, and `run` raises the
original error. A rank that waits longer than the timeout raises `GroupTimeout`
naming the ranks that never came.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sexpgpu.runtime.devices import Device, parse_device
from sexpgpu.runtime.transfer import accumulate, copy_to, read_on, ready, settle

if TYPE_CHECKING:
    pass

__all__ = [
    "CollectiveMismatch",
    "DeviceGroup",
    "GroupAborted",
    "GroupTimeout",
    "RankContext",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Long enough for a slow step between collectives; tests pass a short one.
DEFAULT_TIMEOUT = 600.0


class GroupAborted(RuntimeError):
    """Raised on a rank because another rank failed: it stops instead of waiting.

    Attributes
    ----------
    failed_rank
        The rank whose error aborted the group (None: the caller's thread).
    """

    def __init__(self, message: str, failed_rank: int | None = None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank


class GroupTimeout(GroupAborted):
    """A rank waited at a collective longer than the group's timeout.

    Attributes
    ----------
    missing
        The ranks that had not arrived.
    """

    def __init__(self, message: str, missing: tuple[int, ...]) -> None:
        super().__init__(message, None)
        self.missing = missing


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives, or one returned while others wait."""


class _Session:
    """The shared state of one `DeviceGroup.run`: barrier, slots, failure."""

    def __init__(self, devices: tuple[Device, ...], timeout: float) -> None:
        self.devices = devices
        self.size = len(devices)
        self.timeout = timeout
        self.barrier = threading.Barrier(self.size)
        self.lock = threading.Condition()
        self.slots: list[Any] = [None] * self.size
        self.product: Any = None
        self.entered = [0] * self.size  # collectives begun, per rank
        self.waits = [0] * self.size  # barrier waits begun, per rank
        self.finished: list[int | None] = [None] * self.size
        self.done = 0
        self.failure: tuple[int | None, BaseException] | None = None

    def fail(self, rank: int | None, exc: BaseException) -> None:
        """Record the group's first failure and release every waiting rank."""
        with self.lock:
            if self.failure is None:
                self.failure = (rank, exc)
                log.debug("rank %s failed: %r; aborting the group", rank, exc)
            self.lock.notify_all()
        self.barrier.abort()

    def aborted_error(self) -> GroupAborted:
        assert self.failure is not None
        rank, exc = self.failure
        if isinstance(exc, GroupTimeout):
            return GroupAborted(f"the device group timed out: {exc}", rank)
        who = "the caller" if rank is None else f"rank {rank} ({self.devices[rank]})"
        return GroupAborted(f"{who} failed with {type(exc).__name__}: {exc}", rank)

    def enter(self, rank: int, op: str) -> int:
        """Count a collective begun by `rank`; fail on a mismatch with a finished rank."""
        with self.lock:
            if self.failure is not None:
                raise self.aborted_error()
            self.entered[rank] += 1
            seq = self.entered[rank]
            gone = [r for r, count in enumerate(self.finished) if count is not None and count < seq]
        if gone:
            err = CollectiveMismatch(
                f"rank {rank} called {op} (collective {seq}), but rank {gone[0]} returned "
                f"after {self.finished[gone[0]]} collectives: every rank must call the "
                "same collectives in the same order"
            )
            self.fail(rank, err)
            raise err
        return seq

    def finish(self, rank: int) -> None:
        """Mark `rank` returned; ranks waiting for a collective it never joins fail."""
        with self.lock:
            count = self.entered[rank]
            self.finished[rank] = count
            self.done += 1
            waiting = [r for r in range(self.size) if self.entered[r] > count]
            self.lock.notify_all()
        if waiting:
            self.fail(
                rank,
                CollectiveMismatch(
                    f"rank {rank} returned after {count} collectives, but rank {waiting[0]} "
                    f"called collective {count + 1}: every rank must call the same "
                    "collectives in the same order"
                ),
            )

    def wait(self, rank: int, op: str) -> None:
        """The barrier, bounded by the timeout and broken by a failure."""
        with self.lock:
            self.waits[rank] += 1
            mine = self.waits[rank]
        try:
            self.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            with self.lock:
                failure = self.failure
                missing = tuple(r for r in range(self.size) if self.waits[r] < mine)
            if failure is not None:
                raise self.aborted_error() from None
            err = GroupTimeout(
                f"rank {rank} waited {self.timeout:g} s in {op} for rank(s) "
                f"{', '.join(map(str, missing)) or '?'}, which never arrived",
                missing,
            )
            self.fail(rank, err)
            raise err from None


class RankContext:
    """What `fn` gets on each rank of `DeviceGroup.run`: its rank and the collectives.

    Every rank must call the same collectives in the same order. Values are
    arrays, tensors, numbers, or lists, tuples and dicts of them; results are
    copies on this rank's device.
    """

    def __init__(self, session: _Session, rank: int) -> None:
        self._session = session
        self.rank = rank
        self.size = session.size
        self.device: Device = session.devices[rank]

    def __repr__(self) -> str:
        return f"RankContext(rank={self.rank}, size={self.size}, device={self.device})"

    @property
    def aborted(self) -> bool:
        """Whether another rank failed; long work between collectives may poll it."""
        return self._session.failure is not None

    def check(self) -> None:
        """Raise `GroupAborted` now if another rank failed."""
        if self.aborted:
            raise self._session.aborted_error()

    def barrier(self) -> None:
        """Wait until every rank is here."""
        self._exchange("barrier", 0, None)
        settle(self.device)  # a barrier also orders the device's queued work before the others'
        self._depart("barrier")

    def all_reduce(self, x: T) -> T:
        """The sum of every rank's `x`, taken in rank order on rank 0; on every rank."""
        values = self._exchange("all_reduce", 0, x)
        s = self._session
        if self.rank == 0:
            total = copy_to(values[0], self.device)  # owned: summed into in place
            for value in values[1:]:
                total = accumulate(total, read_on(value, self.device))
            ready(total, self.device)
            s.product = total
        s.wait(self.rank, "all_reduce")
        result = s.product if self.rank == 0 else copy_to(s.product, self.device)
        self._depart("all_reduce", result)
        return result

    def reduce_scatter(self, chunks: Sequence[T]) -> T:
        """The sum over every rank of its ``chunks[r]``, on rank r (one chunk per rank).

        Each rank sums its own chunk in rank order, as `all_reduce` sums: the
        same bits as that chunk of an all-reduce.
        """
        if len(chunks) != self.size:
            raise ValueError(f"reduce_scatter needs {self.size} chunks, got {len(chunks)}")
        values = self._exchange("reduce_scatter", 0, list(chunks))
        total = copy_to(values[0][self.rank], self.device)  # owned: summed into in place
        for value in values[1:]:
            total = accumulate(total, read_on(value[self.rank], self.device))
        self._depart("reduce_scatter", total)
        return total

    def broadcast(self, x: T | None, root: int = 0) -> T:
        """Rank `root`'s `x`, on every rank (other ranks' `x` is ignored)."""
        values = self._exchange("broadcast", root, x)
        result = copy_to(values[root], self.device)
        self._depart("broadcast", result)
        return result

    def allgather(self, x: T) -> list[T]:
        """Every rank's `x`, in rank order, on every rank."""
        values = self._exchange("allgather", 0, x)
        result = [copy_to(value, self.device) for value in values]
        self._depart("allgather", result)
        return result

    def gather(self, x: T, root: int = 0) -> list[T] | None:
        """Every rank's `x` in rank order on rank `root`; None on the others."""
        values = self._exchange("gather", root, x)
        result = [copy_to(v, self.device) for v in values] if self.rank == root else None
        self._depart("gather", result)
        return result

    def scatter(self, chunks: Sequence[T] | None, root: int = 0) -> T:
        """Chunk ``chunks[r]`` of rank `root` on each rank r (others pass None)."""
        if self.rank == root and (chunks is None or len(chunks) != self.size):
            got = "None" if chunks is None else f"{len(chunks)} chunks"
            raise ValueError(f"scatter on root {root} needs {self.size} chunks, got {got}")
        values = self._exchange("scatter", root, list(chunks) if self.rank == root else None)
        result = copy_to(values[root][self.rank], self.device)
        self._depart("scatter", result)
        return result

    def share(self, x: T) -> list[T]:
        """Every rank's `x` itself, in rank order, on every rank: references, not copies.

        For collectives of a library that works on every rank's buffers at once
        from one thread (NCCL within one process): the ranks share one process,
        so each can name the others' tensors. Whoever changes them must order
        its work before the ranks read them again (`barrier`).
        """
        values = self._exchange("share", 0, x)
        self._depart("share", values)
        return list(values)

    def _exchange(self, op: str, root: int, value: Any) -> list[Any]:
        """Put `value` in this rank's slot, wait for all, return every rank's value."""
        s = self._session
        if not 0 <= root < self.size:
            raise ValueError(f"{op}: root {root} is not a rank of a group of {self.size}")
        seq = s.enter(self.rank, op)
        ready(value, self.device)
        s.slots[self.rank] = (op, root, value)
        s.wait(self.rank, op)
        calls = {(entry[0], entry[1]) for entry in s.slots}
        if len(calls) > 1:
            named = ", ".join(f"rank {r}: {e[0]}(root={e[1]})" for r, e in enumerate(s.slots))
            err = CollectiveMismatch(f"collective {seq} differs between ranks ({named})")
            s.fail(self.rank, err)
            raise err
        return [entry[2] for entry in s.slots]

    def _depart(self, op: str, copied: Any = None) -> None:
        """Leave collective `op` once `copied` (this rank's result) is on its device.

        Copies onto this device must land before any rank reuses its slot; a
        result of host values moved nothing, so the work queued on the device
        goes on (a rank's step is not held up by the numbers it exchanges).
        """
        ready(copied, self.device)
        self._session.wait(self.rank, op)


class DeviceGroup:
    """Devices that run one function together, a thread each, with collectives.

    Parameters
    ----------
    devices
        The ranks' devices in rank order: `Device` values or names such as
        ``"cuda:0"`` or ``"cpu:3"``. Simulated ``cpu`` ranks run the same code
        path as GPUs. A device may repeat (several ranks on one GPU, in tests).
    timeout
        Seconds a rank waits at a collective before the group times out.
    """

    def __init__(
        self, devices: Sequence[Device | str], *, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        if not devices:
            raise ValueError("a device group needs at least one device")
        self.devices: tuple[Device, ...] = tuple(parse_device(d) for d in devices)
        self.timeout = timeout

    @property
    def size(self) -> int:
        """How many ranks the group has."""
        return len(self.devices)

    def __repr__(self) -> str:
        return f"DeviceGroup([{', '.join(map(str, self.devices))}])"

    def run(self, fn: Callable[[RankContext], T]) -> list[T]:
        """Call ``fn(ctx)`` on one thread per rank; their results in rank order.

        Raises
        ------
        BaseException
            The first error any rank raised (with a note naming the rank);
            the other ranks stop at their next collective.
        GroupTimeout
            When a rank waited longer than the timeout for the others.
        """
        session = _Session(self.devices, self.timeout)
        results: list[Any] = [None] * self.size
        threads = [
            threading.Thread(
                target=self._rank_main,
                args=(session, rank, fn, results),
                name=f"sexpgpu-rank-{rank}",
                daemon=True,  # a rank stuck in user code must not keep Python alive
            )
            for rank in range(self.size)
        ]
        for thread in threads:
            thread.start()
        try:
            self._wait_for(session)
        except BaseException as exc:  # Ctrl-C in the caller: stop every rank
            session.fail(None, exc)
            raise
        if session.failure is not None:
            rank, exc = session.failure
            if rank is not None:
                exc.add_note(f"raised on rank {rank} ({self.devices[rank]}) of {self.size}")
            raise exc
        return results

    def _wait_for(self, session: _Session) -> None:
        with session.lock:
            session.lock.wait_for(lambda: session.done == self.size or session.failure)
            if session.failure is not None:
                # The others stop at their next collective; a rank stuck in its
                # own work is left behind after the timeout.
                session.lock.wait_for(lambda: session.done == self.size, self.timeout)

    def _rank_main(
        self, session: _Session, rank: int, fn: Callable[[RankContext], Any], results: list[Any]
    ) -> None:
        device = self.devices[rank]
        try:
            if device.is_cuda:
                import torch

                torch.cuda.set_device(device.index)
            results[rank] = fn(RankContext(session, rank))
        except BaseException as exc:
            session.fail(rank, exc)
        finally:
            session.finish(rank)
