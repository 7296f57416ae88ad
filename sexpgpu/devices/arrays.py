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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["NUMPY", "AdamWStep", "ArrayOps", "NumpyOps", "clip_factor"]


def clip_factor(norm: float, max_norm: float | None) -> float | None:
    """``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``.

    None where nothing is clipped (no `max_norm`, or a norm within it).
    """
    if max_norm is None:
        return None
    factor = float(max_norm) / (norm + 1e-6)
    return factor if factor < 1.0 else None


@dataclass(frozen=True)
class AdamWStep:
    """One AdamW update's numbers (step is 1-based), as ``torch.optim.AdamW``.

    The gradients enter multiplied by `grad_scale` (the clipping factor: a
    host number or the backend's device scalar), where it is not None. `lr`
    and `step` are what `ArrayOps.scalars` gave: host numbers, or device
    scalars on a backend that may replay the update.
    """

    lr: Any
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: Any
    grad_scale: Any = None

    @property
    def step_size(self) -> float:
        return self.lr / (1 - self.beta1**self.step)

    @property
    def root_bc2(self) -> float:
        return math.sqrt(1 - self.beta2**self.step)


class ArrayOps(Protocol):
    """A backend's arrays: making, moving and the reductions of the update.

    `events` collects lines for the run's annotations (a captured update, say).
    """

    events: list[str]
    # Whether its calls only queue work (a GPU's stream) rather than compute it
    # before they return: then a run reads each step's numbers a step later.
    asynchronous: bool

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
        """
        ...

    def clip_scale(self, norm: Any, max_norm: float | None) -> Any:
        """`clip_factor` of `norm` (from `norm`): None, a host number or a device scalar."""
        ...

    def scalars(self, name: str, **values: float) -> dict[str, Any]:
        """`values` as the update's kernels read them: host numbers, or device scalars.

        A backend that replays the update (`replayed`) keeps one device scalar
        per ``name`` and key and refills it here, outside the replayed part.
        """
        ...

    def replayed(
        self, key: tuple[Any, ...], arrays: Sequence[Any], queue: Callable[[], Any]
    ) -> Any:
        """``queue()``, a function that only queues work on the device, and its result.

        `key` holds the host values `queue` builds into its work and `arrays`
        every array it reads or writes beyond `scalars`; a backend may capture
        `queue` once both come twice in a row (the arrays at the same
        addresses) and replay it from then on.
        """
        ...

    def argmax_hits(self, output: Any, target: np.ndarray) -> int:
        """How many rows' argmax over the last axis of `output` equals `target` (host ints)."""
        ...

    def read_later(self, x: Any) -> Any:
        """`x` (a number or a device scalar) on its way to the host, behind what is queued now.

        ``float()`` of the result waits only for the work queued before this
        call, not for what the caller queues after it (the next step).
        """
        ...

    def multiply(self, xs: Sequence[Any], factor: Any) -> None:
        """``x *= factor`` (a host number or a `clip_scale`) for every array of `xs`, in place."""
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

    def __init__(self) -> None:
        self.events: list[str] = []  # nothing to say: NumPy's update runs as written
        self.asynchronous = False

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, np.float32)

    def download(self, x: np.ndarray) -> np.ndarray:
        return np.array(x)

    def norm(self, xs: Sequence[np.ndarray]) -> float:
        return math.sqrt(sum(float(np.sum(np.square(x, dtype=np.float64))) for x in xs))

    def clip_scale(self, norm: float, max_norm: float | None) -> float | None:
        return clip_factor(norm, max_norm)

    def argmax_hits(self, output: np.ndarray, target: np.ndarray) -> int:
        return int(np.sum(np.argmax(output, axis=-1) == target))

    def read_later(self, x: Any) -> Any:
        return x  # already on the host

    def scalars(self, name: str, **values: float) -> dict[str, Any]:
        return values

    def replayed(
        self, key: tuple[Any, ...], arrays: Sequence[Any], queue: Callable[[], Any]
    ) -> Any:
        return queue()

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
        if step.grad_scale is not None:
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
