"""The update rules on NumPy arrays: the cpu device's, and the reference of every other.

Each follows its paper and PyTorch's implementation where one exists, in
float32, in place; `sexpgpu.devices.optim` documents the formulas and the
options. Other backends' rules (`sexpgpu.devices.cuda.update_torch`,
`sexpgpu.devices.cuda.adamw`) are tested against these.
"""

from __future__ import annotations

import math

import numpy as np

from sexpgpu.devices.update_rules import Update, update_rule

__all__ = ["NS_COEFFICIENTS", "adamw", "muon", "newton_schulz", "sgd"]

# Muon's quintic iteration X <- a X + b (X X^T) X + c (X X^T)^2 X: the published
# coefficients, chosen for the steepest rise of small singular values that
# bf16 arithmetic tolerates (they land in about [0.7, 1.2], not at 1).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def _scaled(update: Update) -> None:
    """The gradients times `update.scale`, in place (they are the step's own buffers)."""
    if update.scale is not None:
        update.xp.multiply(list(update.grads), update.scale)


@update_rule("sgd", "numpy")
def sgd(update: Update) -> None:
    """``torch.optim.SGD`` with dampening 0 (see `sexpgpu.devices.optim.Sgd`)."""
    _scaled(update)
    mu, nesterov = float(update.options["momentum"]), bool(update.options["nesterov"])
    lr = update.numbers["lr"]
    for p, g, buf in zip(update.params, update.grads, update.moments["momentum"], strict=True):
        if mu:
            buf *= mu
            buf += g  # first step: buf = g, as torch
            g = g + mu * buf if nesterov else buf
        p -= lr * g


@update_rule("adamw", "numpy")
def adamw(update: Update) -> None:
    """``torch.optim.AdamW``, decay where `Update.decay` holds (`sexpgpu.devices.optim.AdamW`)."""
    _scaled(update)
    b1, b2 = (float(b) for b in update.options["betas"])
    eps, wd = float(update.options["eps"]), float(update.options["weight_decay"])
    lr, step = update.numbers["lr"], update.numbers["step"]
    step_size = lr / (1 - b1**step)
    root_bc2 = math.sqrt(1 - b2**step)
    m, v = update.moments["exp_avg"], update.moments["exp_avg_sq"]
    for p, g, mk, vk, decays in zip(update.params, update.grads, m, v, update.decay, strict=True):
        if wd and decays:
            p *= 1 - lr * wd
        mk += (g - mk) * (1 - b1)  # torch's lerp
        vk *= b2
        vk += (1 - b2) * g * g
        p -= step_size * (mk / (np.sqrt(vk) / root_bc2 + eps))


def newton_schulz(g: np.ndarray, steps: int) -> np.ndarray:
    """About the orthogonal polar factor ``U V^T`` of ``g = U S V^T`` (2-D), in f32.

    `steps` quintic iterations (`NS_COEFFICIENTS`) from ``g / ||g||_F``, on
    the wide orientation (``X X^T`` the smaller Gram matrix).
    """
    a, b, c = NS_COEFFICIENTS
    x = g / np.float32(np.linalg.norm(g) + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return np.ascontiguousarray(x.T if tall else x, np.float32)


def muon_scale(shape: tuple[int, ...]) -> float:
    """``sqrt(max(1, fan_out / fan_in))`` of an ``(in, out)`` weight: Muon's step size per shape."""
    return math.sqrt(max(1.0, shape[1] / shape[0]))


@update_rule("muon", "numpy")
def muon(update: Update) -> None:
    """Muon on the hidden matrices, AdamW on the rest (see `sexpgpu.devices.optim.Muon`)."""
    rest = [not h for h in update.hidden]
    adamw(update.select(rest, lr=update.numbers["adamw_lr"]))
    matrices = update.select(update.hidden)
    _scaled(matrices)
    mu, nesterov = float(update.options["momentum"]), bool(update.options["nesterov"])
    steps, wd = int(update.options["ns_steps"]), float(update.options["weight_decay"])
    lr = update.numbers["lr"]
    moments = matrices.moments["momentum"]
    for p, g, buf in zip(matrices.params, matrices.grads, moments, strict=True):
        buf *= mu
        buf += g
        u = g + mu * buf if nesterov else buf
        if wd:
            p *= 1 - lr * wd
        p -= (lr * muon_scale(p.shape)) * newton_schulz(u, steps)
