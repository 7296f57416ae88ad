"""Where output cores go as the sweep makes them: memory, scratch files, or `out=`.

The right-to-left pass produces the output cores last first, one per site;
a sink receives each as it is made, so an output larger than host memory
never sits in memory when ``out=`` names files:

    MemorySink     a list in memory (the default: `src` returns NumPy arrays)
    ScratchSink    ``.npy`` files in a private scratch directory, read back
                   one at a time by the final truncation pass
    DatasetSink    the user's ``out=``: an HDF5 or zarr group (datasets
                   ``"0"``, ``"1"``, ...) or a directory (``0.npy``, ...)

Sinks store padded ``(l, r, u, d)`` cores; `DatasetSink` writes them in
quimb's layout.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .trains import Kind, unpad_core

__all__ = ["CoreSink", "DatasetSink", "MemorySink", "ScratchSink", "check_out"]


class CoreSink(Protocol):
    """Receives padded output cores by site, and gives them back."""

    def put(self, j: int, core: np.ndarray) -> None: ...

    def get(self, j: int) -> np.ndarray: ...


class MemorySink:
    """Output cores in a dict in memory."""

    def __init__(self) -> None:
        self._cores: dict[int, np.ndarray] = {}

    def put(self, j: int, core: np.ndarray) -> None:
        """Keep core ``j``."""
        self._cores[j] = core

    def get(self, j: int) -> np.ndarray:
        """Core ``j``, forgotten by the sink."""
        return self._cores.pop(j)


class ScratchSink:
    """Output cores as ``.npy`` files under a scratch directory, removed on `close`."""

    def __init__(self, scratch_dir: Path) -> None:
        scratch_dir.mkdir(parents=True, exist_ok=True)
        self._dir = Path(tempfile.mkdtemp(prefix="sexpgpu-tn-out-", dir=scratch_dir))

    def put(self, j: int, core: np.ndarray) -> None:
        """Write core ``j``."""
        np.save(self._dir / f"{j}.npy", core)

    def get(self, j: int) -> np.ndarray:
        """Read core ``j`` and remove its file."""
        path = self._dir / f"{j}.npy"
        core = np.load(path)
        path.unlink()
        return core

    def close(self) -> None:
        """Remove the scratch directory."""
        shutil.rmtree(self._dir, ignore_errors=True)


def check_out(fn: str, out: object) -> None:
    """Accept ``None``, an HDF5/zarr group or a directory path; else a TypeError."""
    if out is None or isinstance(out, str | os.PathLike) or _creator(out) is not None:
        return
    raise TypeError(
        f"{fn}: out must be an HDF5 or zarr group or a directory path, got "
        f"{type(out).__name__}; e.g. out=h5py.File('result.h5', 'w') or out='result/'."
    )


def _creator(group: object) -> Any:
    """The group's method that makes a dataset from data (h5py, zarr v2 or v3)."""
    for name in ("create_array", "create_dataset"):
        method = getattr(group, name, None)
        if callable(method):
            return method
    return None


class DatasetSink:
    """The user's ``out=``: each core written in quimb's layout as it arrives.

    Parameters
    ----------
    out : group or path
        An HDF5 or zarr group (datasets named ``"0"``, ``"1"``, ...) or a
        directory (``0.npy``, ``1.npy``, ...; created if missing).
    n_sites : int
        The number of sites.
    kind : {"mps", "mpo"}
        The result's kind.
    """

    def __init__(self, out: object, n_sites: int, kind: Kind) -> None:
        self._out = out
        self._n = n_sites
        self._kind = kind
        if isinstance(out, str | os.PathLike):
            Path(out).mkdir(parents=True, exist_ok=True)

    def put(self, j: int, core: np.ndarray) -> None:
        """Write core ``j``, unpadded."""
        data = unpad_core(core, j, self._n, self._kind)
        if isinstance(self._out, str | os.PathLike):
            np.save(Path(self._out) / f"{j}.npy", data)
            return
        name = str(j)
        if name in self._out:  # type: ignore[operator]
            del self._out[name]  # type: ignore[attr-defined]
        creator = _creator(self._out)
        if getattr(creator, "__name__", "") == "create_array":
            array = creator(name, shape=data.shape, dtype=data.dtype)
            array[...] = data
        else:
            creator(name, data=data)

    def get(self, j: int) -> np.ndarray:
        """Not used: the final cores are read back by the caller."""
        raise AssertionError("a DatasetSink is written, not read, by the sweep")

    def result(self) -> list[Any]:
        """The written cores, lazily: datasets of the group, or read-only memmaps."""
        if isinstance(self._out, str | os.PathLike):
            return [np.load(Path(self._out) / f"{j}.npy", mmap_mode="r") for j in range(self._n)]
        return [self._out[str(j)] for j in range(self._n)]  # type: ignore[index]
