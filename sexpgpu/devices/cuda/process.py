"""The process-wide settings of the cuda device, made once when it opens.

PyTorch keeps its numerics switches per process, not per call, so the
device sets them once (`open_settings`) rather than every graph on every
call:

- f32 products keep full precision: no TF32 (which would round f32
  operands to 10 mantissa bits). bf16 products keep PyTorch's default,
  which lets cuBLAS sum split-K partial products in bf16: forbidding it
  (measured on an H200) sends every bf16 GEMM of GPT-2 small to
  Turing-era kernels at about half the speed.

Compile workers take the same settings from the parent
(`sexpgpu.devices.cuda.compile_worker.settings`), so Inductor's cache keys
agree.
"""

from __future__ import annotations

import torch

__all__ = ["open_settings"]


def open_settings() -> None:
    """Set the process's numerics switches for the cuda device (see the module docstring)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
