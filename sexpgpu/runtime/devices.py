"""Devices by name (``cpu:0``, ``cuda:1``) and what the host can see.

A `Device` is a plain value; nothing here opens a device. PyTorch is imported
only by the functions that ask CUDA something, and only when they are called.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sexpgpu.errors import SexpgpuError

__all__ = [
    "DEVICE_KINDS",
    "MIN_CAPABILITY",
    "Device",
    "cuda_capability",
    "parse_device",
    "require_capability",
    "torch_if_loaded",
    "visible_gpu_count",
]

# The kinds a user may name with --device or SEXPGPU_DEVICE, the first the default:
# the one table of device names. It lives here, below `devices` and `tn` (which may
# not import the language); the device registries (`sexpgpu.devices.base.DEVICES`,
# `sexpgpu.devices.collectives.LOCAL_SUMS`), the commands' --device choices and tn's
# names follow it, and tests/test_names.py holds them together.
DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda")

# The cuda device needs bf16 tensor cores and the SDPA kernels: Ampere or newer.
MIN_CAPABILITY: tuple[int, int] = (8, 0)


@dataclass(frozen=True, order=True)
class Device:
    """One device: its kind (``"cpu"`` or ``"cuda"``) and its ordinal.

    On ``cpu`` the ordinal names a simulated rank on the host; on ``cuda`` it
    is the GPU's ordinal as PyTorch counts it (after ``CUDA_VISIBLE_DEVICES``).
    """

    kind: str
    index: int = 0

    def __post_init__(self) -> None:
        assert self.kind in DEVICE_KINDS, f"unknown device kind {self.kind!r}"
        assert self.index >= 0, f"negative device ordinal {self.index}"

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def is_cuda(self) -> bool:
        """Whether this is a GPU."""
        return self.kind == "cuda"

    def torch_device(self) -> Any:
        """The matching ``torch.device`` (imports PyTorch).

        Every simulated ``cpu:N`` rank maps to PyTorch's one ``cpu`` device.
        """
        import torch

        return torch.device("cuda", self.index) if self.is_cuda else torch.device("cpu")


def parse_device(text: str | Device) -> Device:
    """A `Device` from ``"cpu"``, ``"cpu:3"``, ``"cuda"`` or ``"cuda:1"``.

    Raises
    ------
    ValueError
        When the text names no device; user input is validated earlier, by
        `sexpgpu.runtime.config`.
    """
    if isinstance(text, Device):
        return text
    kind, _, index = text.partition(":")
    if kind not in DEVICE_KINDS or (index and not index.isdigit()):
        raise ValueError(f"{text!r} is not a device: write cpu, cpu:N, cuda or cuda:N")
    return Device(kind, int(index or 0))


def torch_if_loaded() -> Any:
    """The ``torch`` module if something already imported it, else None.

    Lets code treat torch tensors and errors without importing PyTorch itself.
    """
    return sys.modules.get("torch")


def visible_gpu_count() -> int:
    """How many GPUs PyTorch sees: 0 without PyTorch or without a CUDA build."""
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())


def cuda_capability(index: int) -> tuple[int, int]:
    """The compute capability ``(major, minor)`` of GPU `index` (imports PyTorch)."""
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def require_capability(
    devices: Sequence[Device],
    capability: Callable[[int], tuple[int, int]] = cuda_capability,
) -> None:
    """Refuse GPUs below `MIN_CAPABILITY` (8.0), as the cuda device does when it opens.

    Parameters
    ----------
    devices
        The devices to open; ``cpu`` ones are skipped.
    capability
        Asks a GPU's capability (`cuda_capability`; tests pass their own).

    Raises
    ------
    SexpgpuError
        E-DEV-001 naming the first GPU below the floor.
    """
    for device in devices:
        if not device.is_cuda:
            continue
        major, minor = capability(device.index)
        if (major, minor) < MIN_CAPABILITY:
            raise SexpgpuError(
                "E-DEV-001",
                f"GPU {device.index} has compute capability {major}.{minor}; the cuda device "
                "needs 8.0 or newer (bf16 tensor cores)",
                str(device),
                hint="use an Ampere GPU or newer (A100, H100, RTX 30xx...), leave this one out "
                "of SEXPGPU_DEVICES, or use --device cpu",
            )
