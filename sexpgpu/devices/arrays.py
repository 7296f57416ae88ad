"""The few array operations the device-side training state needs, per backend.

Optimizers, clipping and gradient accumulation (`sexpgpu.devices.optim`,
`sexpgpu.devices.state`) are written once against `ArrayOps`; NumPy arrays
(the cpu device) and PyTorch tensors (`sexpgpu.devices.cuda.arrays`) both
support the in-place Python operators they use (``+=``, ``*=``, ``-=``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["NUMPY", "ArrayOps", "NumpyOps"]


class ArrayOps(Protocol):
    """A backend's arrays: making, moving and the reductions of the update."""

    def zeros(self, shape: tuple[int, ...]) -> Any:
        """A float32 array of zeros on the device."""
        ...

    def upload(self, array: np.ndarray) -> Any:
        """A float32 copy of the host `array` on the device, owned by the caller."""
        ...

    def download(self, x: Any) -> np.ndarray:
        """A host copy of the device array `x`."""
        ...

    def sqrt(self, x: Any) -> Any:
        """Elementwise square root (a new array)."""
        ...

    def sum_of_squares(self, xs: Sequence[Any]) -> float:
        """``sum(x * x)`` over all of `xs`, accumulated in float64, as a host number."""
        ...

    def argmax_hits(self, output: Any, target: np.ndarray) -> int:
        """How many rows' argmax over the last axis of `output` equals `target` (host ints)."""
        ...


class NumpyOps:
    """`ArrayOps` on host NumPy arrays."""

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, np.float32)

    def download(self, x: np.ndarray) -> np.ndarray:
        return np.array(x)

    def sqrt(self, x: np.ndarray) -> np.ndarray:
        return np.sqrt(x)

    def sum_of_squares(self, xs: Sequence[np.ndarray]) -> float:
        return sum(float(np.sum(np.square(x, dtype=np.float64))) for x in xs)

    def argmax_hits(self, output: np.ndarray, target: np.ndarray) -> int:
        return int(np.sum(np.argmax(output, axis=-1) == target))


NUMPY = NumpyOps()
