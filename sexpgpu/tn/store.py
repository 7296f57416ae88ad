"""Where one rank's left environments ``C_1 .. C_{n-1}`` live: device, host, disk.

The left-to-right pass puts every environment once; the right-to-left pass
takes each once, last first, and drops it. The plan (`sexpgpu.tn.plan`) gives
each environment a tier:

    device  kept as the backend's array (for a host backend: host memory)
    host    copied to host memory (page-locked on a GPU, so copies overlap)
    disk    an ``np.memmap`` in a private directory under scratch_dir

Copies are exact, so the tier never changes the result.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from .backend import Array, Backend

__all__ = ["EnvironmentStore"]

logger = logging.getLogger(__name__)


class EnvironmentStore:
    """The environments of one rank, in the tiers its plan gives them.

    Use as a context manager: the scratch files are removed on exit.

    Parameters
    ----------
    xp : Backend
        The rank's backend.
    tiers : sequence of str
        The tier of environment ``j`` at index ``j - 1``.
    scratch_dir : pathlib.Path
        Where a private directory for spilled environments is created.
    rank : int
        The rank, for file names.
    """

    def __init__(self, xp: Backend, tiers: Sequence[str], scratch_dir: Path, rank: int = 0) -> None:
        self._xp = xp
        self._tiers = tuple(tiers)
        self._scratch_dir = scratch_dir
        self._rank = rank
        self._dir: Path | None = None
        self._envs: dict[int, Any] = {}
        self.held = {"device": 0, "host": 0, "disk": 0}
        self.peak = dict(self.held)

    def __enter__(self) -> EnvironmentStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._envs.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def tier(self, j: int) -> str:
        """The tier of environment ``j``."""
        return self._tiers[j - 1]

    def put(self, j: int, env: Array) -> None:
        """Keep environment ``j`` (a device array) in its tier."""
        xp, tier = self._xp, self.tier(j)
        nbytes = xp.nbytes(env)
        if tier == "device" or (tier == "host" and xp.is_host):
            stored = env
        elif tier == "host":
            stored = xp.pinned(tuple(env.shape), _np_dtype(env))
            xp.copy_into(stored, env)
        else:
            stored = self._memmap(j, tuple(env.shape), _np_dtype(env))
            stored[...] = xp.to_host(env)
            stored.flush()
        self._envs[j] = stored
        self.held[tier] += nbytes
        self.peak[tier] = max(self.peak[tier], self.held[tier])

    def take(self, j: int) -> Array:
        """Environment ``j`` on the device, forgotten by the store."""
        xp, tier = self._xp, self.tier(j)
        stored = self._envs.pop(j)
        self.held[tier] -= xp.nbytes(stored) if tier != "disk" else stored.nbytes
        if tier == "device" or (tier == "host" and xp.is_host):
            return stored
        if tier == "host":
            return stored.to(xp.device.torch_device(), non_blocking=True)
        path = Path(stored.filename) if stored.filename else None
        data = xp.upload(np.array(stored))
        del stored
        if path is not None:
            path.unlink(missing_ok=True)
        return data

    def _memmap(self, j: int, shape: tuple[int, ...], dtype: np.dtype) -> np.memmap:
        if self._dir is None:
            self._scratch_dir.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="sexpgpu-tn-", dir=self._scratch_dir))
            logger.debug("rank %d: environments spill to %s", self._rank, self._dir)
        return np.lib.format.open_memmap(
            self._dir / f"env-{j}.npy", mode="w+", dtype=dtype, shape=shape
        )


def _np_dtype(x: Any) -> np.dtype:
    """The NumPy dtype of an array or tensor."""
    if isinstance(x, np.ndarray):
        return x.dtype
    import torch  # the value already is a tensor, so torch is loaded

    return torch.empty((), dtype=x.dtype).numpy().dtype
