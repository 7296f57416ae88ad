"""Cross-entropy and its gradient in one kernel: ``sexpgpu::xent_with_grad``.

In a training step the gradient's only other operand, each row's share of
the loss's gradient (``1/rows`` for a mean), is known before the forward
runs, so the executor asks for both at once (`sexpgpu.devices.cuda.executor`).
Apart, the forward reduces the ``[rows vocab]`` logits to their
log-sum-exp and the gradient makes a pass of its own over them; here one
kernel takes a row at a time: a running maximum and sum of exponentials
over the row, then the row read again for the gradient, written once
(1.2 ms against Inductor's 1.75 ms for GPT-2 small's head at batch 16 on an
H200, `dev/xent_sweep.py`):

    loss[r] = logsumexp(x[r]) - x[r, t[r]]
    grad[r] = g[r] * (exp(x[r] - logsumexp(x[r])) - onehot(t[r]))

in f32 whatever the logits' type, the gradient rounded once to `grad_dtype`.

It is a PyTorch custom op, so traces (``make_fx``) and Inductor keep it as
one call: on a GPU it launches the Triton kernel of `xent_kernel`; on the
CPU (the fused path's tests) it is the same arithmetic in torch.
"""

from __future__ import annotations

import torch

from sexpgpu.devices.cuda.triton_support import available, kernel

__all__ = ["BLOCK", "WARPS", "launch", "xent_loss", "xent_with_grad", "xent_with_grad_over"]

# Logits a load and warps a row, the fastest measured on an H200 at GPT-2's
# vocabulary (dev/xent_sweep.py; benches/README.md has the sweep).
BLOCK = 4096
WARPS = 4


def _rows(logits: torch.Tensor) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


@torch.library.custom_op("sexpgpu::xent_with_grad", mutates_args=())
def xent_with_grad(
    logits: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, grad_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the per-row loss, f32 or f64; the gradient, in `grad_dtype`) of 2-D logits."""
    return _in_torch(logits, ids, g, grad_dtype)


@xent_with_grad.register_fake
def _(logits, ids, g, grad_dtype):
    loss = logits.new_empty(logits.shape[:1], dtype=_wide(logits.dtype))
    return loss, logits.new_empty(logits.shape, dtype=grad_dtype)


@xent_with_grad.register_kernel("cuda")
def _(logits, ids, g, grad_dtype):
    if logits.dtype == torch.float64 or not available(logits.device):
        return _in_torch(logits, ids, g, grad_dtype)
    loss = torch.empty(logits.shape[:1], dtype=torch.float32, device=logits.device)
    grad = torch.empty(logits.shape, dtype=grad_dtype, device=logits.device)
    launch(_rows(logits), ids, g, loss, grad)
    return loss, grad


@torch.library.custom_op("sexpgpu::xent_with_grad_over", mutates_args=("logits",))
def xent_with_grad_over(logits: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The per-row loss of 2-D `logits` (f32 or f64); the gradient is written over them.

    For logits nothing reads after the loss: the step holds one ``[rows
    vocab]`` buffer where `xent_with_grad` holds two (1.5 GiB at GPT-2
    small's head, batch 16). Each row is read whole before its gradient is
    written, so the kernel is the same, its output its input.
    """
    return _over_in_torch(logits, ids, g)


def _over_in_torch(logits: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    loss, grad = _in_torch(logits, ids, g, logits.dtype)
    logits.copy_(grad)
    return loss


@xent_with_grad_over.register_fake
def _(logits, ids, g):
    return logits.new_empty(logits.shape[:1], dtype=_wide(logits.dtype))


@xent_with_grad_over.register_kernel("cuda")
def _(logits, ids, g):
    if logits.dtype == torch.float64 or not available(logits.device) or logits.stride(-1) != 1:
        return _over_in_torch(logits, ids, g)
    loss = torch.empty(logits.shape[:1], dtype=torch.float32, device=logits.device)
    launch(logits, ids, g, loss, logits)
    return loss


@torch.library.custom_op("sexpgpu::xent_loss", mutates_args=())
def xent_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The per-row loss of 2-D `logits` (f32 or f64), without the gradient (an evaluation's).

    On a GPU the kernel's first pass alone: no f32 copy of the logits (two
    ``[rows vocab]`` f32 buffers in torch's calls: 6 GiB at GPT-2 small's
    head, batch 16).
    """
    return _loss_in_torch(logits, ids)


def _loss_in_torch(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return _loss_and_lse(logits, ids)[0]


@xent_loss.register_fake
def _(logits, ids):
    return logits.new_empty(logits.shape[:1], dtype=_wide(logits.dtype))


@xent_loss.register_kernel("cuda")
def _(logits, ids):
    if logits.dtype == torch.float64 or not available(logits.device):
        return _loss_in_torch(logits, ids)
    loss = torch.empty(logits.shape[:1], dtype=torch.float32, device=logits.device)
    launch(_rows(logits), ids, loss, loss, None)  # `g` unread
    return loss


def _loss_and_lse(logits, ids):
    """(the per-row loss, each row's log-sum-exp, the logits widened) in torch calls."""
    flat = logits.to(_wide(logits.dtype))
    lse = torch.logsumexp(flat, dim=-1)
    return lse - flat.gather(1, ids.long()[:, None])[:, 0], lse, flat


def _in_torch(logits, ids, g, grad_dtype):
    """The same arithmetic as the kernel, in torch calls (the CPU, and f64 logits)."""
    loss, lse, flat = _loss_and_lse(logits, ids)
    probs = (flat - lse[:, None]).exp_()
    probs[torch.arange(flat.shape[0], device=flat.device), ids.long()] -= 1
    probs.mul_(g.to(probs.dtype)[:, None])
    return loss, probs.to(grad_dtype)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def launch(
    logits: torch.Tensor,
    ids: torch.Tensor,
    g: torch.Tensor,
    loss: torch.Tensor,
    grad: torch.Tensor | None,
) -> None:
    """Run the kernel: `loss` ``[rows]`` f32 and `grad` (contiguous rows) from 2-D `logits`.

    `g` is one value per row and may be a broadcast (stride 0); without
    `grad` the kernel makes the loss alone (`g` is not read).
    """
    import triton  # where the kernel runs, Triton is

    rows, vocab = logits.shape
    if rows == 0:
        return
    out = loss if grad is None else grad  # not written without the gradient
    assert logits.stride(-1) == 1 and out.stride(-1) == 1
    kernel("xent_kernel", "xent_rows_kernel")[(rows,)](
        logits, logits.stride(0), ids, g, g.stride(0), loss, out, out.stride(0), vocab,
        BLOCK=min(BLOCK, triton.next_power_of_2(vocab)), num_warps=WARPS,
        WITH_GRAD=grad is not None,
    )  # fmt: skip
