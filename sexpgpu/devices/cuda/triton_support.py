"""Where sexpgpu's own Triton kernels run, and loading them on first use.

A kernel lives in a module of its own that imports Triton (``xent_kernel``,
``adamw_kernel``), imported only once a launch needs it: Triton reads its
interpreter setting (``TRITON_INTERPRET=1``, under which CI runs the
kernels on the CPU) when it is first imported.
"""

from __future__ import annotations

import importlib
import os
from functools import cache
from typing import Any

import torch

__all__ = ["available", "kernel"]


def available(device: torch.device) -> bool:
    """Whether Triton kernels run on this torch device: a GPU with Triton, or the interpreter."""
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def kernel(module: str, name: str) -> Any:
    """The jitted kernel `name` of `sexpgpu.devices.cuda.<module>`, imported on first use."""
    return getattr(importlib.import_module(f"sexpgpu.devices.cuda.{module}"), name)
