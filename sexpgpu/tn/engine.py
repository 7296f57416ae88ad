"""Running one validated sweep: devices, budgets, the plan, the ranks, the result.

::

    device + Resources --> backends (one per rank) + budgets --> Plan (logged)
        --> sweep_rank on each rank (SoloContext, or a DeviceGroup thread each)
        --> [truncation pass on rank 0's backend] --> cores in quimb's layout

`src`, `apply` and `compress` validate their arguments and call `execute`.
"""

from __future__ import annotations

import logging
import resource as rusage
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from sexpgpu.runtime.devices import Device
from sexpgpu.runtime.group import DeviceGroup
from sexpgpu.runtime.memory import detect_budget
from sexpgpu.runtime.nodes import NodeLink
from sexpgpu.runtime.units import format_bytes

from .backend import Backend, NumpyBackend, TorchBackend
from .comm import Context, GroupRank, SoloContext
from .nodes import NodeContext, NodeWire
from .plan import Budgets, Plan, make_plan
from .resources import Resources, parse_bytes, resolve_host_budget
from .sink import CoreSink, DatasetSink, MemorySink, ScratchSink
from .sketch import SharedSketches, SketchSource
from .sweep import RankReport, SweepJob, sweep_rank
from .trains import Stack, unpad
from .truncation import truncate

__all__ = ["backends_for", "budgets_for", "execute"]

logger = logging.getLogger(__name__)

# A detected device budget leaves this share of the free memory to the libraries,
# beside runtime.memory's fixed reserve.
_DEVICE_MARGIN = 0.05

# In-memory inputs larger than this share of the host budget get a warning.
_LARGE_INPUT = 0.5


def backends_for(fn: str, device: str, resources: Resources) -> list[Backend]:
    """One backend per rank: NumPy or PyTorch, on the CPU (simulated ranks) or GPUs.

    Parameters
    ----------
    fn : str
        The public function, for messages.
    device : {"cpu", "cuda"}
        The checked device.
    resources : Resources
        ``devices`` names the ranks (``None``: one).

    Raises
    ------
    ValueError
        ``devices`` names a GPU that is not visible.
    """
    ids = resources.device_ids
    if device == "cpu":
        return [NumpyBackend(Device("cpu", i)) for i in ids or (0,)]
    import torch

    count = torch.cuda.device_count()
    if ids is None:
        return [TorchBackend(Device("cuda", torch.cuda.current_device()))]
    missing = [i for i in ids if i >= count]
    if missing:
        raise ValueError(
            f"{fn}: Resources(devices={resources.devices!r}) names GPU {missing[0]}, but "
            f"{count} GPU(s) are visible (ids 0 to {count - 1}); pass fewer devices or check "
            "CUDA_VISIBLE_DEVICES."
        )
    return [TorchBackend(Device("cuda", i)) for i in ids]


def budgets_for(backends: Sequence[Backend], resources: Resources) -> Budgets:
    """The budgets from `Resources`, or detected where unset."""
    host = resolve_host_budget(resources)
    host_source = "Resources" if resources.host_memory is not None else "detected"
    if all(xp.is_host for xp in backends):
        return Budgets(host, host, "host_memory", "host_memory", host_source, shared=True)
    if resources.gpu_memory is not None:
        device, source = parse_bytes(resources.gpu_memory, "gpu_memory"), "Resources"
    else:
        free = min(detect_budget(xp.device).nbytes for xp in backends)
        device, source = int(free * (1.0 - _DEVICE_MARGIN)), "detected"
    return Budgets(device, host, "gpu_memory", "host_memory", source, shared=False)


def _warn_large_inputs(fn: str, stack: Stack, host_budget: int) -> None:
    """Warn when in-memory inputs fill much of the host budget: files would be read lazily."""
    held = sum(
        site.nbytes for layer in stack.layers for site in layer.sites if type(site) is np.ndarray
    )
    if held > _LARGE_INPUT * host_budget:
        logger.warning(
            "%s: the inputs hold %s in memory, more than half the host budget of %s; pass "
            "np.memmap sites (np.load(..., mmap_mode='r')), h5py or zarr datasets so that "
            "the sweep reads one site at a time",
            fn,
            format_bytes(held),
            format_bytes(host_budget),
        )


