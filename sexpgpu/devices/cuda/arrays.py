"""`ArrayOps` on PyTorch tensors of one device (see `sexpgpu.devices.arrays`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from sexpgpu.devices.arrays import AdamWStep
from sexpgpu.devices.cuda import adamw, triton_support
from sexpgpu.devices.cuda.param_copies import ParamCopies
from sexpgpu.devices.cuda.replay import Replay

__all__ = ["TorchOps"]


class TorchOps:
    """Float32 tensors on `device`; reductions stay on the device until one host number.

    `copies` are the bf16 copies of parameters a fused step reads: the
    update keeps them current (`sexpgpu.devices.cuda.param_copies`).
    """

    def __init__(self, device: torch.device, copies: ParamCopies | None = None) -> None:
        self.device = torch.device(device)
        self.copies = ParamCopies() if copies is None else copies
        self._scalars: dict[tuple[str, str], torch.Tensor] = {}
        self.events: list[str] = []
        self.asynchronous = self.device.type == "cuda"  # PyTorch's CPU device computes as called
        self.replay = Replay(self.device, "update", self.events)
        # AdamW in one launch on a GPU (`adamw`); PyTorch's multi-tensor kernels on the CPU.
        self._one_launch = self.device.type == "cuda" and triton_support.available(self.device)
        self._tables = adamw.Tables(evicted=self.replay.forget)

    def scalars(self, name: str, **values: float) -> dict[str, Any]:
        # Kept for the run and refilled in place, on the device's stream (no
        # host sync): a replayed update reads this step's numbers from them.
        out = {}
        for key, value in values.items():
            slot = self._scalars.get((name, key))
            if slot is None:
                slot = self._scalars[name, key] = self.zeros(())
            out[key] = slot.fill_(value)
        return out

    def replayed(
        self, key: tuple[Any, ...], arrays: Sequence[torch.Tensor], queue: Callable[[], Any]
    ) -> Any:
        # By address: a capture reads and writes its operands' memory, whichever tensors hold it.
        return self.replay((*key, *(a.data_ptr() for a in arrays)), queue)

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    def upload(self, array: np.ndarray) -> torch.Tensor:
        # np.array copies, so the tensor owns its memory on the CPU device too.
        return torch.from_numpy(np.array(array, np.float32)).to(self.device)

    def download(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().to("cpu", copy=True).numpy()

    def norm(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        if not xs:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        # Every tensor's norm in one multi-tensor kernel, their squares summed in
        # f64 on the device (a launch per tensor made the step wait on the host).
        norms = torch.stack(torch._foreach_norm(list(xs))).double()
        return torch.sqrt(torch.sum(norms * norms))

    def clip_scale(self, norm: torch.Tensor, max_norm: float | None) -> torch.Tensor | None:
        # On the device: the update is queued without waiting for the norm.
        if max_norm is None:
            return None
        return torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0).float()

    def multiply(self, xs: Sequence[torch.Tensor], factor: float | torch.Tensor) -> None:
        if xs:
            torch._foreach_mul_(list(xs), factor)

    def adamw(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        m: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor],
        step: AdamWStep,
    ) -> None:
        if not params:
            return
        # Both kernels read each gradient in its parameter's layout; op by op, a
        # product's gradient can come out transposed (a tied embedding's).
        grads = [
            g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
            for p, g in zip(params, grads, strict=True)
        ]
        if self._one_launch and all(p.is_contiguous() for p in params):
            numbers = {"lr": step.lr, "step": step.step, "grad_scale": step.grad_scale}
            on_device = {k: self._device_scalar(x) for k, x in numbers.items()}
            copies = self.copies.written_with(params)
            adamw.update(self._tables, params, grads, m, v, replace(step, **on_device), copies)
            return
        # PyTorch's fused multi-tensor AdamW: the same update, a few kernels for all,
        # its step count and learning rate read from the device scalars of `scalars`.
        steps = [step.step] * len(params)
        # The kernel divides each gradient by `grad_scale` as it reads it.
        divisor = None
        if isinstance(step.grad_scale, torch.Tensor):
            divisor = torch.reciprocal(step.grad_scale.double()).float()
        elif step.grad_scale is not None:
            divisor = torch.full((), 1.0 / step.grad_scale, device=self.device)
        torch._fused_adamw_(
            list(params),
            grads,
            list(m),
            list(v),
            [],
            steps,
            lr=step.lr,
            beta1=step.beta1,
            beta2=step.beta2,
            weight_decay=step.weight_decay,
            eps=step.eps,
            amsgrad=False,
            maximize=False,
            grad_scale=divisor,
        )
        self.copies.refresh(params)

    def _device_scalar(self, x: Any) -> torch.Tensor | None:
        """`x` (a host number, a device scalar or None) as an f32 scalar on the device."""
        if x is None or isinstance(x, torch.Tensor):
            return x if x is None else x.float()
        return torch.full((), float(x), dtype=torch.float32, device=self.device)

    def read_later(self, x: Any) -> Any:
        # A synchronous read queues its copy behind everything: the next step's too.
        if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
            return x
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return _OnItsWay(host, copied)

    def argmax_hits(self, output: torch.Tensor, target: np.ndarray) -> int:
        truth = torch.from_numpy(np.asarray(target, np.int64)).to(output.device)
        return int(torch.sum(torch.argmax(output, dim=-1) == truth))


class _OnItsWay:
    """A device scalar being copied to page-locked host memory; ``float()`` waits for the copy."""

    def __init__(self, host: torch.Tensor, copied: Any) -> None:
        self._host, self._copied = host, copied

    def __float__(self) -> float:
        self._copied.synchronize()
        return float(self._host)
