"""Optimizers: `sgd` and `adamw`, and clipping by global norm, on any device's arrays.

The update rules are written once, against an `ArrayOps` namespace (NumPy
for the cpu device, PyTorch for cuda): arrays are updated in place with
Python's operators, which NumPy and PyTorch share, so every device runs the
same arithmetic in the same order.

Both follow PyTorch's update rules (``torch.optim.SGD`` with dampening 0 and
``torch.optim.AdamW``), so a run and the same model written in PyTorch trace
the same losses. Parameters are updated in place, in float32. Weight decay is
decoupled (AdamW) and skips every parameter whose ``decay`` is False (the
vectors: biases and norm gains).

The names, options and defaults are the language's (`sexpgpu.lang.runs.OPTIMIZERS`);
an optimizer receives every option filled in, with ``-`` read as ``_``
(``:weight-decay`` is ``weight_decay``), and checks none of them again.

An optimizer's state is split the way checkpoints store it: `tensors` (the
moments, keyed ``"<moment>/<param>"``, for safetensors) and `scalars` (the
step count, for JSON).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from sexpgpu.devices.arrays import NUMPY, AdamWStep, ArrayOps

__all__ = [
    "OPTIMIZERS",
    "AdamW",
    "Optimizer",
    "Sgd",
    "global_norm",
    "make_optimizer",
    "moment_count",
    "optimizer",
]

Arrays = dict[str, Any]  # name -> a device's array

# name as users type it (the language's table) -> Optimizer subclass
OPTIMIZERS: dict[str, type[Optimizer]] = {}


def optimizer(name: str) -> Callable[[type[Optimizer]], type[Optimizer]]:
    """Register an optimizer class under the name users write in `:optimizer`."""

    def register(cls: type[Optimizer]) -> type[Optimizer]:
        cls.name = name
        OPTIMIZERS[name] = cls
        return cls

    return register


class Optimizer:
    """Base: the moments and their (de)serialization.

    Parameters
    ----------
    shapes
        Parameter name -> shape.
    decay
        Parameter name -> whether weight decay applies to it.
    options
        Every option, defaults filled in by the language (``lr``, ``weight_decay``, ...).
    xp
        The arrays' namespace (`sexpgpu.devices.arrays.NUMPY` by default).
    """

    name = ""
    moments: ClassVar[tuple[str, ...]] = ()
    # Whether `queue` reads every per-step number from `ArrayOps.scalars`, so
    # that the queued half can be captured once and replayed.
    replayable: ClassVar[bool] = False

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        decay: Mapping[str, bool],
        options: Mapping[str, Any],
        xp: ArrayOps = NUMPY,
    ) -> None:
        self.xp = xp
        self.options = dict(options)
        self.decay = dict(decay)
        self.steps = 0
        self.state: dict[str, Arrays] = {
            m: {k: xp.zeros(s) for k, s in shapes.items()} for m in self.moments
        }

    def advance(self, lr: float) -> None:
        """The host's half of a step: count it and set its numbers (learning rate `lr`)."""
        raise NotImplementedError

    def queue(self, params: Arrays, grads: Mapping[str, Any], scale: Any = None) -> None:
        """The device's half of the step `advance` set: the arithmetic, in place.

        `scale` is None or the clipping factor (`ArrayOps.clip_scale`, maybe
        a device scalar): an optimizer may fold it into its own kernels
        instead of a pass over the gradients.
        """
        raise NotImplementedError

    def tensors(self) -> Arrays:
        """The moment arrays (the device's), keyed ``"<moment>/<param>"``."""
        return {f"{m}/{k}": v for m, vs in self.state.items() for k, v in vs.items()}

    def scalars(self) -> dict[str, Any]:
        """The JSON-able state: name, step count and options."""
        return {"name": self.name, "steps": self.steps, "options": _jsonable(self.options)}

    def load(self, tensors: Mapping[str, np.ndarray], scalars: Mapping[str, Any]) -> None:
        """Restore what `tensors` (host arrays) and `scalars` returned."""
        assert scalars["name"] == self.name, (scalars["name"], self.name)
        self.steps = int(scalars["steps"])
        for m, vs in self.state.items():
            for k in vs:
                vs[k] = self.xp.upload(np.asarray(tensors[f"{m}/{k}"], dtype=np.float32))


def _jsonable(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}


@optimizer("sgd")
class Sgd(Optimizer):
    """Stochastic gradient descent with optional (Nesterov) momentum, as ``torch.optim.SGD``."""

    moments: ClassVar[tuple[str, ...]] = ("momentum",)

    def advance(self, lr: float) -> None:
        self.steps += 1
        self._lr = lr  # a host number in `queue`'s arithmetic: not replayable

    def queue(self, params: Arrays, grads: Mapping[str, Any], scale: Any = None) -> None:
        if scale is not None:
            self.xp.multiply(list(grads.values()), scale)
        mu = float(self.options["momentum"])
        nesterov = bool(self.options["nesterov"])
        lr = self._lr
        for k, p in params.items():
            g = grads[k]
            if mu:
                buf = self.state["momentum"][k]
                buf *= mu
                buf += g  # first step: buf = g, as torch
                g = g + mu * buf if nesterov else buf
            p -= lr * g


@optimizer("adamw")
class AdamW(Optimizer):
    """Adam with decoupled weight decay and bias correction, as ``torch.optim.AdamW``.

    Per parameter with gradient g at step t (1-based)::

        p <- p * (1 - lr * wd)                  (only where decay is True)
        m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2
        p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    """

    moments: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    replayable: ClassVar[bool] = True

    def advance(self, lr: float) -> None:
        self.steps += 1
        self._numbers = self.xp.scalars("adamw", lr=lr, step=float(self.steps))

    def queue(self, params: Arrays, grads: Mapping[str, Any], scale: Any = None) -> None:
        b1, b2 = (float(b) for b in self.options["betas"])
        eps, wd = float(self.options["eps"]), float(self.options["weight_decay"])
        lr, steps = self._numbers["lr"], self._numbers["step"]
        m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
        # Decayed and plain parameters in one call each, in the parameters' order.
        for decays in (True, False):
            keys = [k for k in params if bool(wd and self.decay.get(k, True)) is decays]
            numbers = AdamWStep(lr, b1, b2, eps, wd if decays else 0.0, steps, scale)
            self.xp.adamw(
                [params[k] for k in keys],
                [grads[k] for k in keys],
                [m[k] for k in keys],
                [v[k] for k in keys],
                numbers,
            )


def make_optimizer(
    spec: Any,
    shapes: Mapping[str, tuple[int, ...]],
    decay: Mapping[str, bool],
    xp: ArrayOps = NUMPY,
) -> Optimizer:
    """The optimizer an `OptimizerSpec` (``name``, ``options``) names, over `xp`."""
    return OPTIMIZERS[spec.name](shapes, decay, spec.options, xp)


def global_norm(grads: Mapping[str, Any], xp: ArrayOps = NUMPY) -> float:
    """The 2-norm of all gradients together, accumulated in float64."""
    return float(xp.norm(list(grads.values())))


def moment_count(spec: Any) -> int:
    """Arrays per parameter the optimizer `spec` names keeps (2 for adamw)."""
    return len(OPTIMIZERS[spec.name].moments)
