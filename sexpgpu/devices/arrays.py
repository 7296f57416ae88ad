"""The few array operations the device-side training state needs, per backend.

Clipping and gradient accumulation (`sexpgpu.devices.state`) are written
once against `ArrayOps`; NumPy arrays (the cpu device) and PyTorch tensors
(`sexpgpu.devices.cuda.arrays`) both support the in-place Python operators
they use (``+=``, ``*=``). What touches every gradient at once (their norm,
scaling them) is one `ArrayOps` call, so that a GPU backend can run it as a
few multi-tensor kernels instead of a launch per parameter. The
optimizers' arithmetic is in the update-rule table
(`sexpgpu.devices.update_rules`), the order work runs in is the stream's
(`sexpgpu.devices.stream`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["NUMPY", "ArrayOps", "NumpyOps", "clip_factor"]


def clip_factor(norm: float, max_norm: float | None) -> float | None:
    """``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``.

    None where nothing is clipped (no `max_norm`, or a norm within it).
    """
    if max_norm is None:
        return None
    factor = float(max_norm) / (norm + 1e-6)
    return factor if factor < 1.0 else None


class ArrayOps(Protocol):
    """A backend's arrays: making, moving and the reductions of the update."""

    # The update-rule backends it runs, best first (`sexpgpu.devices.update_rules`).
    backends: tuple[str, ...]

    def zeros(self, shape: tuple[int, ...]) -> Any:
        """A float32 array of zeros on the device."""
        ...

    def upload(self, array: np.ndarray) -> Any:
        """A float32 copy of the host `array` on the device, owned by the caller."""
        ...

    def download(self, x: Any) -> np.ndarray:
        """A host copy of the device array `x`."""
        ...

    def norm(self, xs: Sequence[Any]) -> Any:
        """The 2-norm of all of `xs` together, accumulated in float64.

        A host number, or the backend's device scalar (``float()`` reads it),
        so that the update can be queued before the host waits for it.
        It is ``norm_from`` of ``square_norms``: a sharded update sums the
        squares of every rank's shard in the same order (`sexpgpu.devices.shard`).
        """
        ...

    def square_norms(self, xs: Sequence[Any]) -> np.ndarray:
        """Each array's part of `norm`, in order, as a float64 host array."""
        ...

    def norm_from(self, squares: np.ndarray) -> Any:
        """`norm` of arrays whose `square_norms` are `squares` (concatenated, in order)."""
        ...

    def clip_scale(self, norm: Any, max_norm: float | None) -> Any:
        """`clip_factor` of `norm` (from `norm`): None, a host number or a device scalar."""
        ...

    def argmax_hits(self, output: Any, target: np.ndarray) -> int:
        """How many rows' argmax over the last axis of `output` equals `target` (host ints)."""
        ...

    def multiply(self, xs: Sequence[Any], factor: Any) -> None:
        """``x *= factor`` (a host number or a `clip_scale`) for every array of `xs`, in place."""
        ...


class NumpyOps:
    """`ArrayOps` on host NumPy arrays."""

    def __init__(self) -> None:
        self.backends = ("numpy",)

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, np.float32)

    def download(self, x: np.ndarray) -> np.ndarray:
        return np.array(x)

    def norm(self, xs: Sequence[np.ndarray]) -> float:
        return self.norm_from(self.square_norms(xs))

    def square_norms(self, xs: Sequence[np.ndarray]) -> np.ndarray:
        return np.array([np.sum(np.square(x, dtype=np.float64)) for x in xs], np.float64)

    def norm_from(self, squares: np.ndarray) -> float:
        return math.sqrt(sum(float(s) for s in squares))  # in order, one addition at a time

    def clip_scale(self, norm: float, max_norm: float | None) -> float | None:
        return clip_factor(norm, max_norm)

    def argmax_hits(self, output: np.ndarray, target: np.ndarray) -> int:
        return int(np.sum(np.argmax(output, axis=-1) == target))

    def multiply(self, xs: Sequence[np.ndarray], factor: float) -> None:
        for x in xs:
            x *= factor


NUMPY = NumpyOps()
