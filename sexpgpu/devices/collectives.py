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

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from sexpgpu.devices.base import load_entry
from sexpgpu.devices.shard import Shards
from sexpgpu.runtime.nodes import GradientCarry, NodeLink
from sexpgpu.runtime.transfer import is_tensor

__all__ = [
    "LOCAL_SUMS",
    "Comms",
    "GroupSum",
    "LocalSum",
    "allgather_over_ranks",
    "gather_over_ranks",
    "gather_to_lead",
    "local_sum",
    "scatter_over_ranks",
    "sum_over_ranks",
]


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

    def reduce_scatter(
        self, ctx: Any, grads: dict[str, Any], owned: list[list[str]]
    ) -> dict[str, Any]:
        """The sums over the node's ranks of the gradients rank r owns (``owned[r]``), on r."""
        ...

    def all_gather(self, ctx: Any, values: dict[str, Any], owned: list[list[str]]) -> None:
        """Every rank's own entries of `values` (``owned[r]``) written into every rank's."""
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

    def reduce_scatter(
        self, ctx: Any, grads: dict[str, Any], owned: list[list[str]]
    ) -> dict[str, Any]:
        return ctx.reduce_scatter([{k: grads[k] for k in names} for names in owned])

    def all_gather(self, ctx: Any, values: dict[str, Any], owned: list[list[str]]) -> None:
        everyone = ctx.allgather({k: values[k] for k in owned[ctx.rank]})
        for rank, theirs in enumerate(everyone):
            if rank != ctx.rank:
                for k, v in theirs.items():
                    _write(values[k], v)


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
    comms = _comms(ctx)
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


# -- sharded optimizer states (`sexpgpu.devices.shard`) ---------------------------------------


def scatter_over_ranks(ctx: Any, loss: Any, grads: Mapping[str, Any], shards: Shards) -> tuple:
    """`sum_over_ranks`, each rank receiving the sums of its own shard alone.

    Returns ``(loss, own)``: the loss summed over every rank (a float) and
    this rank's parameters' gradient sums, by name. The other entries of
    `grads` are left as they were (partial sums).
    """
    comms = _comms(ctx)
    group, link, size = comms.group, comms.link, comms.group.size
    grads = dict(grads)
    if link.nodes == 1:
        total = float(group.all_reduce(np.float64(float(loss))))
        owned = [shards.of(r) for r in range(size)]
        return total, comms.local.reduce_scatter(group, grads, owned) if size > 1 else grads
    if size > 1:
        loss, grads = comms.local.all_reduce(group, loss, grads)
    chunks = None
    if group.rank == 0:  # this node's sum: each node sums its own shard's parts in node order
        names = list(grads)
        node = _node_of(shards, size)
        mine = link.reduce_scatter([grads[k] for k in names], [node[k] for k in names], comms.carry)
        summed = dict(zip([k for k in names if node[k] == link.node_rank], mine, strict=True))
        chunks = [{k: summed[k] for k in shards.of(comms.rank + r)} for r in range(size)]
        loss = sum(link.allgather(float(loss)), start=0.0)  # exact, in node order
    if size == 1:
        assert chunks is not None
        return float(loss), chunks[0]
    return float(group.broadcast(loss, root=0)), group.scatter(chunks, root=0)


def gather_over_ranks(ctx: Any, values: dict[str, Any], shards: Shards) -> None:
    """Every rank's own entries of `values` (its shard's parameters) written into every rank's.

    `values` holds the same names on every rank, all of one dtype (f32
    parameters, or bf16 copies: between nodes those travel as f32, exactly).
    """
    comms = _comms(ctx)
    group, link, size = comms.group, comms.link, comms.group.size
    first = link.node_rank * size  # this node's first rank
    if size > 1:
        owned = [[k for k in shards.of(first + r) if k in values] for r in range(size)]
        comms.local.all_gather(group, values, owned)
    if link.nodes == 1:
        return
    node = _node_of(shards, size)
    others = [k for k in values if node[k] != link.node_rank]
    if group.rank == 0:
        names = [[k for k in values if node[k] == n] for n in range(link.nodes)]
        counts = [sum(_numel(values[k]) for k in ks) for ks in names]
        flats = link.exchange(_flat([values[k] for k in names[link.node_rank]]), counts)
        for n, flat in enumerate(flats):
            if n != link.node_rank:
                _unflat(flat, {k: values[k] for k in names[n]})
    if size > 1:
        got = group.broadcast({k: values[k] for k in others} if group.rank == 0 else None)
        for k in others:
            if group.rank != 0:
                _write(values[k], got[k])


def allgather_over_ranks(ctx: Any, value: Any) -> list[Any]:
    """Every rank's JSON-able host `value`, in global rank order, on every rank."""
    comms = _comms(ctx)
    group, link = comms.group, comms.link
    everyone = group.allgather(value)
    if link.nodes == 1:
        return everyone
    nodes = link.allgather(everyone) if group.rank == 0 else None
    if group.size > 1:
        nodes = group.broadcast(nodes, root=0)
    return [x for node in nodes for x in node]


def gather_to_lead(ctx: Any, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """Every rank's float32 host `arrays` together on rank 0 of node 0; None elsewhere."""
    comms = _comms(ctx)
    group, link = comms.group, comms.link
    got = group.gather(dict(arrays), root=0)
    if got is None:
        return None
    mine = {k: v for part in got for k, v in part.items()}
    if link.nodes > 1:
        shapes = link.allgather([[k, list(v.shape)] for k, v in mine.items()])
        counts = [sum(math.prod(shape) for _, shape in node) for node in shapes]
        flats = link.exchange(_flat(list(mine.values())), counts)
        if link.node_rank != 0:
            return None
        mine = {}
        for node, flat in zip(shapes, flats, strict=True):
            arrays_of = {k: np.zeros(shape, np.float32) for k, shape in node}
            _unflat(flat, arrays_of)
            mine |= arrays_of
    return mine


def _comms(ctx: Any) -> Comms:
    """`ctx` as a `Comms`: it is one, or a bare `RankContext` of one node."""
    return ctx if isinstance(ctx, Comms) else Comms(ctx)


def _node_of(shards: Shards, size: int) -> dict[str, int]:
    """Parameter -> the node whose rank owns it (`size` ranks a node)."""
    return {k: rank // size for k, rank in shards.owner.items()}


def _numel(x: Any) -> int:
    return int(np.prod(x.shape))


def _flat(xs: list[Any]) -> Any:
    """`xs` (arrays or tensors) as one flat float32 host array."""
    parts = [np.asarray(_host(x), np.float32).reshape(-1) for x in xs]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def _unflat(flat: Any, into: dict[str, Any]) -> None:
    """The pieces of `flat`, in order, written into the arrays of `into`."""
    flat = np.asarray(_host(flat))
    at = 0
    for x in into.values():
        n = _numel(x)
        _write(x, flat[at : at + n].reshape(x.shape))
        at += n


def _host(x: Any) -> Any:
    if not is_tensor(x):
        return x
    return x.detach().float().cpu().numpy()  # bf16 widened exactly (NumPy has none)


def _write(dst: Any, src: Any) -> None:
    """``dst[...] = src``: an array or tensor overwritten in place from another device's copy."""
    if isinstance(dst, np.ndarray):
        dst[...] = _host(src)
    else:
        dst.copy_(src if is_tensor(src) else _torch_from(src, dst))


def _torch_from(src: np.ndarray, like: Any) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(src)).to(like.device)