def execute(
    fn: str,
    stack: Stack,
    source: SketchSource,
    work: np.dtype,
    *,
    cutoff: float,
    truncate_to: int | None,
    resources: Resources,
    backends: Sequence[Backend],
    out: object = None,
    link: NodeLink | None = None,
) -> list[Any] | None:
    """Plan and run one sweep over ``backends``; the result in quimb's layout.

    With a ``link`` to other nodes, the plan splits the sketch columns over
    every node's ranks, node 0 makes the result, and every node returns it
    (with ``out``, node 0 writes it and the others return None).

    Returns
    -------
    list
        NumPy arrays, or with ``out`` the datasets (or read-only memmaps) written there.

    Raises
    ------
    MemoryError
        A budget is smaller than the sweep's working set.
    """
    budgets = budgets_for(backends, resources)
    slack = max(xp.product_slack(work) for xp in backends)
    nodes = 1 if link is None else link.nodes
    plan = make_plan(stack, source.size, work, len(backends) * nodes, budgets, slack)
    _warn_large_inputs(fn, stack, budgets.host)
    if logger.isEnabledFor(logging.DEBUG):  # the plan's line is not made for nothing
        logger.debug(
            "SRC plan: sites=%d, layers=%d, sketch=%d, dtype=%s, devices=%s, %s",
            stack.n_sites,
            len(stack.layers),
            source.size,
            work,
            ",".join(str(xp.device) for xp in backends),
            plan.line(),
        )
    wire = None if nodes == 1 else NodeWire(link, backends[0].device)  # type: ignore[arg-type]
    writes = out is not None and (wire is None or wire.node == 0)
    final: CoreSink = DatasetSink(out, stack.n_sites, stack.kind) if writes else MemorySink()
    swept: CoreSink = final
    if truncate_to is not None:
        swept = ScratchSink(resources.scratch_path) if writes else MemorySink()
    job = SweepJob(
        stack=stack,
        sketches=SharedSketches(source, len(backends)),
        work=work,
        cutoff=0.0 if truncate_to is not None else cutoff,
        plan=plan,
        scratch_dir=resources.scratch_path,
        sink=swept,
    )
    try:
        reports = _run_ranks(backends, job, resources.device_ids is not None, wire)
        _log_peaks(plan, reports)
        if truncate_to is not None and (wire is None or wire.node == 0):
            truncate(backends[0], swept, final, stack.n_sites, truncate_to, cutoff)
            logger.debug("truncation pass: done")
    finally:
        if isinstance(swept, ScratchSink):
            swept.close()
    if out is not None:
        return final.result() if isinstance(final, DatasetSink) else None  # node 0 writes
    assert isinstance(final, MemorySink)
    if wire is not None and wire.node != 0:
        return wire.broadcast(None)
    cores = unpad([final.get(j) for j in range(stack.n_sites)], stack.kind)
    return cores if wire is None else wire.broadcast(cores)


def _run_ranks(
    backends: Sequence[Backend], job: SweepJob, grouped: bool, wire: NodeWire | None
) -> list[RankReport]:
    """Each rank's sweep: inline on one device, else (or when ``grouped``) a thread each.

    With a ``wire`` to other nodes each rank's collectives span every node's ranks.
    """

    def over_nodes(ctx: Context) -> Context:
        return ctx if wire is None else NodeContext(ctx, wire)

    if len(backends) == 1 and not grouped:
        solo = over_nodes(SoloContext(backends[0].device))
        return [sweep_rank(solo, backends[0], job)]
    devices = [xp.device for xp in backends]
    group = DeviceGroup(devices)
    return group.run(
        lambda ctx: sweep_rank(over_nodes(GroupRank(ctx, devices)), backends[ctx.rank], job)
    )


def _log_peaks(plan: Plan, reports: Sequence[RankReport]) -> None:
    """The measured peaks against the plan, at DEBUG."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    for rank, report in enumerate(reports):
        stored = ", ".join(f"{t} {format_bytes(n)}" for t, n in report.store_peak.items() if n)
        measured = (
            "not measured on this backend"
            if report.device_peak is None
            else f"{format_bytes(report.device_peak)} ({report.device_peak} B)"
        )
        planned = plan.work_device + report.store_peak.get("device", 0) + plan.resident_bytes
        logger.debug(
            "SRC peaks, rank %d: device %s of %s planned; environments held at most: %s",
            rank,
            measured,
            format_bytes(planned),
            stored or "none",
        )
        for line in report.splits:
            logger.debug("SRC rank %d: %s", rank, line)
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in KiB on Linux
    maxrss = rusage.getrusage(rusage.RUSAGE_SELF).ru_maxrss * unit
    logger.debug(
        "SRC peaks: host resident set at most %s (the process's lifetime high-water mark); "
        "host working set planned %s",
        format_bytes(maxrss),
        format_bytes(plan.work_host),
    )
