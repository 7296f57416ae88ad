"""`NcclSum`: the gradient sum between the GPUs of one node, through NCCL in one process.

The ranks of a node are threads of one process, one GPU each. Each rank packs
its gradient buffers into flat float32 buckets on its GPU; the ranks share
the buckets' references (`RankContext.share`); rank 0's thread calls
``torch.cuda.nccl.all_reduce`` once per bucket over every GPU's bucket (one
call drives all GPUs), waits for the GPUs, and each rank unpacks its summed
buckets back into its buffers::

    rank r:  bucket[b] = cat(grads in bucket b)          # (n_b,) f32 on cuda:r
    rank 0:  nccl.all_reduce([bucket_0[b], ..., bucket_R-1[b]])   for each b
    rank r:  grads <- split(bucket[b])

With the optimizer state sharded (`sexpgpu.devices.shard`), `reduce_scatter`
and `all_gather` pack each rank's shard into its slot of one padded buffer
(the largest shard's size) and make one NCCL call over all GPUs.

NCCL's ring order is fixed by the topology, not by timing, so the sums are
deterministic; with two GPUs they are bitwise the rank-order sum of the
`GroupSum` (one addition commutes). The loss, one host number, goes through
the group's own all-reduce. Where NCCL cannot take the tensors (not on GPUs,
or PyTorch without NCCL) the group's copies are used instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sexpgpu.devices.collectives import GroupSum

__all__ = ["BUCKET_BYTES", "NcclSum", "buckets"]

# Packing buffers bound the extra memory per GPU; 64 MiB keeps NCCL near its bandwidth.
BUCKET_BYTES = 64 * 2**20


def buckets(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive runs of the tensors' indices, each of at most `limit` elements (or one)."""
    out: list[list[int]] = []
    count = 0
    for index, size in enumerate(sizes):
        if not out or (count + size > limit and out[-1]):
            out.append([])
            count = 0
        out[-1].append(index)
        count += size
    return out


