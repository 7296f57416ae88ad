"""Seeded Gaussian sketches and the sketch dtype.

Each site of the left-to-right pass draws one test tensor ``omega_j`` of shape
``(s, u, d)`` from a single generator, in site order, so a seed fixes every
draw. Draws are made in double precision and then cast, so one seed gives the
same sketch at every precision. Complex sketches are complex Ginibre,
``(x + iy) / sqrt(2)``, whose law is unitarily invariant as randomized range
finding on a complex operator needs.
"""

from __future__ import annotations

import threading

import numpy as np
from numpy.typing import DTypeLike

from .trains import COMPUTE_DTYPES

__all__ = ["SharedSketches", "SketchSource", "sketch_dtype", "work_dtype"]


def sketch_dtype(dtype: DTypeLike | None, inputs: np.dtype, fn: str = "src") -> np.dtype:
    """Resolve the sketch dtype.

    Parameters
    ----------
    dtype : dtype-like or None
        An explicit floating or complex dtype, or ``None`` to follow the inputs.
    inputs : numpy.dtype
        The inputs' promoted dtype.
    fn : str
        The public function called, for messages.

    Returns
    -------
    numpy.dtype
        ``dtype``, or the inputs' dtype when it is floating or complex, else
        ``float64``.

    Raises
    ------
    ValueError
        If ``dtype`` is not float32, float64, complex64 or complex128.
    TypeError
        If ``dtype`` is not a dtype at all.
    """
    if dtype is None:
        return inputs if inputs.kind in "fc" else np.dtype(np.float64)
    try:
        resolved = np.dtype(dtype)
    except TypeError as err:
        raise TypeError(
            f"{fn}: dtype={dtype!r} is not a NumPy dtype; pass e.g. np.float64 or np.complex128, "
            "or None to follow the inputs."
        ) from err
    if resolved.name not in COMPUTE_DTYPES:
        raise ValueError(
            f"{fn}: dtype={resolved} is not a floating or complex dtype the sweep computes "
            "in; pass np.float32, np.float64, np.complex64 or np.complex128, or None to "
            "follow the inputs."
        )
    return resolved


def work_dtype(sketch: np.dtype, inputs: np.dtype) -> np.dtype:
    """The dtype of the environments and the result: sketch promoted by the inputs."""
    return np.result_type(sketch, inputs)


class SketchSource:
    """Draws the test tensors of one sweep, in site order.

    Parameters
    ----------
    seed : int, numpy.random.Generator or None
        Anything `numpy.random.default_rng` accepts.
    size : int
        The sketch size ``s``.
    dtype : numpy.dtype
        The sketch dtype.
    """

    def __init__(self, seed: object, size: int, dtype: np.dtype) -> None:
        self._rng = np.random.default_rng(seed)  # type: ignore[arg-type]
        self.size = size
        self.dtype = dtype

    def draw(self, up: int, down: int) -> np.ndarray:
        """Return the next test tensor, shape ``(s, up, down)``."""
        shape = (self.size, up, down)
        if self.dtype.kind == "c":
            pair = self._rng.standard_normal((2, *shape))
            return ((pair[0] + 1j * pair[1]) * np.sqrt(0.5)).astype(self.dtype)
        return self._rng.standard_normal(shape).astype(self.dtype)


class SharedSketches:
    """One `SketchSource` read by several ranks: each site drawn once, in site order.

    Every rank asks for every site of the left-to-right pass in order and slices
    its own block of columns; the first rank to ask draws, the last to take a
    site frees it. Draws never depend on the number of ranks.

    Parameters
    ----------
    source : SketchSource
        The seeded draws.
    ranks : int
        How many ranks take each site.
    """

    def __init__(self, source: SketchSource, ranks: int) -> None:
        self.source = source
        self.size = source.size
        self._ranks = ranks
        self._lock = threading.Lock()
        self._drawn: dict[int, list] = {}  # site -> [omega, takes left]
        self._next = 0

    def take(self, j: int, up: int, down: int) -> np.ndarray:
        """The test tensor of site ``j``, shape ``(s, up, down)``."""
        with self._lock:
            if j not in self._drawn:
                # Each rank asks in site order, so site j - 1 is drawn before j.
                assert j == self._next, f"site {j} asked before site {self._next}"
                self._drawn[j] = [self.source.draw(up, down), self._ranks]
                self._next += 1
            entry = self._drawn[j]
            omega = entry[0]
            entry[1] -= 1
            if entry[1] == 0:
                del self._drawn[j]
        return omega
