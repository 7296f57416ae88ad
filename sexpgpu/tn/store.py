"""Where the left environments ``C_1 .. C_{n-1}`` live: host memory or disk.

The left-to-right pass writes every environment once; the right-to-left pass
reads each once, last first, and drops it. Environments go to host memory while
the budget lasts and to ``np.memmap`` files in a private directory under the
scratch directory after that, so a sweep whose environments exceed host memory
still runs.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from math import prod
from pathlib import Path
from types import TracebackType

import numpy as np

__all__ = ["EnvironmentStore"]

logger = logging.getLogger(__name__)


class EnvironmentStore:
    """Host memory first, then disk, for the environments of one sweep.

    Use as a context manager: the scratch files are removed on exit.

    Parameters
    ----------
    budget : int
        Bytes of host memory the environments may take.
    scratch_dir : pathlib.Path
        Where a private directory for spilled environments is created.
    """

    def __init__(self, budget: int, scratch_dir: Path) -> None:
        self._left = budget
        self._scratch_dir = scratch_dir
        self._dir: Path | None = None
        self._envs: dict[int, np.ndarray] = {}
        self.spilled_bytes = 0

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

    def allocate(self, j: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """Return a writable array for environment ``j``, in memory or on disk."""
        n_bytes = prod(shape) * dtype.itemsize
        if n_bytes <= self._left:
            self._left -= n_bytes
            env = np.empty(shape, dtype)
        else:
            if self._dir is None:
                self._scratch_dir.mkdir(parents=True, exist_ok=True)
                self._dir = Path(tempfile.mkdtemp(prefix="sexpgpu-tn-", dir=self._scratch_dir))
                logger.debug("Environments spill to %s", self._dir)
            env = np.lib.format.open_memmap(
                self._dir / f"env-{j}.npy", mode="w+", dtype=dtype, shape=shape
            )
            self.spilled_bytes += n_bytes
        self._envs[j] = env
        return env

    def take(self, j: int) -> np.ndarray:
        """Return environment ``j`` and forget it (its memory goes with the last user)."""
        env = self._envs.pop(j)
        if isinstance(env, np.memmap):
            path = Path(env.filename) if env.filename else None
            data = np.array(env)
            del env
            if path is not None:
                path.unlink(missing_ok=True)
            return data
        self._left += env.nbytes
        return env
