"""Optimizers: `sgd` and `adamw`, and clipping by global norm, on any device's arrays.

The update rules are written once, against an `ArrayOps` namespace (NumPy
for the cpu device, PyTorch for cuda): arrays are updated in place with
Python's operators, which NumPy and PyTorch share, so every device runs the
same arithmetic in the same order.

Both follow PyTorch's update rules (``torch.optim.SGD`` with dampening 0 and
``torch.optim.AdamW``), so a run and the same model written in PyTorch trace
the same losses. Parameters are updated in place, in float32. Weight decay is
decoupled (AdamW) and skips every parameter whose ``decay`` is False (the
vectors: biases and norm gains). Option names are those of the language with
``-`` read as ``_`` (``:weight-decay`` is ``weight_decay``).

An optimizer's state is split the way checkpoints store it: `tensors` (the
moments, keyed ``"<moment>/<param>"``, for safetensors) and `scalars` (the
step count, for JSON).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from sexpgpu.devices.arrays import NUMPY, AdamWStep, ArrayOps, clip_factor
from sexpgpu.errors import SexpgpuError

__all__ = [
    "OPTIMIZERS",
    "AdamW",
    "Optimizer",
    "Sgd",
    "clip_by_global_norm",
    "global_norm",
    "make_optimizer",
    "moment_count",
    "optimizer",
    "peak_lr",
]

Arrays = dict[str, Any]  # name -> a device's array

# name as users type it -> Optimizer subclass
OPTIMIZERS: dict[str, type[Optimizer]] = {}


def optimizer(name: str) -> Callable[[type[Optimizer]], type[Optimizer]]:
    """Register an optimizer class under the name users write in `:optimizer`."""

    def register(cls: type[Optimizer]) -> type[Optimizer]:
        cls.name = name
        OPTIMIZERS[name] = cls
        return cls

    return register


class Optimizer:
    """Base: option checking and state (de)serialization.

    Parameters
    ----------
    shapes
        Parameter name -> shape.
    decay
        Parameter name -> whether weight decay applies to it.
    options
        The options as written (``lr``, ``weight-decay``, ...).
    where
        The span or name reported in errors.
    xp
        The arrays' namespace (`sexpgpu.devices.arrays.NUMPY` by default).
    """

    name = ""
    defaults: ClassVar[Mapping[str, Any]] = {}
    moments: ClassVar[tuple[str, ...]] = ()
    # Whether `queue` reads every per-step number from `ArrayOps.scalars`, so
    # that the queued half can be captured once and replayed.
    replayable: ClassVar[bool] = False

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        decay: Mapping[str, bool],
        options: Mapping[str, Any],
        where: Any = None,
        xp: ArrayOps = NUMPY,
    ) -> None:
        self.xp = xp
        options = {k.replace("-", "_"): v for k, v in options.items()}
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise SexpgpuError(
                "E-TRAIN-001",
                f"{self.name}: unknown option :{unknown[0].replace('_', '-')}",
                where,
                hint=f"{self.name} takes "
                + ", ".join(":" + k.replace("_", "-") for k in self.defaults),
            )
        self.options = {**self.defaults, **options}
        self.decay = dict(decay)
        self.steps = 0
        self.state: dict[str, Arrays] = {
            m: {k: xp.zeros(s) for k, s in shapes.items()} for m in self.moments
        }

    @property
    def lr(self) -> float:
        """The peak learning rate (the schedule scales it)."""
        return float(self.options["lr"])

    def step(self, params: Arrays, grads: Mapping[str, Any], lr: float, scale: Any = None) -> None:
        """Update `params` in place with `grads` (times `scale`) at learning rate `lr`.

        `scale` is None or the clipping factor (`ArrayOps.clip_scale`, maybe
        a device scalar): an optimizer may fold it into its own kernels
        instead of a pass over the gradients.
        """
        self.advance(lr)
        self.queue(params, grads, scale)

    def advance(self, lr: float) -> None:
        """The host's half of a step: count it and set its numbers (learning rate `lr`)."""
        raise NotImplementedError

    def queue(self, params: Arrays, grads: Mapping[str, Any], scale: Any = None) -> None:
        """The device's half of the step `advance` set: the arithmetic, in place."""
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

    defaults: ClassVar[Mapping[str, Any]] = {"lr": 0.01, "momentum": 0.0, "nesterov": False}
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

    defaults: ClassVar[Mapping[str, Any]] = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
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
    """The optimizer an `OptimizerSpec` (``name``, ``options``, ``span``) names, over `xp`."""
    if spec.name not in OPTIMIZERS:
        raise SexpgpuError(
            "E-TRAIN-001",
            f"unknown optimizer `{spec.name}`",
            getattr(spec, "span", None),
            hint=f"use one of {', '.join(sorted(OPTIMIZERS))}",
        )
    cls = OPTIMIZERS[spec.name]
    return cls(shapes, decay, dict(spec.options), getattr(spec, "span", None), xp)


def global_norm(grads: Mapping[str, Any], xp: ArrayOps = NUMPY) -> float:
    """The 2-norm of all gradients together, accumulated in float64."""
    return float(xp.norm(list(grads.values())))


def clip_by_global_norm(grads: dict[str, Any], max_norm: float, xp: ArrayOps = NUMPY) -> float:
    """Scale `grads` in place so their global norm is at most `max_norm` (`clip_factor`).

    Returns the norm before clipping.
    """
    norm = global_norm(grads, xp)
    scale = clip_factor(norm, max_norm)
    if scale is not None:
        xp.multiply(list(grads.values()), scale)
    return norm


def peak_lr(spec: Any) -> float:
    """The learning rate an `OptimizerSpec` names (before the schedule scales it)."""
    return make_optimizer(spec, {}, {}).lr


def moment_count(spec: Any) -> int:
    """Arrays per parameter the optimizer `spec` names keeps (2 for adamw; 0 if unknown)."""
    cls = OPTIMIZERS.get(spec.name)
    return len(cls.moments) if cls is not None else 0
