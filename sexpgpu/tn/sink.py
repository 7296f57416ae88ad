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
quimb's layout. `CoreWriter` hands the sweep's downloads to a sink in a
thread of its own, so the host's copies and writes overlap the device's next
site instead of holding it back.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from time import perf_counter
from types import TracebackType
from typing import Any, Protocol

import numpy as np

from .backend import copy_parallel
from .trains import Kind, unpad_core

__all__ = ["CoreSink", "CoreWriter", "DatasetSink", "MemorySink", "ScratchSink", "check_out"]

logger = logging.getLogger(__name__)


class CoreSink(Protocol):
    """Receives padded output cores by site, and gives them back.

    ``keeps``: whether `put` keeps the array it is given (else it writes the
    data out before it returns, so the array may be a reused buffer).
    """

    keeps: bool

    def put(self, j: int, core: np.ndarray) -> None: ...

    def get(self, j: int) -> np.ndarray: ...


class CoreWriter:
    """Puts downloaded output cores into a sink from a thread of its own.

    A GPU's downloads land in page-locked buffers (`Backend.download`); the
    writer waits for each, copies it out in a few threads where the sink keeps
    arrays (`copy_parallel`: the final, pageable home of the core) and puts
    it. At most one core is being written while the next one downloads: `put`
    waits for the previous core first, which bounds the host memory (the
    plan counts three cores) and never happens while the writer keeps up.

    Parameters
    ----------
    sink : CoreSink
        Where the cores go.
    staged : bool
        Whether downloads are views of reused page-locked buffers (a GPU).
    """

    def __init__(self, sink: CoreSink, staged: bool) -> None:
        self._sink = sink
        self._copy = staged and sink.keeps
        # A host core put into a sink that keeps it is a dict entry: nothing to
        # overlap, and a thread's handoffs would cost more than the put.
        self._inline = not staged and sink.keeps
        self._pool = (
            None
            if self._inline
            else ThreadPoolExecutor(max_workers=1, thread_name_prefix="sexpgpu-tn-write")
        )
        self._pending: Future[None] | None = None
        self.written = 0
        self.busy = 0.0  # seconds the writer's thread spent on cores
        self.waited = 0.0  # seconds `put` waited for the previous core

    def __enter__(self) -> CoreWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is None:
                self._drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
        logger.debug(
            "%d output cores written: %.3f s in the writer's thread, the sweep waited %.3f s",
            self.written,
            self.busy,
            self.waited,
        )

    def put(self, j: int, download: Callable[[], np.ndarray]) -> None:
        """Write core ``j`` once its download is done; raises an earlier write's error."""
        if self._pool is None:
            self._write(j, download)
            return
        start = perf_counter()
        self._drain()
        self.waited += perf_counter() - start
        self._pending = self._pool.submit(self._write, j, download)

    def _drain(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write(self, j: int, download: Callable[[], np.ndarray]) -> None:
        start = perf_counter()
        core = download()
        if self._copy:
            core = _copied(core)
        self._sink.put(j, core)
        self.written += 1
        self.busy += perf_counter() - start


def _copied(core: np.ndarray) -> np.ndarray:
    """A pageable copy of ``core``, made in a few threads."""
    out = np.empty(core.shape, core.dtype)
    copy_parallel(out, core)
    return out


class MemorySink:
    """Output cores in a dict in memory."""

    keeps = True

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

    keeps = False

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

    keeps = False

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
