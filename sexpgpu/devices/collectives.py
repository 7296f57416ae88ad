"""The gradient sum of a step over every rank of a run: this node's ranks, then the nodes.

`Program.reduce` (`sexpgpu.devices.state.TrainState.reduce`) hands its loss
and gradient buffers to `sum_over_ranks`::

    this node:   LocalSum.all_reduce   every rank's buffers summed, on every rank
    the nodes:   NodeLink.sum          rank 0 of each node sums the node sums in
                                       node order (f32, or bf16 with the carry)
    this node:   LocalSum.broadcast    rank 0's result on every rank of the node

The sum within a node is the device's (`LOCAL_SUMS`, keyed by the device
kind users type): on ``cpu`` (simulated ranks) the `DeviceGroup`'s
all-reduce, plain copies added in rank order; on ``cuda`` one NCCL
all-reduce over the node's GPUs (`sexpgpu.devices.cuda.collectives`). The
loss travels beside the gradients as a float64 and is summed exactly, in
rank then node order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from sexpgpu.devices.base import load_entry
from sexpgpu.runtime.nodes import GradientCarry, NodeLink
from sexpgpu.runtime.transfer import is_tensor

__all__ = ["LOCAL_SUMS", "Comms", "GroupSum", "LocalSum", "local_sum", "sum_over_ranks"]


class LocalSum(Protocol):
    """Sums between the ranks of one node (one thread each, one process)."""

    def all_reduce(
        self, ctx: Any, loss: float, grads: dict[str, Any]
    ) -> tuple[float, dict[str, Any]]:
        """The sums over the node's ranks of `loss` and `grads`, on every rank (rank order)."""
        ...

    def broadcast(
        self, ctx: Any, loss: float, grads: dict[str, Any]
    ) -> tuple[float, dict[str, Any]]:
        """Rank 0's `loss` and `grads` on every rank of the node."""
        ...


class GroupSum:
    """`LocalSum` through the `DeviceGroup`'s collectives: copies summed on rank 0.

    Exact and in rank order on every device; the only one simulated ranks need.
    """

    def all_reduce(
        self, ctx: Any, loss: float, grads: dict[str, Any]
    ) -> tuple[float, dict[str, Any]]:
        total = ctx.all_reduce({"loss": np.float64(float(loss)), "grads": grads})
        return total["loss"], total["grads"]

    def broadcast(
        self, ctx: Any, loss: float, grads: dict[str, Any]
    ) -> tuple[float, dict[str, Any]]:
        got = ctx.broadcast({"loss": np.float64(float(loss)), "grads": grads}, root=0)
        return got["loss"], got["grads"]


# The device kind users type -> its LocalSum (imported on first use: cuda loads torch).
LOCAL_SUMS: dict[str, str] = {
    "cpu": "sexpgpu.devices.collectives:GroupSum",
    "cuda": "sexpgpu.devices.cuda.collectives:NcclSum",
}


def local_sum(kind: str) -> LocalSum:
    """The `LocalSum` of device kind `kind` (``cpu`` or ``cuda``)."""
    return load_entry(LOCAL_SUMS[kind])()


@dataclass
class Comms:
    """What a rank sums its step over: its node's group and the link to the other nodes.

    Attributes
    ----------
    group
        This rank's `sexpgpu.runtime.group.RankContext` (the node's ranks).
    link
        The other nodes; a link to itself on one node.
    carry
        This node's bf16 rounding error (used by the node's rank 0 only).
    local
        The sum between the node's ranks; by default the device kind's.
    """

    group: Any
    link: NodeLink = field(default_factory=NodeLink)
    carry: GradientCarry = field(default_factory=GradientCarry)
    local: LocalSum | None = None

    def __post_init__(self) -> None:
        if self.local is None:
            self.local = local_sum(self.group.device.kind) if self.group.size > 1 else GroupSum()

    @property
    def size(self) -> int:
        """Ranks over all nodes."""
        return self.group.size * self.link.nodes

    @property
    def rank(self) -> int:
        """This rank's number over all nodes (node by node, then the node's ranks)."""
        return self.link.node_rank * self.group.size + self.group.rank


def sum_over_ranks(ctx: Any, loss: Any, grads: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Sum `loss` and `grads` over every rank of the run (see the module docstring).

    Parameters
    ----------
    ctx
        A `Comms`, or a bare `RankContext` (one node).
    loss
        This rank's summed loss.
    grads
        This rank's summed gradients, by parameter name.

    Returns
    -------
    tuple
        The loss and the gradients (the backend's arrays) summed over all
        ranks. The loss is a float, except with one rank on one node, where a
        device's loss is returned as it is: it is read once the update is
        queued.
    """
    comms = ctx if isinstance(ctx, Comms) else Comms(ctx)
    group, link = comms.group, comms.link
    grads = dict(grads)
    if group.size > 1:
        loss, grads = comms.local.all_reduce(group, loss, grads)
    if link.nodes > 1:
        if group.rank == 0:
            names = list(grads)
            summed = link.sum([grads[k] for k in names], comms.carry)
            grads = dict(zip(names, summed, strict=True))
            loss = sum(link.allgather(float(loss)), start=0.0)  # exact, in node order
        if group.size > 1:
            loss, grads = comms.local.broadcast(group, loss, grads)
    # A device's loss stays there (read once the update is queued); host numbers are floats.
    return (loss if is_tensor(loss) else float(loss)), grads
