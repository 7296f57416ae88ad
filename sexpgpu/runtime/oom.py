"""Surviving an allocation failure: release the caches, retry, split the batch.

`call_with_split` runs a training step: when an allocation fails it releases
the caches and retries, then computes each microbatch in halves (quarters...)
where the caller says the graph allows it, keeps that split for the run, and
ends in E-MEM-002 (the plan, what was asked, what was free, the fix) when
nothing more can be split.

`run_with_split` computes ``fn`` over a batch. When an allocation fails it
releases the caches and tries again; when it fails again it computes the batch
in halves (then quarters...), combining the pieces' results, and remembers the
split in a `SplitState` for the next call, so that a sweep or a run loop pays
for the failure once. A `FailureInjector`, passed explicitly to the code under
test, raises a simulated failure on chosen calls; it is a `MemoryError`, and
``torch.cuda.OutOfMemoryError`` and `MemoryError` are treated alike.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.devices import torch_if_loaded
from sexpgpu.runtime.transfer import add, is_tensor, tree_map

__all__ = [
    "FailureInjector",
    "SimulatedAllocationFailure",
    "SplitState",
    "add_up",
    "allocation_error",
    "call_with_retry",
    "call_with_split",
    "concat",
    "is_allocation_failure",
    "release_caches",
    "run_with_split",
    "without_frames",
]

log = logging.getLogger(__name__)

R = TypeVar("R")


class SimulatedAllocationFailure(MemoryError):
    """An allocation failure raised on purpose by a `FailureInjector`."""


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether `exc` says that memory ran out (host, GPU, or simulated)."""
    if isinstance(exc, MemoryError):
        return True
    torch = torch_if_loaded()
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    # Libraries below PyTorch (cuBLAS, cuDNN) report it as a RuntimeError.
    return isinstance(exc, RuntimeError) and (
        "out of memory" in str(exc).lower() or "ALLOC_FAILED" in str(exc)
    )


def without_frames(error: BaseException) -> BaseException:
    """`error` and the errors chained to it, stripped of their tracebacks.

    A traceback keeps the failed call's frames, and with them every array
    they allocated: stripped, those are freed once the handler ends, before
    a retry needs the memory.
    """
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return error


def release_caches() -> None:
    """Free what Python and PyTorch's GPU allocator hold but no longer use."""
    gc.collect()
    torch = torch_if_loaded()
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class FailureInjector:
    """Raises `SimulatedAllocationFailure` on chosen calls of `check`, for tests.

    Parameters
    ----------
    calls
        The 1-based numbers of the `check` calls that fail.
    larger_than
        Also fail every call whose `size` is larger than this.

    Examples
    --------
    >>> inject = FailureInjector(calls=[2])
    >>> inject.check(); inject.check()
    Traceback (most recent call last):
    ...
    sexpgpu.runtime.oom.SimulatedAllocationFailure: simulated allocation failure (call 2)
    """

    def __init__(self, calls: Iterable[int] = (), *, larger_than: int | None = None) -> None:
        self.calls = frozenset(calls)
        self.larger_than = larger_than
        self.count = 0
        self.failures = 0
        self._lock = threading.Lock()  # ranks may share one injector

    def check(self, size: int | None = None) -> None:
        """Count a call that allocates (of `size` rows, say); fail it if chosen."""
        with self._lock:
            self.count += 1
            too_large = self.larger_than is not None and size is not None
            fail = self.count in self.calls or (too_large and size > self.larger_than)
            if fail:
                self.failures += 1
            count = self.count
        if fail:
            what = "" if size is None else f", size {size}"
            raise SimulatedAllocationFailure(f"simulated allocation failure (call {count}{what})")


@dataclass
class SplitState:
    """How many pieces a batch is computed in, kept from one call to the next.

    Attributes
    ----------
    parts
        The number of pieces the next call starts with.
    events
        The ``memory: allocation failed ...`` lines, for the log and metrics.
    """

    parts: int = 1
    events: list[str] = field(default_factory=list)


