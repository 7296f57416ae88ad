"""`ArrayOps` on PyTorch tensors of one device (see `sexpgpu.devices.arrays`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# The modules of the update rules (one Triton launch, PyTorch's kernels) register them.
from sexpgpu.devices.cuda import adamw, triton_support, update_torch  # noqa: F401
from sexpgpu.devices.cuda.param_copies import ParamCopies

__all__ = ["TorchOps"]


class TorchOps:
    """Float32 tensors on `device`; reductions stay on the device until one host number.

    `copies` are the bf16 copies of parameters a fused step reads: the
    update rules keep them current (`sexpgpu.devices.cuda.param_copies`).
    """

    def __init__(self, device: torch.device, copies: ParamCopies | None = None) -> None:
        self.device = torch.device(device)
        self.copies = copies if copies is not None else ParamCopies()
        # One Triton launch per update on a GPU; PyTorch's kernels elsewhere and as the fallback.
        one_launch = self.device.type == "cuda" and triton_support.available(self.device)
        self.backends = ("triton", "torch") if one_launch else ("torch",)

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    def upload(self, array: np.ndarray) -> torch.Tensor:
        # np.array copies, so the tensor owns its memory on the CPU device too.
        return torch.from_numpy(np.array(array, np.float32)).to(self.device)

    def download(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().to("cpu", copy=True).numpy()

    def norm(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        # On the device: a launch per tensor, or a host read, made the step wait on the host.
        return torch.sqrt(torch.sum(self._squares(xs)))

    def _squares(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        if not xs:
            return torch.zeros((0,), dtype=torch.float64, device=self.device)
        # Every tensor's norm in one multi-tensor kernel, their squares in f64.
        norms = torch.stack(torch._foreach_norm(list(xs))).double()
        return norms * norms

    def square_norms(self, xs: Sequence[torch.Tensor]) -> np.ndarray:
        return self.download(self._squares(xs))

    def norm_from(self, squares: np.ndarray) -> torch.Tensor:
        squares = torch.from_numpy(np.asarray(squares, np.float64)).to(self.device)
        return torch.sqrt(torch.sum(squares))

    def clip_scale(self, norm: torch.Tensor, max_norm: float | None) -> torch.Tensor | None:
        # On the device: the update is queued without waiting for the norm.
        if max_norm is None:
            return None
        return torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0).float()

    def multiply(self, xs: Sequence[torch.Tensor], factor: float | torch.Tensor) -> None:
        if xs:
            torch._foreach_mul_(list(xs), factor)

    def argmax_hits(self, output: torch.Tensor, target: np.ndarray) -> int:
        truth = torch.from_numpy(np.asarray(target, np.int64)).to(output.device)
        return int(torch.sum(torch.argmax(output, dim=-1) == truth))
