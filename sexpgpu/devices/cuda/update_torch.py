"""The update rules on PyTorch tensors (any device of PyTorch's), against `update_numpy`.

Each rule is the NumPy reference's arithmetic (`sexpgpu.devices.update_numpy`)
in PyTorch's multi-tensor kernels, reading its step's numbers from the
stream's device scalars, so the whole update can be captured as one CUDA
graph (`sexpgpu.devices.cuda.replay`). Each keeps the bf16 copies of the
parameters it writes current (`sexpgpu.devices.cuda.param_copies`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from sexpgpu.devices.update_numpy import NS_COEFFICIENTS, muon_scale
from sexpgpu.devices.update_rules import Update, rule_for, update_rule

__all__ = ["adamw", "in_layout", "largest_copy", "muon", "newton_schulz", "sgd"]


def largest_copy(shapes: Sequence[tuple[int, ...]]) -> int:
    """The bytes of an f32 copy of the largest parameter (`in_layout`'s, one at a time)."""
    return 4 * max((math.prod(s) for s in shapes), default=0)


def _muon_scratch(shapes: Sequence[tuple[int, ...]]) -> int:
    """Nesterov's sums of every matrix's gradient, then one shape's matrices orthogonalized.

    Per matrix of that shape: its f32 stack and normalized copy, bf16 iterates
    and products, its f32 result (16 bytes an element), and the bf16 Gram
    matrices (three of the smaller side squared). Plus AdamW's for the rest.
    """
    matrices = Counter(s for s in shapes if len(s) == 2)
    sums = 4 * sum(math.prod(s) * n for s, n in matrices.items())
    group = max((n * (16 * math.prod(s) + 6 * min(s) ** 2) for s, n in matrices.items()), default=0)
    return sums + group + largest_copy(shapes)


def in_layout(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient in its parameter's layout (strides), copied where it is not.

    Op by op, a product's gradient can come out transposed (a tied embedding's).
    """
    return [
        g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
        for p, g in zip(params, grads, strict=True)
    ]


def _scaled(update: Update) -> list[torch.Tensor]:
    """The gradients in their parameters' layouts, times `update.scale` (in place)."""
    grads = in_layout(update.params, update.grads)
    if update.scale is not None and grads:
        torch._foreach_mul_(grads, update.scale)
    return grads


# The momentum's sums with the gradient, beside the gradient's copy (`in_layout`).
@update_rule("sgd", "torch", scratch=lambda shapes: 3 * largest_copy(shapes))
def sgd(update: Update) -> None:
    grads = _scaled(update)
    mu, nesterov = float(update.options["momentum"]), bool(update.options["nesterov"])
    lr = update.numbers["lr"]
    for p, g, buf in zip(update.params, grads, update.moments["momentum"], strict=True):
        if mu:
            buf.mul_(mu).add_(g)
            g = g + mu * buf if nesterov else buf
        p.sub_(lr * g)
    update.xp.copies.refresh(update.params)


@update_rule("adamw", "torch", scratch=largest_copy)
def adamw(update: Update) -> None:
    # PyTorch's fused multi-tensor AdamW: a few kernels for all, its step count and
    # learning rate read from the device scalars; decayed and plain parameters apart.
    wd = float(update.options["weight_decay"])
    b1, b2 = (float(b) for b in update.options["betas"])
    for decays in (True, False):
        part = update.select([bool(wd and d) is decays for d in update.decay])
        if not part.params:
            continue
        torch._fused_adamw_(
            list(part.params),
            in_layout(part.params, part.grads),
            list(part.moments["exp_avg"]),
            list(part.moments["exp_avg_sq"]),
            [],
            [part.numbers["step"]] * len(part.params),
            lr=part.numbers["lr"],
            beta1=b1,
            beta2=b2,
            weight_decay=wd if decays else 0.0,
            eps=float(update.options["eps"]),
            amsgrad=False,
            maximize=False,
            grad_scale=_divisor(part.scale, part.params[0].device),
        )
        update.xp.copies.refresh(part.params)


def _divisor(scale: Any, device: torch.device) -> torch.Tensor | None:
    """What ``_fused_adamw_`` divides each gradient by as it reads it: ``1 / scale``."""
    if isinstance(scale, torch.Tensor):
        return torch.reciprocal(scale.double()).float()
    return None if scale is None else torch.full((), 1.0 / scale, device=device)


def newton_schulz(u: torch.Tensor, steps: int) -> torch.Tensor:
    """`sexpgpu.devices.update_numpy.newton_schulz` of each matrix of ``(n, r, c)`` `u`.

    In bf16 on a GPU (tensor cores; the coefficients are chosen to tolerate
    it), in float32 elsewhere; the result is float32.
    """
    a, b, c = NS_COEFFICIENTS
    x = u / (torch.linalg.vector_norm(u, dim=(-2, -1), keepdim=True) + 1e-7)
    if u.device.type == "cuda":
        x = x.to(torch.bfloat16)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x.mT if tall else x).float()


@update_rule("muon", "torch", scratch=_muon_scratch)
def muon(update: Update) -> None:
    rule_for("adamw", update.xp.backends)(
        update.select([not h for h in update.hidden], lr=update.numbers["adamw_lr"])
    )
    matrices = update.select(update.hidden)
    if not matrices.params:
        return
    grads = _scaled(matrices)
    mu, nesterov = float(update.options["momentum"]), bool(update.options["nesterov"])
    steps, wd = int(update.options["ns_steps"]), float(update.options["weight_decay"])
    lr = matrices.numbers["lr"]
    bufs = list(matrices.moments["momentum"])
    torch._foreach_mul_(bufs, mu)
    torch._foreach_add_(bufs, grads)
    us = torch._foreach_add(grads, bufs, alpha=mu) if nesterov else bufs
    # Matrices of one shape orthogonalized together, as one batch of products.
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(matrices.params):
        by_shape.setdefault(tuple(p.shape), []).append(i)
    for shape, which in by_shape.items():
        ortho = newton_schulz(torch.stack([us[i] for i in which]), steps)
        step = lr * muon_scale(shape)
        for i, o in zip(which, ortho, strict=True):
            p = matrices.params[i]
            if wd:
                p.mul_(1 - lr * wd)
            p.sub_(step * o)
    update.xp.copies.refresh(matrices.params)