def concat(results: Sequence[Any]) -> Any:
    """The pieces' results joined along the first axis (NumPy or PyTorch)."""
    if is_tensor(results[0]):
        return torch_if_loaded().cat(list(results))
    return np.concatenate(results)


def add_up(results: Sequence[Any]) -> Any:
    """The pieces' results summed in order (values of one structure)."""
    return functools.reduce(add, results)


def run_with_split(
    fn: Callable[[Any], R],
    batch: Any,
    state: SplitState,
    combine: Callable[[Sequence[R]], R] = concat,
    *,
    what: str = "batch",
    release: Callable[[], None] = release_caches,
) -> R:
    """``combine([fn(piece) for piece in pieces])``, splitting further when memory runs out.

    Parameters
    ----------
    fn
        The computation of one piece of the batch.
    batch
        An array or tensor, or a list, tuple or dict of them, split along the
        first axis (all leaves have the same length).
    state
        The split to start with; a new split is stored in it.
    combine
        Joins the pieces' results: `concat` (the default) or `add_up`.
    what
        Names the computation in the ``memory: allocation failed`` lines.
    release
        Frees caches before a retry (`release_caches`).

    Raises
    ------
    SexpgpuError
        E-MEM-001 when a piece of one row still fails.
    """
    n = _rows(batch)
    results: list[R] = []
    lo = 0
    released = False
    while lo < n or not results:
        step = max(1, math.ceil(n / state.parts))
        hi = min(n, lo + step)
        try:
            results.append(fn(_take(batch, lo, hi)))
            lo = hi
        except Exception as exc:
            if not is_allocation_failure(exc):
                raise
            without_frames(exc)  # what the failed piece's frames held is freed by the release
            release()
            if not released:
                released = True
                _note(
                    state,
                    f"memory: allocation failed in {what} of {_rows_text(hi - lo)} "
                    f"({exc}); released the caches and retried",
                )
                continue
            if hi - lo <= 1:
                raise SexpgpuError(
                    "E-MEM-001",
                    f"allocation failed in {what} even for one row at a time: {exc}",
                    what,
                    hint="use a smaller model or batch, more microbatches, or a device with "
                    "more memory",
                ) from exc
            state.parts = min(n, state.parts * 2)
            _note(
                state,
                f"memory: allocation failed in {what} of {_rows_text(hi - lo)}; splitting "
                f"it into {state.parts} pieces of at most {_rows_text(math.ceil(n / state.parts))}",
            )
    return combine(results)


def call_with_retry(
    fn: Callable[[], R],
    state: SplitState | None = None,
    *,
    what: str = "computation",
    release: Callable[[], None] = release_caches,
) -> R:
    """``fn()``, called once more after releasing the caches if memory runs out.

    For computations without a batch to split; a second failure propagates.
    """
    try:
        return fn()
    except Exception as exc:
        if not is_allocation_failure(exc):
            raise
        without_frames(exc)  # what the failed call's frames held is freed by the release
        release()
        line = f"memory: allocation failed in {what} ({exc}); released the caches and retried"
        _note(state if state is not None else SplitState(), line)
        return fn()


def call_with_split(
    fn: Callable[[int], R],
    state: SplitState,
    *,
    what: str,
    can_split: Callable[[int], bool],
    plan: Any = None,
    release: Callable[[], None] = release_caches,
) -> R:
    """``fn(state.parts)``: a computation of each microbatch in that many pieces.

    When an allocation fails: release the caches and retry; when it fails
    again, double the pieces where ``can_split(parts)`` allows it (kept in
    `state` for the run, and said in a ``memory: allocation failed`` line),
    and start over at that split.

    Parameters
    ----------
    fn
        The computation, given how many pieces to cut each microbatch in.
    state
        The split to start with; a new split is stored in it, with its lines.
    what
        Names the computation in the lines and the error.
    can_split
        Whether the graph allows cutting a microbatch in `parts` pieces.
    plan
        The run's `sexpgpu.runtime.memory.MemoryPlan`, named by the error.
    release
        Frees caches before a retry (`release_caches`).

    Raises
    ------
    SexpgpuError
        E-MEM-002 when a retry fails and the microbatch splits no further.
    """
    released = False
    while True:
        try:
            return fn(state.parts)
        except Exception as error:
            if not is_allocation_failure(error):
                raise
            exc = without_frames(error)
        release()  # past the handler: what the failed attempt's frames held is free now
        pieces = "" if state.parts == 1 else f" in {state.parts} pieces"
        if not released:
            released = True
            _note(
                state,
                f"memory: allocation failed in {what}{pieces} ({_first_line(exc)}); "
                "released the caches and retried",
            )
            continue
        if not can_split(state.parts * 2):
            raise allocation_error(what, exc, plan, state.parts) from exc
        state.parts *= 2
        released = False
        _note(
            state,
            f"memory: allocation failed in {what}{pieces} again; computing each "
            f"microbatch in {state.parts} pieces from now on",
        )