class NcclSum:
    """`LocalSum` of the ``cuda`` device (see the module docstring).

    Parameters
    ----------
    nccl
        The module with ``all_reduce(inputs)`` and ``broadcast(inputs, root)``;
        by default ``torch.cuda.nccl`` (tests pass a stand-in on CPU tensors).
    bucket_bytes
        The most bytes one packing buffer holds.
    """

    def __init__(self, nccl: Any = None, bucket_bytes: int = BUCKET_BYTES) -> None:
        self._nccl = nccl
        self.bucket_bytes = bucket_bytes
        self._fallback = GroupSum()
        self._agreed: bool | None = None  # whether every rank goes through NCCL, once known

    def all_reduce(
        self, ctx: Any, loss: float, grads: dict[str, Any]
    ) -> tuple[float, dict[str, Any]]:
        names = list(grads)
        if not self._usable(ctx, [grads[k] for k in names]):
            return self._fallback.all_reduce(ctx, loss, grads)
        total = ctx.all_reduce(np.float64(float(loss)))
        return float(total), self._collective(ctx, grads, names, "all_reduce")

    def broadcast(
        self, ctx: Any, loss: float, grads: dict[str, Any]
    ) -> tuple[float, dict[str, Any]]:
        names = list(grads)
        if not self._usable(ctx, [grads[k] for k in names]):
            return self._fallback.broadcast(ctx, loss, grads)
        got = ctx.broadcast(np.float64(float(loss)), root=0)
        return float(got), self._collective(ctx, grads, names, "broadcast")

    def reduce_scatter(
        self, ctx: Any, grads: dict[str, Any], owned: list[list[str]]
    ) -> dict[str, Any]:
        if not self._usable(ctx, list(grads.values())):
            return self._fallback.reduce_scatter(ctx, grads, owned)
        import torch

        segment = _segment(grads, owned)
        packed = torch.zeros(ctx.size * segment, device=_device_of(grads))
        for rank, names in enumerate(owned):
            _pack(packed[rank * segment : (rank + 1) * segment], [grads[k] for k in names])
        mine = packed.new_empty(segment)
        self._shared(ctx, (packed, mine), "reduce_scatter", segment)
        out = {}
        at = 0
        for k in owned[ctx.rank]:
            out[k] = mine[at : at + grads[k].numel()].view(grads[k].shape)
            at += grads[k].numel()
        return out

    def all_gather(self, ctx: Any, values: dict[str, Any], owned: list[list[str]]) -> None:
        if not self._usable(ctx, list(values.values())):
            self._fallback.all_gather(ctx, values, owned)
            return
        import torch

        segment = _segment(values, owned)
        dtype = next(iter(values.values())).dtype  # f32 parameters, or their bf16 copies
        mine = torch.zeros(segment, dtype=dtype, device=_device_of(values))
        _pack(mine, [values[k] for k in owned[ctx.rank]])
        everyone = mine.new_empty(ctx.size * segment)
        self._shared(ctx, (mine, everyone), "all_gather", segment)
        for rank, names in enumerate(owned):
            if rank == ctx.rank:
                continue
            at = rank * segment
            for k in names:
                n = values[k].numel()
                values[k].copy_(everyone[at : at + n].view(values[k].shape))
                at += n

    # -- the collective ---------------------------------------------------------------------

    def _shared(self, ctx: Any, pair: tuple[Any, Any], op: str, segment: int) -> None:
        """``nccl.<op>(inputs, outputs)`` over every rank's `pair` (input, output), by rank 0."""
        everyone = ctx.share(pair)
        if ctx.rank == 0 and segment:
            getattr(self._module(), op)([a for a, _ in everyone], [b for _, b in everyone])
            for a, _ in everyone:  # the GPUs are done before any rank reads
                _synchronize(a)
        ctx.barrier()

    def _collective(
        self, ctx: Any, grads: dict[str, Any], names: list[str], op: str
    ) -> dict[str, Any]:
        import torch

        tensors = [grads[k] for k in names]
        groups = buckets([t.numel() for t in tensors], max(1, self.bucket_bytes // 4))
        packed = [torch.cat([tensors[i].reshape(-1) for i in group]) for group in groups]
        everyone = ctx.share(packed)  # each rank's buckets, by reference
        if ctx.rank == 0:
            nccl = self._module()
            for b in range(len(groups)):
                inputs = [mine[b] for mine in everyone]
                if op == "all_reduce":
                    nccl.all_reduce(inputs)
                else:
                    nccl.broadcast(inputs, root=0)
            for mine in everyone:  # the GPUs are done before any rank reads
                _synchronize(mine[0])
        ctx.barrier()
        out = dict(grads)
        for group, flat in zip(groups, packed, strict=True):
            pieces = flat.split([tensors[i].numel() for i in group])
            for i, piece in zip(group, pieces, strict=True):
                out[names[i]] = piece.view(tensors[i].shape)
        return out

    def _module(self) -> Any:
        if self._nccl is None:
            import torch.cuda.nccl

            self._nccl = torch.cuda.nccl
        return self._nccl

    def _usable(self, ctx: Any, tensors: list[Any]) -> bool:
        """Whether every rank can go through NCCL: the same answer on every rank.

        Asked of the group at the first sum only: a run's buffers keep their
        devices and dtypes, so the answer holds for the run.
        """
        if self._agreed is None:
            mine = bool(tensors) and self._takes(tensors)
            self._agreed = all(ctx.allgather(mine))
        return self._agreed

    def _takes(self, tensors: list[Any]) -> bool:
        if self._nccl is not None:
            return True  # a stand-in takes what it is given
        import torch

        if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
            return False
        import torch.cuda.nccl

        return bool(torch.cuda.nccl.is_available(tensors[:1]))


def _synchronize(tensor: Any) -> None:
    if getattr(tensor, "is_cuda", False):
        import torch

        torch.cuda.synchronize(tensor.device)


def _segment(arrays: dict[str, Any], owned: list[list[str]]) -> int:
    """The elements of the largest rank's share: every rank's slot of a padded buffer."""
    return max((sum(arrays[k].numel() for k in names) for names in owned), default=0)


def _pack(into: Any, tensors: list[Any]) -> None:
    """`tensors` flattened one after another into the start of the flat `into`."""
    at = 0
    for t in tensors:
        into[at : at + t.numel()].copy_(t.reshape(-1))
        at += t.numel()


def _device_of(arrays: dict[str, Any]) -> Any:
    return next(iter(arrays.values())).device
