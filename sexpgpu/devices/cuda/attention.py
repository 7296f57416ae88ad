"""Fused attention through PyTorch's scaled-dot-product kernels, forward and backward.

The IR's ``attention`` takes ``q`` of shape ``[.. H seq dim]`` and ``k``,
``v`` of ``[.. K seq dim]``, K dividing H (grouped-query attention); the
kernels want ``[batch heads seq dim]``, so leading axes are folded into
four. The fused kernels of `GROUPED` take the K key/value heads as they are
(PyTorch's ``enable_gqa``: query head ``h`` reads key/value head ``h //
(H / K)``); the others get them repeated for their groups, and their key
and value gradients are summed back over each group in f32. The forward
returns the output and an
`AttentionAux`: what the matching backward needs (the output and the
log-sum-exp of every query row, plus the kernel's own bookkeeping), so the
gradient never recomputes the forward.

Backends, by the name the lowering report prints:

=============  ================================================================
flash          ``aten._scaled_dot_product_flash_attention`` (CUDA, bf16/f16)
efficient      ``aten._scaled_dot_product_efficient_attention`` (CUDA, f32 too)
cudnn          ``aten._scaled_dot_product_cudnn_attention`` (CUDA, bf16/f16)
flash-cpu      ``aten._scaled_dot_product_flash_attention_for_cpu``
math           plain torch ops, f32 arithmetic (the fallback; [seq seq] weights)
=============  ================================================================

A backend that refuses the call (an unsupported head size, a changed
private signature) falls back to the next that may take it (``cudnn`` to
``flash``, then ``math``); the aux then names the one that ran, and the
report says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "BACKENDS",
    "GROUPED",
    "AttentionAux",
    "sdpa_backward",
    "sdpa_forward",
    "select_sdpa_backend",
]

log = logging.getLogger(__name__)

BACKENDS = ("flash", "efficient", "cudnn", "flash-cpu", "math")
# Backends whose kernels read fewer key/value heads than query heads as they are.
GROUPED = frozenset({"flash", "cudnn", "flash-cpu"})
_HALF = (torch.bfloat16, torch.float16)
# What a refusing kernel raises: argument checks, missing kernels, changed signatures.
_REFUSALS = (RuntimeError, NotImplementedError, TypeError, AttributeError, ValueError)


@dataclass
class AttentionAux:
    """What attention's backward needs from its forward.

    Attributes
    ----------
    backend
        The backend that ran the forward (the backward uses the same).
    out
        The forward's output in the kernel's 4-D layout.
    saved
        The kernel's extra results the backward takes (log-sum-exp first).
    fallback
        Why the chosen backend was not used, when it was not.
    """

    backend: str
    out: torch.Tensor
    saved: tuple[Any, ...]
    fallback: str | None = field(default=None)


def select_sdpa_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The attention backend that runs on `device` for `dtype` (default bf16).

    CUDA, bf16/f16: ``cudnn`` on Hopper (compute capability 9.x; its kernels
    took the GPT-2 small step's attention from 6.0 to 4.3 ms on an H200 against
    ``flash``, benches/README.md) unless runs are deterministic, ``flash``
    on other GPUs of capability 8.0 or newer; f32: ``efficient``; else
    ``math``. Each only where PyTorch has it enabled. CPU: ``flash-cpu``
    when this torch has it, else ``math``.
    """
    dtype = torch.bfloat16 if dtype is None else dtype
    device = torch.device(device)
    if device.type == "cpu":
        has = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        return "flash-cpu" if has else "math"
    if device.type != "cuda":
        return "math"
    major, _ = torch.cuda.get_device_capability(device)
    # cuDNN's backward has no deterministic mode; flash's has (dq summed in order).
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    cudnn = cudnn and not torch.are_deterministic_algorithms_enabled()
    if dtype in _HALF and major == 9 and cudnn:
        return "cudnn"
    if dtype in _HALF and major >= 8 and torch.backends.cuda.flash_sdp_enabled():
        return "flash"
    if torch.backends.cuda.mem_efficient_sdp_enabled():
        return "efficient"
    return "math"


