"""Memory budgets and scratch space for one sweep: `Resources` and byte strings.

A budget is a byte count or a string such as ``"36GB"`` (decimal) or
``"36GiB"`` (binary), read as ``SEXPGPU_MEMORY`` is (`sexpgpu.runtime.units`).
Budgets left unset are detected when a sweep starts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sexpgpu.runtime.memory import host_available_bytes
from sexpgpu.runtime.units import parse_bytes as parse_amount

__all__ = ["Resources", "parse_bytes", "resolve_host_budget"]

# Part of the available host memory a detected budget leaves to everything else.
_HOST_MARGIN = 0.10


def parse_bytes(value: int | str, name: str = "budget") -> int:
    """Convert a byte count or a size string to a number of bytes.

    Parameters
    ----------
    value : int or str
        A non-negative integer, or a string such as ``"36GB"`` (``36 * 10**9``)
        or ``"36GiB"`` (``36 * 2**30``) that names at least one byte; the unit
        is case-insensitive.
    name : str
        The argument's name, for error messages.

    Returns
    -------
    int
        The size in bytes.

    Raises
    ------
    TypeError
        If the value is neither an integer nor a string.
    ValueError
        If the value is negative, or a string that is not a size of one byte or more.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer | str):
        raise TypeError(
            f"Resources: {name} must be a byte count or a size string such as '36GB' "
            f"or '36GiB', got {value!r}."
        )
    if not isinstance(value, str):
        if value < 0:
            raise ValueError(f"Resources: {name} must be non-negative, got {value}.")
        return int(value)
    try:
        return parse_amount(value)
    except ValueError:
        raise ValueError(
            f"Resources: {name}={value!r} is not a size; write a number and a unit such "
            "as '36GB' (10**9 bytes) or '36GiB' (2**30 bytes)."
        ) from None


def _device_list(devices: object) -> tuple[int, ...] | None:
    """Validate ``devices``: ``None``, a positive count, or distinct non-negative ids."""
    if devices is None:
        return None
    if isinstance(devices, int | np.integer) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(
                f"Resources: devices={devices} must be a positive count or a list of "
                "device ids such as [0, 1]."
            )
        return tuple(range(int(devices)))
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise TypeError(
            f"Resources: devices must be a count or a sequence of device ids, got {devices!r}."
        )
    if not all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in devices):
        raise TypeError(f"Resources: devices must hold integer ids, got {devices!r}.")
    ids = tuple(int(d) for d in devices)
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ValueError(
            f"Resources: devices={devices!r} must be distinct non-negative ids, at least one."
        )
    return ids


@dataclass(frozen=True)
class Resources:
    """Memory budgets, scratch space and devices for one `src` call.

    Parameters
    ----------
    gpu_memory : int or str, optional
        Device memory the sweep may use per GPU (``device="gpu"``); ignored on
        the CPU. Detected when unset: the free memory less 1 GiB and 5%.
    host_memory : int or str, optional
        Host memory the sweep may use for its working set and the stored
        environments. Detected when unset: the available memory less 10%.
        Environments that fit in neither go to ``scratch_dir``. A budget
        smaller than the working set is a `MemoryError` when the sweep starts.
    scratch_dir : str or os.PathLike, optional
        Directory for environments that do not fit in ``host_memory``.
        Defaults to ``tempfile.gettempdir()`` (which honours ``$TMPDIR``).
    devices : int or sequence of int, optional
        GPUs to split the sketch columns over: a count or a list of ids. On
        the CPU, that many simulated ranks.
    nodes, node_rank, rendezvous : optional
        Several nodes, one process each: how many, which one this is, and
        ``"host:port"`` where node 0 listens. Unset: ``SEXPGPU_NODES``,
        ``SEXPGPU_NODE_RANK`` and ``SEXPGPU_RENDEZVOUS`` (one node when those
        are unset too). Checked when the sweep starts (E-DP-005).
    """

    gpu_memory: int | str | None = None
    host_memory: int | str | None = None
    scratch_dir: str | os.PathLike[str] | None = None
    devices: int | Sequence[int] | None = None
    nodes: int | None = None
    node_rank: int | None = None
    rendezvous: str | None = None

    def __post_init__(self) -> None:
        if self.gpu_memory is not None:
            parse_bytes(self.gpu_memory, "gpu_memory")
        if self.host_memory is not None:
            parse_bytes(self.host_memory, "host_memory")
        if self.scratch_dir is not None and not isinstance(self.scratch_dir, str | os.PathLike):
            raise TypeError(f"Resources: scratch_dir must be a path, got {self.scratch_dir!r}.")
        _device_list(self.devices)

    @property
    def device_ids(self) -> tuple[int, ...] | None:
        """The requested device ids, or ``None`` for the default device."""
        return _device_list(self.devices)

    @property
    def scratch_path(self) -> Path:
        """Where environments that do not fit in host memory are written."""
        if self.scratch_dir is None:
            return Path(tempfile.gettempdir())
        return Path(self.scratch_dir)


def resolve_host_budget(resources: Resources | None) -> int:
    """Return the host budget in bytes: the explicit one, or a detected one."""
    if resources is not None and resources.host_memory is not None:
        return parse_bytes(resources.host_memory, "host_memory")
    return int(host_available_bytes() * (1.0 - _HOST_MARGIN))
