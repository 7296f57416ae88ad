"""The few array operations the device-side training state needs, per backend.

Optimizers, clipping and gradient accumulation (`sexpgpu.devices.optim`,
`sexpgpu.devices.state`) are written once against `ArrayOps`; NumPy arrays
(the cpu device) and PyTorch tensors (`sexpgpu.devices.cuda.arrays`) both
support the in-place Python operators they use (``+=``, ``*=``, ``-=``).
What touches every parameter at once (scaling all gradients, the AdamW
update) is one `ArrayOps` call, so that a GPU backend can run it as a few
multi-tensor kernels instead of a launch per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["NUMPY", "AdamWStep", "ArrayOps", "NumpyOps"]


@dataclass(frozen=True)
class AdamWStep:
    """One AdamW update's numbers (step is 1-based), as ``torch.optim.AdamW``.

    The gradients enter multiplied by `grad_scale` (the clipping factor).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    grad_scale: float = 1.0

    @property
    def step_size(self) -> float:
        return self.lr / (1 - self.beta1**self.step)

    @property
    def root_bc2(self) -> float:
        return math.sqrt(1 - self.beta2**self.step)


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

    def sum_of_squares(self, xs: Sequence[Any]) -> float:
        """``sum(x * x)`` over all of `xs`, accumulated in float64, as a host number."""
        ...

    def argmax_hits(self, output: Any, target: np.ndarray) -> int:
        """How many rows' argmax over the last axis of `output` equals `target` (host ints)."""
        ...

    def divide(self, xs: Sequence[Any], divisor: float) -> None:
        """``x /= divisor`` for every array of `xs`, in place."""
        ...

    def multiply(self, xs: Sequence[Any], factor: float) -> None:
        """``x *= factor`` for every array of `xs`, in place."""
        ...

    def adamw(
        self,
        params: Sequence[Any],
        grads: Sequence[Any],
        m: Sequence[Any],
        v: Sequence[Any],
        step: AdamWStep,
    ) -> None:
        """One AdamW update of `params` and its moments `m`, `v`, in place.

        Per parameter p with gradient g (times ``grad_scale``; decay applies when ``weight_decay``
        is not 0; the caller passes the decayed and the other parameters in
        separate calls)::

            p <- p * (1 - lr * wd)
            m <- m + (g - m) (1 - b1)  ;  v <- b2 v + (1 - b2) g^2
            p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
        """
        ...


class NumpyOps:
    """`ArrayOps` on host NumPy arrays."""

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, np.float32)

    def download(self, x: np.ndarray) -> np.ndarray:
        return np.array(x)

    def sum_of_squares(self, xs: Sequence[np.ndarray]) -> float:
        return sum(float(np.sum(np.square(x, dtype=np.float64))) for x in xs)

    def argmax_hits(self, output: np.ndarray, target: np.ndarray) -> int:
        return int(np.sum(np.argmax(output, axis=-1) == target))

    def divide(self, xs: Sequence[np.ndarray], divisor: float) -> None:
        for x in xs:
            x /= divisor

    def multiply(self, xs: Sequence[np.ndarray], factor: float) -> None:
        for x in xs:
            x *= factor

    def adamw(
        self,
        params: Sequence[np.ndarray],
        grads: Sequence[np.ndarray],
        m: Sequence[np.ndarray],
        v: Sequence[np.ndarray],
        step: AdamWStep,
    ) -> None:
        if step.grad_scale != 1.0:
            self.multiply(grads, step.grad_scale)
        b1, b2, wd = step.beta1, step.beta2, step.weight_decay
        step_size, root_bc2 = step.step_size, step.root_bc2
        for p, g, mk, vk in zip(params, grads, m, v, strict=True):
            if wd:
                p *= 1 - step.lr * wd
            mk += (g - mk) * (1 - b1)  # torch's lerp
            vk *= b2
            vk += (1 - b2) * g * g
            p -= step_size * (mk / (np.sqrt(vk) / root_bc2 + step.eps))


NUMPY = NumpyOps()
