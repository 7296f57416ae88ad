"""Memory budgets, plans and peaks: how much a device may hold, and what fills it.

A `MemoryBudget` is what one device may use: ``SEXPGPU_MEMORY`` when set,
else the free memory of a GPU less a reserve for the libraries (1 GiB), or the
host's available memory on the CPU. A `MemoryPlan` names the parts a run will
hold at once and refuses to start (E-MEM-001) when they do not fit. A
`PeakTracker` records the high-water mark for the closing line::

    memory: plan 12.3 GiB of 139.0 GiB (parameters 0.5 GiB, optimizer 1.0 GiB, ...)
    memory: peak 11.9 GiB of 12.3 GiB planned (-3%)
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.devices import Device, parse_device
from sexpgpu.runtime.units import GiB, format_bytes

__all__ = [
    "PLAN_PARTS",
    "RESERVE",
    "MemoryBudget",
    "MemoryPlan",
    "PeakTracker",
    "call_peak_bytes",
    "detect_budget",
    "host_available_bytes",
]

log = logging.getLogger(__name__)

# Left free on a GPU for cuBLAS/cuDNN workspaces, NCCL and the CUDA context.
RESERVE = GiB

# The usual parts of a plan, in the order reports list them. Other names are
# allowed and follow these.
PLAN_PARTS: tuple[str, ...] = (
    "parameters",
    "optimizer",
    "gradients",
    "constants",
    "activations",
    "workspace",
)


@dataclass(frozen=True)
class MemoryBudget:
    """The bytes one device may use, and where that number came from.

    Attributes
    ----------
    device
        The device, such as ``cuda:0``.
    nbytes
        The budget in bytes.
    source
        ``"SEXPGPU_MEMORY"``, ``"free GPU memory"`` or ``"host memory"``.
    """

    device: Device
    nbytes: int
    source: str

    def __str__(self) -> str:
        return f"{format_bytes(self.nbytes)} on {self.device} ({self.source})"


def detect_budget(
    device: Device | str,
    memory: int | None = None,
    *,
    reserve: int = RESERVE,
    meminfo: str | os.PathLike[str] = "/proc/meminfo",
) -> MemoryBudget:
    """The memory budget of `device`.

    Parameters
    ----------
    device
        The device, such as ``"cuda:0"`` or ``"cpu"``.
    memory
        ``RuntimeConfig.memory`` (from ``SEXPGPU_MEMORY``): when set it is the
        budget as given, to plan against a smaller card than the one present.
    reserve
        Bytes kept free on a GPU for the libraries.
    meminfo
        Where the host's memory is read on Linux when psutil is absent.

    Returns
    -------
    MemoryBudget
    """
    device = parse_device(device)
    if memory is not None:
        return MemoryBudget(device, memory, "SEXPGPU_MEMORY")
    if device.is_cuda:
        import torch

        free, _total = torch.cuda.mem_get_info(device.index)
        return MemoryBudget(device, max(0, int(free) - reserve), "free GPU memory")
    return MemoryBudget(device, host_available_bytes(meminfo), "host memory")


def host_available_bytes(meminfo: str | os.PathLike[str] = "/proc/meminfo") -> int:
    """The host memory available to a new allocation, in bytes.

    Uses psutil when it is installed, else ``MemAvailable`` in `meminfo`,
    else the physical memory reported by ``os.sysconf``.
    """
    if importlib.util.find_spec("psutil") is not None:
        import psutil

        return int(psutil.virtual_memory().available)
    try:
        return _meminfo_available(Path(meminfo).read_text())
    except (OSError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _meminfo_available(text: str) -> int:
    """``MemAvailable`` (else ``MemFree``) of /proc/meminfo text, in bytes."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    for name in ("MemAvailable", "MemFree"):
        if name in fields:
            return fields[name]
    raise ValueError("no MemAvailable or MemFree in /proc/meminfo")


