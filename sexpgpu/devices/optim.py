"""Optimizers: `sgd`, `adamw` and `muon` on any device's arrays, and the global norm.

An optimizer holds its options, its step count and its moments; what a
step does to the arrays is its update rule, looked up in the table keyed by
optimizer and backend (`sexpgpu.devices.update_rules`; the NumPy rules of
`sexpgpu.devices.update_numpy` are the reference). Every number that
changes per step reaches the rule through the stream's scalars
(`sexpgpu.devices.stream`), so any optimizer's update can be captured once
and replayed on a GPU.

`sgd` and `adamw` follow PyTorch's update rules (``torch.optim.SGD`` with
dampening 0 and ``torch.optim.AdamW``), so a run and the same model written
in PyTorch trace the same losses; `muon` follows its authors' published
description (`Muon`). Parameters are updated in place, in float32. Weight
decay is decoupled (AdamW) and skips every parameter whose ``decay`` is
False (the vectors: biases and norm gains).

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

from sexpgpu.devices import update_numpy  # noqa: F401  (registers the reference rules)
from sexpgpu.devices.arrays import NUMPY, ArrayOps
from sexpgpu.devices.stream import HostStream, Stream
from sexpgpu.devices.update_rules import Update, rule_for

__all__ = [
    "OPTIMIZERS",
    "AdamW",
    "Muon",
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
    """Base: the step's numbers, the moments and their (de)serialization.

    Parameters
    ----------
    shapes
        Parameter name -> shape.
    decay
        Parameter name -> whether weight decay applies to it.
    options
        Every option, defaults filled in by the language (``lr``, ``weight_decay``, ...).
    xp, stream
        The backend's arrays and stream (NumPy's and the host's by default).
    hidden
        Parameter name -> whether it is a hidden weight matrix
        (`sexpgpu.ir.compile.hidden_matrices`); None: every parameter of
        two axes.
    """

    name = ""
    moments: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        decay: Mapping[str, bool],
        options: Mapping[str, Any],
        xp: ArrayOps = NUMPY,
        stream: Stream | None = None,
        hidden: Mapping[str, bool] | None = None,
    ) -> None:
        self.xp = xp
        self.stream = stream if stream is not None else HostStream()
        self.options = dict(options)
        self.decay = dict(decay)
        if hidden is None:
            hidden = {k: len(s) == 2 for k, s in shapes.items()}
        self.hidden = {k: bool(hidden.get(k, False)) for k in shapes}
        self.steps = 0
        self.state: dict[str, Arrays] = {
            m: {k: xp.zeros(s) for k, s in shapes.items() if self.covers(m, k)}
            for m in self.moments
        }
        self._rule = rule_for(self.name, xp.backends)
        self._keep: dict[str, Any] = {}  # the rule's, from step to step
        self._numbers: dict[str, Any] = {}

    @classmethod
    def arrays_per_param(cls) -> int:
        """The most moment arrays one parameter has (what the memory plan counts)."""
        return len(cls.moments)

    def covers(self, moment: str, key: str) -> bool:
        """Whether the parameter `key` has the moment `moment` (all do, unless overridden)."""
        return True

    def numbers(self, lr: float) -> dict[str, float]:
        """The host numbers of the step just counted, at learning rate `lr` (the schedule's)."""
        return {"lr": lr, "step": float(self.steps)}

    def advance(self, lr: float) -> None:
        """The host's half of a step: count it and refill its scalars (learning rate `lr`)."""
        self.steps += 1
        self._numbers = self.stream.scalars(self.name, **self.numbers(lr))

    def queue(self, params: Arrays, grads: Mapping[str, Any], scale: Any = None) -> None:
        """The device's half of the step `advance` set: the update rule, in place.

        `scale` is None or what the gradients are multiplied by (the clipping
        factor over the microbatches; maybe a device scalar): a rule may fold
        it into its own kernels instead of a pass over the gradients. Nothing
        here reads the host but the options, so a backend may capture it.
        """
        keys = list(params)
        update = Update(
            params=[params[k] for k in keys],
            grads=[grads[k] for k in keys],
            moments={m: [arrays.get(k) for k in keys] for m, arrays in self.state.items()},
            decay=[bool(self.decay.get(k, True)) for k in keys],
            hidden=[self.hidden.get(k, False) for k in keys],
            numbers=self._numbers,
            scale=scale,
            options=self.options,
            xp=self.xp,
            stream=self.stream,
            keep=self._keep,
        )
        self._rule(update)

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
    """Stochastic gradient descent with optional (Nesterov) momentum, as ``torch.optim.SGD``.

    Per parameter with gradient g (``buf`` starts at zero, so its first value is g)::

        buf <- mu buf + g                                  (when mu is not 0)
        p <- p - lr (g + mu buf)  (nesterov)  or  p - lr buf  (p - lr g when mu is 0)
    """

    moments: ClassVar[tuple[str, ...]] = ("momentum",)

    def numbers(self, lr: float) -> dict[str, float]:
        return {"lr": lr}


@optimizer("adamw")
class AdamW(Optimizer):
    """Adam with decoupled weight decay and bias correction, as ``torch.optim.AdamW``.

    Per parameter with gradient g at step t (1-based)::

        p <- p * (1 - lr * wd)                  (only where decay is True)
        m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2
        p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    """

    moments: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")


@optimizer("muon")
class Muon(Optimizer):
    """Momentum orthogonalized by Newton-Schulz (Muon) on hidden matrices; AdamW on the rest.

    After Keller Jordan et al.'s description of Muon in modded-nanogpt
    ("Muon: An optimizer for hidden layers in neural networks", 2024). Per
    hidden weight matrix W of shape ``(in, out)`` with gradient g::

        buf <- mu buf + g ;  u <- g + mu buf  (nesterov)  or  buf
        O <- NS(u)                  (about the orthogonal factor U V^T of u = U S V^T)
        W <- W * (1 - lr * wd) - lr * sqrt(max(1, out / in)) * O

    NS is ``ns_steps`` (5) steps of the quintic iteration
    ``X <- a X + b (X X^T) X + c (X X^T)^2 X`` from ``u / ||u||_F`` with
    ``(a, b, c) = (3.4445, -4.7750, 2.0315)``, in bf16 on a GPU (as its
    authors run it) and float32 elsewhere. Every other parameter (vectors,
    embeddings, the head: `sexpgpu.ir.compile.hidden_matrices`) takes
    `AdamW`'s step with ``adamw_lr``, ``betas``, ``eps`` and ``weight_decay``
    (decay where ``decay`` holds). The schedule scales both learning rates
    by the same factor.
    """

    moments: ClassVar[tuple[str, ...]] = ("momentum", "exp_avg", "exp_avg_sq")

    @classmethod
    def arrays_per_param(cls) -> int:
        return 2  # a matrix keeps momentum, any other parameter AdamW's two moments

    def covers(self, moment: str, key: str) -> bool:
        return self.hidden[key] is (moment == "momentum")

    def numbers(self, lr: float) -> dict[str, float]:
        ratio = float(self.options["adamw_lr"]) / float(self.options["lr"])
        return {"lr": lr, "adamw_lr": lr * ratio, "step": float(self.steps)}


def make_optimizer(
    spec: Any,
    shapes: Mapping[str, tuple[int, ...]],
    decay: Mapping[str, bool],
    xp: ArrayOps = NUMPY,
    stream: Stream | None = None,
    hidden: Mapping[str, bool] | None = None,
) -> Optimizer:
    """The optimizer an `OptimizerSpec` (``name``, ``options``) names, over `xp` and `stream`."""
    return OPTIMIZERS[spec.name](shapes, decay, spec.options, xp, stream, hidden)


def global_norm(grads: Mapping[str, Any], xp: ArrayOps = NUMPY) -> float:
    """The 2-norm of all gradients together, accumulated in float64."""
    return float(xp.norm(list(grads.values())))


def moment_count(name: str) -> int:
    """The most arrays a parameter keeps under the optimizer `name` (2 for adamw)."""
    return OPTIMIZERS[name].arrays_per_param()
