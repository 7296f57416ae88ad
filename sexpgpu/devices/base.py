"""The device interface that `sexpgpu.train` is written against, and the registry of devices.

A `Device` (``cpu``, ``cuda``) plans a run's memory before anything is
allocated and loads a `CompiledRun` into one `Program` per rank. The
program owns the rank's state on the device (parameters, optimizer moments,
the gradient buffers) and does every step's arithmetic there::

    program.start(optimizer, seed=..., state=None | HostState)
    for each step:
        for each microbatch: program.accumulate(batch)   # gradients summed on the device
        loss = program.reduce(ctx)                        # the group's all-reduce, the mean
        norm = program.update(lr, clip)                   # clip, optimizer, on the device
    program.evaluate(batch, target) ; program.host_state()  # eval; checkpoints, digests

A device's `plan` is a value (`Plan`): the memory plan and whatever the
device decided with it (the cuda device's stacking degree and compiled
step); `report` and `load` take it, so nothing is handed between them
behind the interface. The host sees only the loss, metrics and checkpoints. Devices are looked up
by the names users type (`sexpgpu.runtime.devices.DEVICE_KINDS`); each entry
is imported on first use, so ``cpu`` never imports PyTorch. `DEVICES` is also
the one seam tests wrap: an entry replaced for a test (pytest's
``monkeypatch.setitem``) runs every command on another device, such as the
cuda lowering on PyTorch's CPU device.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from sexpgpu.ir.compile import CompiledRun, ParamInfo
from sexpgpu.ir.recompute import Recomputation
from sexpgpu.runtime.devices import Device as DeviceId
from sexpgpu.runtime.memory import MemoryPlan

__all__ = [
    "DEVICES",
    "Device",
    "EvalResult",
    "HostState",
    "Plan",
    "Program",
    "get_device",
    "load_entry",
]


@dataclass(frozen=True)
class EvalResult:
    """One evaluation microbatch: its loss, and argmax hits over `count` targets (0 without)."""

    loss: float
    correct: int = 0
    count: int = 0


@dataclass
class HostState:
    """A rank's state on the host, as checkpoints hold it.

    Attributes
    ----------
    params
        Parameter name -> float32 array.
    moments
        The optimizer's moments, ``"<moment>/<param>"`` -> float32 array.
    optimizer
        The optimizer's JSON-able scalars (name, step count, options); empty
        for parameters alone (a run started from them makes a fresh optimizer).
    """

    params: dict[str, np.ndarray]
    moments: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)


class Program(Protocol):
    """One rank's run on a device: its state and its step (see the module docstring)."""

    params: Mapping[str, ParamInfo]
    events: list[str]  # ``memory: allocation failed ...`` lines not yet recorded
    # Whether its calls only queue work on the device: a run then queues the next
    # step's microbatches before it reads a step's numbers (`sexpgpu.train.rank`).
    asynchronous: bool

    def start(
        self, optimizer: Any, *, seed: int, state: HostState | None, shard_over: Any = None
    ) -> None:
        """Make the parameters from `seed` (or load `state`) and the optimizer, on the device.

        `shard_over` (a `sexpgpu.devices.collectives.Comms` of several ranks)
        keeps the optimizer state of this rank's shard alone (`sexpgpu.devices.shard`):
        then `reduce`, `update` and `host_state` are collectives of every rank.
        """
        ...

    def accumulate(self, batch: Mapping[str, np.ndarray]) -> None:
        """Run the training graph on one microbatch; add its loss and gradients to the buffers."""
        ...

    def local_grad_norm(self) -> float:
        """The global norm of this rank's summed gradients over its microbatches, per microbatch."""
        ...

    def reduce(self, ctx: Any, microbatches: int) -> Any:
        """Sum the buffers over every rank (`sexpgpu.devices.collectives.sum_over_ranks`:
        this node's ranks, then the nodes); the mean is over the run's `microbatches`.

        Returns the mean loss (``float()`` reads it: with one rank it may still
        be on the device, so that the update is queued before the host waits);
        the buffers then hold the gradients' sums, and `update` steps with their
        mean (a factor its kernels take as they read them).
        """
        ...

    def update(self, lr: float, clip: float | None) -> Any:
        """Clip the mean gradients (when `clip`), step the optimizer; return the norm before.

        The norm may be the device's scalar: ``float(norm)`` waits for it, so
        a caller reads it once it has queued what comes next.
        """
        ...

    def evaluate(self, batch: Mapping[str, np.ndarray], target: str | None) -> EvalResult:
        """The evaluation graph's loss on `batch`, and argmax accuracy against field `target`."""
        ...

    @property
    def has_activations(self) -> bool:
        """Whether `activation_rms` can sample the model's calls."""
        ...

    def activation_rms(self, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Root mean square of each call's result on `batch`, keyed by path."""
        ...

    def host_state(self) -> HostState:
        """Parameters and optimizer state copied to the host.

        Sharded (`start`'s `shard_over`), every rank calls it together: rank 0
        of node 0 gets every rank's moments, in the unsharded order; the others none.
        """
        ...

    def host_params(self) -> dict[str, np.ndarray]:
        """The parameters alone copied to the host (the run's summary).

        Where this rank keeps some parameters as bf16 copies alone, after `gather_params`.
        """
        ...

    def gather_params(self) -> None:
        """Every rank together, before `evaluate`, `activation_rms` or `host_params`.

        Sharded where the step reads bf16 copies, each rank keeps the f32 of
        its own shard's parameters alone: this brings every f32 parameter
        onto every rank until its next `accumulate`. Elsewhere it does nothing.
        """
        ...

    def take_peak(self) -> int:
        """The most bytes held at once since the last call (the allocator's high-water mark)."""
        ...


class Plan(Protocol):
    """What a device decided for a run before anything is allocated (`Device.plan`)."""

    compiled: CompiledRun  # its training graph recomputing what `recompute` chose
    memory: MemoryPlan  # the most one rank holds at once, by part
    recompute: Recomputation | None  # None: the run fits as compiled


class Device(Protocol):
    """A kind of device users name (``cpu``, ``cuda``): plans, reports and loads runs."""

    name: str

    def plan(
        self,
        compiled: CompiledRun,
        *,
        optimizer: str,
        ranks: int,
        memory: int | None,
        microbatches: int = 1,
        shards: int = 1,
    ) -> Plan:
        """The run's plan: the most one rank holds at once, by part, before any initializer runs.

        Parameters
        ----------
        compiled
            The run.
        optimizer
            The optimizer's name as users write it (``adamw``): its moments and
            update temporaries are counted.
        ranks
            Ranks on this node (simulated cpu ranks share the host's memory).
        memory
            ``SEXPGPU_MEMORY`` per device, or None to detect it.
        microbatches
            Microbatches per rank and step (more than one keeps gradient buffers),
            as `sexpgpu.train.settings.microbatches_per_rank` gives them.
        shards
            Ranks the optimizer state is sharded over (`sexpgpu.devices.shard`):
            a rank holds the moments of its shard alone, the largest one counted.
        """
        ...

    def report(self, plan: Plan) -> list[str]:
        """The lowering report: device, patterns matched and where, kernels, the plan."""
        ...

    def load(self, plan: Plan, where: DeviceId) -> Program:
        """A `Program` of the planned run on device `where` (one per rank)."""
        ...


def _on_first_use(path: str) -> Callable[[], Device]:
    """A maker of the device class at ``"package.module:name"``, imported when called."""
    return lambda: load_entry(path)()


# The names users type -> how to make the device.
DEVICES: dict[str, Callable[[], Device]] = {
    "cpu": _on_first_use("sexpgpu.devices.cpu_device:CpuDevice"),
    "cuda": _on_first_use("sexpgpu.devices.cuda.device:CudaDevice"),
}


def get_device(name: str) -> Device:
    """The device users call `name` (``cpu`` or ``cuda``), its module imported now."""
    return DEVICES[name]()


def load_entry(path: str) -> Any:
    """The object a registry entry ``"package.module:name"`` names, importing its module."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