def allocation_error(what: str, exc: BaseException, plan: Any, parts: int) -> SexpgpuError:
    """E-MEM-002: `what` failed to allocate after release, retry and `parts` pieces.

    Names the plan (`plan`, a `MemoryPlan`, or None), what the failed
    allocation asked for and what was free (from PyTorch's message, else
    the device's free memory now), and the fix.
    """
    from sexpgpu.runtime.units import format_bytes

    asked, free = _asked_and_free(str(exc))
    budget = getattr(plan, "budget", None)
    if free is None and budget is not None:
        free = _free_now(budget.device)
    split = "splitting each microbatch " + (
        f"into {parts} pieces" if parts > 1 else "not being possible (the graph does not allow it)"
    )
    numbers = f"asked {asked or 'an unknown amount'}, " + (
        f"{format_bytes(free)} free" if isinstance(free, int) else f"{free or 'unknown'} free"
    )
    planned = f"; the plan was {plan.line().removeprefix('memory: plan ')}" if plan else ""
    if budget is not None and budget.source == "SEXPGPU_MEMORY":
        location = "SEXPGPU_MEMORY"
        hint = (
            f"SEXPGPU_MEMORY={format_bytes(budget.nbytes)} plans for more than the device "
            "holds: unset it (the plan then reads the free memory) or lower it, or use a "
            "smaller :batch or more :microbatches"
        )
    else:
        location = str(budget.device) if budget is not None else what
        hint = (
            "use a smaller :batch or more :microbatches; if another process holds memory "
            "on the device, free it first"
        )
    return SexpgpuError(
        "E-MEM-002",
        f"allocation failed in {what} after releasing the caches, a retry and {split}: "
        f"{numbers}{planned}",
        location,
        hint=hint,
    )


_ASKED = re.compile(r"tried to allocate ([0-9.]+ ?[KMGT]?i?B)", re.IGNORECASE)
_FREE = re.compile(r"([0-9.]+ ?[KMGT]?i?B) is free", re.IGNORECASE)


def _asked_and_free(message: str) -> tuple[str | None, str | None]:
    """What PyTorch's out-of-memory message says was asked and was free, where it says."""
    asked, free = _ASKED.search(message), _FREE.search(message)
    return (asked.group(1) if asked else None), (free.group(1) if free else None)


def _free_now(device: Any) -> int | None:
    """The device's free bytes now (GPU or host), or None where they cannot be read."""
    try:
        if getattr(device, "is_cuda", False):
            torch = torch_if_loaded()
            return int(torch.cuda.mem_get_info(device.index)[0]) if torch is not None else None
        from sexpgpu.runtime.memory import host_available_bytes

        return host_available_bytes()
    except Exception:  # a report of a failure must not fail itself
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _note(state: SplitState, line: str) -> None:
    log.warning("%s", line)
    state.events.append(line)


def _rows_text(n: int) -> str:
    return "1 row" if n == 1 else f"{n} rows"


def _rows(batch: Any) -> int:
    lengths: list[int] = []
    tree_map(lambda leaf: lengths.append(len(leaf)), batch)
    assert lengths and len(set(lengths)) == 1, f"batch leaves differ in length: {lengths}"
    return lengths[0]


def _take(batch: Any, lo: int, hi: int) -> Any:
    return tree_map(lambda leaf: leaf[lo:hi], batch)
