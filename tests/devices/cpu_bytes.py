"""The most bytes live at once while code runs on PyTorch's CPU device (a test's meter).

PyTorch keeps no allocator statistics on the CPU. This counts every storage made
while it is on, from an aten op (a dispatch mode sees it) or from the buffers
Inductor's generated CPU code makes with its own fast path (patched here), and
drops it when its storage dies.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes:
    """Bytes of storages made while on; ``peak`` the most at once."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._on = False

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """Count inside this block only: ``peak`` is then the most made in it, live at once."""
        self.live = self.peak = 0
        self._seen.clear()  # storages from before are not this block's
        self._on = True
        try:
            with _Ops(self):
                yield
        finally:
            self._on = False

    def count(self, value: Any) -> None:
        """Count each tensor in `value` whose storage is new."""
        if not self._on:
            return
        for tensor in torch.utils._pytree.tree_leaves(value):
            if type(tensor) is not torch.Tensor or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        if key in self._seen:
            self._seen.discard(key)
            self.live -= nbytes


class _Ops(TorchDispatchMode):
    def __init__(self, meter: LiveBytes) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output in an operand's storage (in place, a view) is nothing new.
        operands = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if type(t) is torch.Tensor
        }
        fresh = [
            t
            for t in torch.utils._pytree.tree_leaves(out)
            if type(t) is torch.Tensor and t.untyped_storage().data_ptr() not in operands
        ]
        self.meter.count(fresh)
        return out


@contextmanager
def counting() -> Iterator[LiveBytes]:
    """A meter of CPU storages, for code that runs inside its `measuring` blocks.

    Code Inductor generates binds its fast path when loaded: compile it inside
    this block, then measure its calls.
    """
    meter = LiveBytes()
    guards = torch._C._dynamo.guards
    made = guards._empty_strided_cpu

    def empty_strided_cpu(*args: Any) -> torch.Tensor:
        tensor = made(*args)
        meter.count(tensor)
        return tensor

    guards._empty_strided_cpu = empty_strided_cpu
    try:
        yield meter
    finally:
        guards._empty_strided_cpu = made