def _four_d(x: torch.Tensor) -> torch.Tensor:
    """``[.. H S D]`` as ``[B H S D]`` with the last axis contiguous (a view where possible)."""
    if x.dim() < 4:
        x = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    elif x.dim() > 4:
        x = x.reshape(-1, *x.shape[-3:])
    return x if x.stride(-1) == 1 else x.contiguous()


def _heads_for(backend: str, q: torch.Tensor, *kv: torch.Tensor) -> list[torch.Tensor]:
    """`kv` (``[B K S D]``) as `backend` takes them: as they are, or repeated to q's heads."""
    heads = q.shape[1]
    if backend in GROUPED:
        return list(kv)
    return [x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], 1) for x in kv]


def _group_sum(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A key or value gradient ``[B H S D]`` summed over each group to `like`'s ``[B K S D]``."""
    (batch, heads), kv = x.shape[:2], like.shape[1]
    if heads == kv:
        return x
    grouped = x.reshape(batch, kv, heads // kv, *x.shape[2:])
    return grouped.sum(2, dtype=torch.promote_types(x.dtype, torch.float32)).to(x.dtype)


def _padded(x: torch.Tensor, backend: str) -> torch.Tensor:
    """`x` with its head size padded with zeros to a multiple of 8 for the CUDA kernels.

    PyTorch's public SDPA pads before calling these private kernels, which
    refuse other sizes; zeros change neither ``q k^T`` nor (once cut off) the
    output and gradients.
    """
    extra = -x.shape[-1] % 8
    if backend in ("flash", "efficient", "cudnn") and extra:
        return torch.nn.functional.pad(x, (0, extra))
    return x


def _cut(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`x` cut back to `like`'s head size and shape."""
    return x[..., : like.shape[-1]].reshape(like.shape)


def sdpa_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, backend: str
) -> tuple[torch.Tensor, AttentionAux]:
    """``softmax(q k^T * scale [+ causal mask]) v`` and what its backward needs.

    Parameters
    ----------
    q, k, v
        ``q`` is ``[.. H seq dim]``, ``k`` and ``v`` ``[.. K seq dim]`` with K
        dividing H, one dtype.
    causal
        Whether position ``i`` sees only positions ``j <= i``.
    scale
        The factor on ``q k^T``.
    backend
        One of `BACKENDS` (see `select_sdpa_backend`).
    """
    q4, k4, v4 = _four_d(q), _four_d(k), _four_d(v)
    reasons = []
    while backend != "math":
        try:
            padded = (_padded(x, backend) for x in (q4, *_heads_for(backend, q4, k4, v4)))
            out, saved = _FORWARD[backend](*padded, causal, scale)
            fallback = "; ".join(reasons) or None
            return _cut(out, q), AttentionAux(backend, out, saved, fallback)
        except torch.OutOfMemoryError:
            raise  # no refusal: the next backends hold more (math the whole score matrix)
        except _REFUSALS as error:
            reasons.append(f"{backend} refused: {str(error).splitlines()[0][:160]}")
            log.warning("attention: %s; trying %s", reasons[-1], _NEXT[backend])
            backend = _NEXT[backend]
    out, saved = _math_forward(q4, *_heads_for("math", q4, k4, v4), causal, scale)
    return out.reshape(q.shape), AttentionAux("math", out, saved, "; ".join(reasons) or None)


def sdpa_backward(
    g: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    aux: AttentionAux | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``, each in its operand's shape, as the kernel wrote them;
    the IR's ``attention-grad`` joins them on the head axis.

    `aux` is the matching forward's; without it the forward runs first
    (on `backend`) to make one. The fused kernels give each gradient its
    operand's strides, so the projections' layout comes back and reshaping
    to it copies nothing.
    """
    if aux is None:
        _, aux = sdpa_forward(q, k, v, causal, scale, backend)
    q4, k4, v4, g4 = _four_d(q), _four_d(k), _four_d(v), _four_d(g)
    if aux.backend != "math":
        try:
            wide = _heads_for(aux.backend, q4, k4, v4)
            padded = (_padded(x, aux.backend) for x in (g4, q4, *wide))
            dq, dk, dv = _BACKWARD[aux.backend](*padded, aux, causal, scale)
            dk, dv = _group_sum(_cut(dk, wide[0]), k4), _group_sum(_cut(dv, wide[1]), v4)
            return _cut(dq, q), dk.reshape(k.shape), dv.reshape(v.shape)
        except torch.OutOfMemoryError:
            raise
        except _REFUSALS as error:
            log.warning("attention backward: %s refused (%s); using math", aux.backend, error)
            aux = None
    wide = _heads_for("math", q4, k4, v4)
    if aux is None:  # the refusing backend's aux is of no use to math: its forward again
        aux = AttentionAux("math", *_math_forward(q4, *wide, causal, scale))
    dq, dk, dv = _math_backward(g4, q4, *wide, aux, causal, scale)
    dk, dv = _group_sum(dk, k4).reshape(k.shape), _group_sum(dv, v4).reshape(v.shape)
    return dq.reshape(q.shape), dk, dv


# ---------------------------------------------------------------- fused kernels


def _flash_cpu_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, (lse,)


def _flash_cpu_backward(g, q, k, v, aux, causal, scale):
    (lse,) = aux.saved
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, aux.out, lse, 0.0, causal, scale=scale
    )


def _flash_forward(q, k, v, causal, scale):
    # (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug)
    result = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return result[0], tuple(result[1:8])


def _flash_backward(g, q, k, v, aux, causal, scale):
    lse, cum_q, cum_k, max_q, max_k, rng_state, unused = aux.saved
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        g, q, k, v, aux.out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng_state, unused,
        scale=scale,
    )  # fmt: skip


def _efficient_forward(q, k, v, causal, scale):
    # (output, log_sumexp, philox_seed, philox_offset)
    result = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return result[0], tuple(result[1:4])


def _efficient_backward(g, q, k, v, aux, causal, scale):
    lse, seed, offset = aux.saved
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, None, aux.out, lse, seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale,
    )  # fmt: skip
    return grads[:3]


def _cudnn_forward(q, k, v, causal, scale):
    # (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug)
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return result[0], tuple(result[1:8])


def _cudnn_backward(g, q, k, v, aux, causal, scale):
    lse, cum_q, cum_k, max_q, max_k, seed, offset = aux.saved
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        g, q, k, v, aux.out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal,
        scale=scale,
    )  # fmt: skip


# ---------------------------------------------------------------- math fallback


def _wide(x: torch.Tensor) -> torch.Tensor:
    """`x` in the math path's arithmetic type: f64 stays, the rest is f32."""
    return x if x.dtype == torch.float64 else x.float()


def _scores(q, k, causal, scale) -> torch.Tensor:
    """``q k^T * scale`` in f32 (f64 for f64) with the causal mask applied: ``[B H S S]``."""
    s = torch.matmul(_wide(q) * scale, _wide(k).transpose(-1, -2))
    if causal:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), _wide(v)).to(q.dtype)
    return out, (lse,)


def _math_backward(g, q, k, v, aux, causal, scale):
    # w = exp(s - lse); dv = w^T g; ds = w * (g v^T - rowsum(g * out)); dq = ds k s; dk = ds^T q s
    (lse,) = aux.saved
    w = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
    g32, v32 = _wide(g), _wide(v)
    dv = torch.matmul(w.transpose(-1, -2), g32)
    ds = torch.matmul(g32, v32.transpose(-1, -2))
    ds -= (g32 * _wide(aux.out)).sum(-1, keepdim=True)
    ds *= w
    dq = torch.matmul(ds, _wide(k)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), _wide(q)) * scale
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


_FORWARD = {
    "flash": _flash_forward,
    "efficient": _efficient_forward,
    "cudnn": _cudnn_forward,
    "flash-cpu": _flash_cpu_forward,
}
# Where a refusing backend's call goes next.
_NEXT = {"cudnn": "flash", "flash": "math", "efficient": "math", "flash-cpu": "math"}
_BACKWARD = {
    "flash": _flash_backward,
    "efficient": _efficient_backward,
    "cudnn": _cudnn_backward,
    "flash-cpu": _flash_cpu_backward,
}
