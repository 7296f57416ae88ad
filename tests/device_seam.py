"""The tests' one seam into device choice: the registry `sexpgpu.devices.base.DEVICES`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sexpgpu.devices.base import DEVICES


@contextmanager
def device_named(name: str, device: Any) -> Iterator[None]:
    """While the block runs, the device users call `name` is `device` (None: the real one).

    ``device_named("cpu", CudaDevice("cpu"))`` runs a command or a run, as a
    user would start it on ``cpu``, through the cuda lowering on PyTorch's
    CPU device.
    """
    saved = DEVICES[name]
    if device is not None:
        DEVICES[name] = lambda: device
    try:
        yield
    finally:
        DEVICES[name] = saved
