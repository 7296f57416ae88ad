"""`Stream` on a PyTorch device (see `sexpgpu.devices.stream`).

The step's numbers are device scalars refilled in place on the device's
stream (no host sync), so a captured update (`sexpgpu.devices.cuda.replay`)
reads each step's own; numbers go to the host through page-locked memory
behind the work queued so far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from sexpgpu.devices.cuda.replay import Replay

__all__ = ["TorchStream"]


class TorchStream:
    """The queue of `device`: its update captured and replayed where it is a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.events: list[str] = []
        self.asynchronous = self.device.type == "cuda"  # PyTorch's CPU device computes as called
        self.replay = Replay(self.device, "update", self.events)
        self._scalars: dict[tuple[str, str], torch.Tensor] = {}

    def scalars(self, name: str, **values: float) -> dict[str, Any]:
        # Kept for the run and refilled in place: a replay reads this step's numbers.
        out = {}
        for key, value in values.items():
            slot = self._scalars.get((name, key))
            if slot is None:
                slot = self._scalars[name, key] = torch.zeros((), device=self.device)
            out[key] = slot.fill_(value)
        return out

    def replayed(
        self, key: tuple[Any, ...], arrays: Sequence[torch.Tensor], queue: Callable[[], Any]
    ) -> Any:
        # By address: a capture reads and writes its operands' memory, whichever tensors hold it.
        return self.replay((*key, *(a.data_ptr() for a in arrays)), queue)

    def forget(self) -> None:
        self.replay.forget()

    def read_later(self, x: Any) -> Any:
        # A synchronous read queues its copy behind everything: the next step's too.
        if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
            return x
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return _OnItsWay(host, copied)


class _OnItsWay:
    """A device scalar being copied to page-locked host memory; ``float()`` waits for the copy."""

    def __init__(self, host: torch.Tensor, copied: Any) -> None:
        self._host, self._copied = host, copied

    def __float__(self) -> float:
        self._copied.synchronize()
        return float(self._host)
