"""The shared runtime: device configuration, groups and collectives, memory.

It knows nothing of the language, the IR, training or tensor networks; the
device back ends and `sexpgpu.tn` build on it. Nothing here imports PyTorch
until a cuda device is used or asked about.

- `sexpgpu.runtime.config`: `RuntimeConfig.from_env`, ``--device`` and the
  ``SEXPGPU_*`` variables, checked once.
- `sexpgpu.runtime.devices`: `Device` (``cpu:N``, ``cuda:N``), visible GPUs.
- `sexpgpu.runtime.group`: `DeviceGroup`, a thread per device, collectives,
  abort on failure.
- `sexpgpu.runtime.transfer`: copies and sums of values between devices, for
  the collectives.
- `sexpgpu.runtime.memory`: budgets, plans (E-MEM-001), peaks.
- `sexpgpu.runtime.units`: amounts of memory (``40GiB``), parsed and printed.
- `sexpgpu.runtime.oom`: retry and split after an allocation failure, and the
  failure injector for tests.
- `sexpgpu.runtime.nodes`: `NodeLink`, the rendezvous of several nodes and
  cross-node sums (torch.distributed).
- `sexpgpu.runtime.probe`: the host's versions and GPUs, for ``sexpgpu doctor``.
- `sexpgpu.runtime.files`: files written whole or not at all (`replace_whole`).
"""

from sexpgpu.runtime.config import RuntimeConfig, check_env
from sexpgpu.runtime.devices import Device, parse_device, require_capability, visible_gpu_count
from sexpgpu.runtime.group import (
    CollectiveMismatch,
    DeviceGroup,
    GroupAborted,
    GroupTimeout,
    RankContext,
)
from sexpgpu.runtime.memory import MemoryBudget, MemoryPlan, PeakTracker, detect_budget
from sexpgpu.runtime.nodes import GradientCarry, NodeLink
from sexpgpu.runtime.oom import (
    FailureInjector,
    SimulatedAllocationFailure,
    SplitState,
    add_up,
    call_with_retry,
    concat,
    is_allocation_failure,
    release_caches,
    run_with_split,
)
from sexpgpu.runtime.units import GiB, MiB, format_bytes, parse_bytes

__all__ = [
    "CollectiveMismatch",
    "Device",
    "DeviceGroup",
    "FailureInjector",
    "GiB",
    "GradientCarry",
    "GroupAborted",
    "GroupTimeout",
    "MemoryBudget",
    "MemoryPlan",
    "MiB",
    "NodeLink",
    "PeakTracker",
    "RankContext",
    "RuntimeConfig",
    "SimulatedAllocationFailure",
    "SplitState",
    "add_up",
    "call_with_retry",
    "check_env",
    "concat",
    "detect_budget",
    "format_bytes",
    "is_allocation_failure",
    "parse_bytes",
    "parse_device",
    "release_caches",
    "require_capability",
    "run_with_split",
    "visible_gpu_count",
]
