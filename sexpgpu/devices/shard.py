"""Optimizer states sharded over data-parallel ranks (ZeRO stage 1): which rank owns what.

With several ranks each keeps the optimizer state of its own shard of the
parameters; a step reduce-scatters the gradients (each rank receives the
sums of its shard), each rank updates its shard, and the parameters are
all-gathered (`sexpgpu.devices.collectives`). A shard is made of whole
parameters, in the run's parameter order, cut into one contiguous run per
rank (global rank order: node by node, then the node's ranks) so that the
largest run holds as few bytes as any cut can. Whole parameters keep every
update rule correct as it is (muon orthogonalizes whole matrices); in order
and contiguous, the ranks' per-parameter numbers concatenated in rank order
are in the parameters' order, so the clipping norm is summed in the order
one rank sums it, and a sharded run is bitwise an unsharded one::

    parameters   a  b  c  d  e  f        (sizes 4 1 1 2 3 1)
    2 ranks      [a  b  c][d  e  f]      largest shard 6 of 12 elements

Where the step reads bf16 copies of parameters alone (cuda's fused bf16
step), a rank keeps the f32 master weights of its own shard's alone and
bf16 copies of the others' (`master_elements` counts them; docs/devices.md).

`choose` decides for a run: by ``SEXPGPU_SHARD_OPTIMIZER`` (1 always, 0
never), else where the unsharded state does not fit the memory plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Shards", "choose", "largest_shard", "master_elements", "shard_line", "shard_params"]


@dataclass(frozen=True)
class Shards:
    """Whole parameters assigned to ranks (see the module docstring).

    Attributes
    ----------
    ranks
        How many ranks share the state.
    owner
        Parameter name -> the rank that keeps its optimizer state, in parameter order.
    """

    ranks: int
    owner: Mapping[str, int]

    def of(self, rank: int) -> list[str]:
        """The parameters rank `rank` owns, in parameter order (maybe none)."""
        return [k for k, r in self.owner.items() if r == rank]

    def largest(self, sizes: Mapping[str, int]) -> int:
        """The most of `sizes` (per parameter) that one rank's shard holds."""
        totals = [0] * self.ranks
        for k, r in self.owner.items():
            totals[r] += sizes[k]
        return max(totals, default=0)


def shard_params(sizes: Mapping[str, int], ranks: int) -> Shards:
    """`sizes` (parameter -> elements, in order) cut into `ranks` contiguous runs.

    The least capacity that `ranks` greedy runs fit, found by bisection;
    the greedy cut at that capacity. Ranks past the last run own nothing.
    """
    assert ranks >= 1
    names, counts = list(sizes), [int(sizes[k]) for k in sizes]

    def runs(capacity: int) -> list[int]:
        """The rank of each parameter, filling each rank up to `capacity`."""
        rank, held, out = 0, 0, []
        for n in counts:
            if held and held + n > capacity:
                rank, held = rank + 1, 0
            out.append(rank)
            held += n
        return out

    low, high = max(counts, default=0), sum(counts)
    while low < high:
        mid = (low + high) // 2
        if (runs(mid)[-1] if counts else 0) < ranks:
            high = mid
        else:
            low = mid + 1
    return Shards(ranks, dict(zip(names, runs(low), strict=True)))


def choose(
    device: Any, compiled: Any, setting: bool | None, world: int, **plan: Any
) -> tuple[Any, int]:
    """The device's plan of `compiled` and the ranks its optimizer state is sharded over.

    Parameters
    ----------
    device
        A `sexpgpu.devices.base.Device`.
    compiled
        The run.
    setting
        ``SEXPGPU_SHARD_OPTIMIZER``: True shards, False never does, None lets
        the plan choose: sharded where the unsharded plan does not fit
        without recomputing (sharding costs no arithmetic, recomputing does).
    world
        Ranks over all nodes.
    plan
        `Device.plan`'s other keywords (``optimizer``, ``ranks``, ``memory``, ``microbatches``).

    Returns
    -------
    tuple
        ``(plan, shards)``: shards is 1 where every rank keeps the whole state.
    """
    if world == 1 or setting is False:
        return device.plan(compiled, shards=1, **plan), 1
    if setting is None:
        whole = device.plan(compiled, shards=1, **plan)
        if whole.memory.fits and whole.recompute is None:
            return whole, 1
    return device.plan(compiled, shards=world, **plan), world


def shard_line(shards: int, setting: bool | None) -> list[str]:
    """``optimizer states: sharded over 4 ranks (...)``, where they are; [] otherwise."""
    if shards == 1:
        return []
    why = "SEXPGPU_SHARD_OPTIMIZER=1" if setting else "the unsharded state does not fit"
    return [f"optimizer states: sharded over {shards} ranks ({why})"]


def largest_shard(compiled: Any, shards: int) -> int:
    """The elements of the largest of `compiled`'s parameter shards over `shards` ranks."""
    sizes = {k: info.size for k, info in compiled.params.items()}
    return shard_params(sizes, shards).largest(sizes)


def master_elements(compiled: Any, shards: int, copies_only: Sequence[str]) -> int:
    """The most f32 parameter elements one rank keeps where the step reads `copies_only` as bf16.

    Sharded, a rank keeps the f32 of those alone that it owns (and of every
    other parameter), and a buffer the size of the largest of the others' that
    stands in for them in the step's call (never written, never read).
    """
    sizes = {k: info.size for k, info in compiled.params.items()}
    if shards == 1:
        return sum(sizes.values())
    cut, alone = shard_params(sizes, shards), set(copies_only)
    kept = []
    for rank in range(shards):
        others = [sizes[k] for k in alone if cut.owner[k] != rank]
        kept.append(sum(sizes.values()) - sum(others) + max(others, default=0))
    return max(kept)
