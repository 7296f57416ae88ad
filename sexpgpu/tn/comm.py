"""What one rank of the sweep talks through: a `DeviceGroup` rank, or itself alone.

The sweep is written once against `Context`: the collectives it uses
(gather, scatter, allgather, broadcast) with the signatures of
`sexpgpu.runtime.group.RankContext`. A sweep on one device gets a `SoloContext`,
whose collectives hand a value back unchanged, so one device runs exactly the
code, and gives exactly the result, of rank 0 of a group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from sexpgpu.runtime.devices import Device

__all__ = ["Context", "SoloContext"]


class Context(Protocol):
    """A rank of the sweep: its number, the group's size and devices, the collectives."""

    rank: int
    size: int
    device: Device

    @property
    def devices(self) -> Sequence[Device]: ...

    def gather(self, x: Any, root: int = 0) -> list[Any] | None: ...

    def scatter(self, chunks: Sequence[Any] | None, root: int = 0) -> Any: ...

    def allgather(self, x: Any) -> list[Any]: ...

    def broadcast(self, x: Any, root: int = 0) -> Any: ...


class SoloContext:
    """The one rank of a sweep without a group.

    Parameters
    ----------
    device : Device
        The device the sweep runs on.
    """

    rank = 0
    size = 1

    def __init__(self, device: Device) -> None:
        self.device = device

    @property
    def devices(self) -> Sequence[Device]:
        """The devices of the (one-rank) group."""
        return (self.device,)

    def gather(self, x: Any, root: int = 0) -> list[Any] | None:
        """``[x]``."""
        return [x]

    def scatter(self, chunks: Sequence[Any] | None, root: int = 0) -> Any:
        """``chunks[0]``."""
        assert chunks is not None and len(chunks) == 1
        return chunks[0]

    def allgather(self, x: Any) -> list[Any]:
        """``[x]``."""
        return [x]

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """``x``."""
        return x


class GroupRank:
    """A `RankContext` of a `DeviceGroup` seen as a `Context` (adds ``devices``).

    Parameters
    ----------
    ctx : sexpgpu.runtime.group.RankContext
        The rank's context inside `DeviceGroup.run`.
    devices : sequence of Device
        The group's devices in rank order.
    """

    def __init__(self, ctx: Any, devices: Sequence[Device]) -> None:
        self._ctx = ctx
        self.rank = ctx.rank
        self.size = ctx.size
        self.device = ctx.device
        self._devices = tuple(devices)

    @property
    def devices(self) -> Sequence[Device]:
        """The group's devices in rank order."""
        return self._devices

    def gather(self, x: Any, root: int = 0) -> list[Any] | None:
        """Every rank's ``x`` on ``root``."""
        return self._ctx.gather(x, root)

    def scatter(self, chunks: Sequence[Any] | None, root: int = 0) -> Any:
        """``chunks[rank]`` of ``root``."""
        return self._ctx.scatter(chunks, root)

    def allgather(self, x: Any) -> list[Any]:
        """Every rank's ``x`` on every rank."""
        return self._ctx.allgather(x)

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """``root``'s ``x`` on every rank."""
        return self._ctx.broadcast(x, root)