@dataclass(frozen=True)
class MemoryPlan:
    """The most one device holds at once, by part, against its budget.

    Parameters
    ----------
    budget
        The device's `MemoryBudget`.
    parts
        Bytes per named part, such as ``{"parameters": ..., "activations": ...}``;
        the names of `PLAN_PARTS` are listed first, in that order.
    """

    budget: MemoryBudget
    parts: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert all(n >= 0 for n in self.parts.values()), "negative part in a memory plan"
        order = {name: i for i, name in enumerate(PLAN_PARTS)}
        ranked = sorted(self.parts.items(), key=lambda kv: order.get(kv[0], len(order)))
        object.__setattr__(self, "parts", dict(ranked))

    @property
    def total(self) -> int:
        """The planned bytes, all parts together."""
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        """Whether the plan fits the budget."""
        return self.total <= self.budget.nbytes

    def line(self) -> str:
        """``memory: plan 12.3 GiB of 139.0 GiB (parameters 0.5 GiB, ...)``."""
        return (
            f"memory: plan {self._format(self.total)} of {format_bytes(self.budget.nbytes)} "
            f"({self._parts_text()})"
        )

    def peak_line(self, peak: int) -> str:
        """``memory: peak X of Y planned (+Z%)``: the measured peak against the plan."""
        change = 100.0 * (peak - self.total) / self.total if self.total else 0.0
        return (
            f"memory: peak {self._format(peak)} of {self._format(self.total)} planned "
            f"({change:+.0f}%)"
        )

    def _format(self, n: int) -> str:
        # One unit for the plan and its parts (the total's) reads at a glance.
        return format_bytes(n, _unit(self.total))

    def check(self, hint: str | None = None) -> None:
        """Raise E-MEM-001 when the plan does not fit its budget.

        Parameters
        ----------
        hint
            What the caller can change, said first (such as the batch's
            name and value); the generic ways out follow.
        """
        if self.fits:
            return
        budget = self.budget
        over = self.total - budget.nbytes
        ways = (
            "use a smaller batch or more microbatches, or more devices"
            if budget.source != "SEXPGPU_MEMORY"
            else "use a smaller batch or more microbatches, or raise SEXPGPU_MEMORY "
            "if the card has room"
        )
        raise SexpgpuError(
            "E-MEM-001",
            f"the memory plan needs {format_bytes(self.total)} on {budget.device}, "
            f"{format_bytes(over)} more than the budget of {format_bytes(budget.nbytes)} "
            f"({budget.source}): {self._parts_text()}",
            "SEXPGPU_MEMORY" if budget.source == "SEXPGPU_MEMORY" else str(budget.device),
            hint=f"{hint}; or {ways}" if hint else ways,
        )

    def _parts_text(self) -> str:
        return ", ".join(f"{name} {self._format(n)}" for name, n in self.parts.items()) or (
            "no parts"
        )


def _unit(n: int) -> str:
    """The largest binary unit that keeps `n` at 1 or more."""
    return format_bytes(n).split()[-1]


class PeakTracker:
    """The high-water mark of one device's memory during a run.

    On a GPU it reads PyTorch's allocator (``max_memory_allocated``); on the
    CPU, and for memory the allocator does not see, the code that allocates
    reports its live bytes with `observe`. The peak is the larger of the two.
    """

    def __init__(self, device: Device | str) -> None:
        self.device = parse_device(device)
        self._observed = 0
        self.reset()

    def reset(self) -> None:
        """Start a new high-water mark (each step, say)."""
        self._observed = 0
        if self.device.is_cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device.index)

    def observe(self, live_bytes: int) -> None:
        """Report `live_bytes` held now; the peak keeps the largest."""
        self._observed = max(self._observed, live_bytes)

    @property
    def peak(self) -> int:
        """The most bytes held at once since the last `reset`."""
        allocator = 0
        if self.device.is_cuda:
            import torch

            allocator = int(torch.cuda.max_memory_allocated(self.device.index))
        return max(self._observed, allocator)


def call_peak_bytes(device: Any, call: Callable[[], Any]) -> int | None:
    """The most bytes ``call()`` holds on a GPU beyond what was held before it.

    Measured over the second of two calls: at the first, Inductor benchmarks
    its kernels' configurations in scratch memory of its own and cuBLAS makes
    the thread's workspaces, none of which a call holds later (for a small
    model they were most of the first call's mark). None where the call does
    not fit (the caller's estimate stands), and on a device that is no GPU.
    """
    import torch

    if torch.device(device).type != "cuda":
        return None
    peak = 0
    for _ in range(2):
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            call()
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None
        torch.cuda.synchronize(device)
        peak = int(torch.cuda.max_memory_allocated(device)) - base
    return peak
