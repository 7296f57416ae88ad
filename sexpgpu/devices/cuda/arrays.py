"""`ArrayOps` on PyTorch tensors of one device (see `sexpgpu.devices.arrays`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["TorchOps"]


class TorchOps:
    """Float32 tensors on `device`; reductions stay on the device until one host number."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    def upload(self, array: np.ndarray) -> torch.Tensor:
        # np.array copies, so the tensor owns its memory on the CPU device too.
        return torch.from_numpy(np.array(array, np.float32)).to(self.device)

    def download(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().to("cpu", copy=True).numpy()

    def sqrt(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)

    def sum_of_squares(self, xs: Sequence[torch.Tensor]) -> float:
        if not xs:
            return 0.0
        # Every tensor's norm in one multi-tensor kernel, their squares summed in
        # f64, one transfer (a launch per tensor made the step wait on the host).
        norms = torch.stack(torch._foreach_norm(list(xs))).double()
        return float(torch.sum(norms * norms))

    def argmax_hits(self, output: torch.Tensor, target: np.ndarray) -> int:
        truth = torch.from_numpy(np.asarray(target, np.int64)).to(output.device)
        return int(torch.sum(torch.argmax(output, dim=-1) == truth))
