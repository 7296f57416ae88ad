"""Seeded Gaussian sketches and the sketch dtype.

Each site of the left-to-right pass draws one test tensor ``omega_j`` of shape
``(s, u, d)`` from a single generator, in site order, so a seed fixes every
draw. Draws are made in double precision and then cast, so one seed gives the
same sketch at every precision. Complex sketches are complex Ginibre,
``(x + iy) / sqrt(2)``, whose law is unitarily invariant as randomized range
finding on a complex operator needs.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

__all__ = ["SketchSource", "sketch_dtype", "work_dtype"]


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
        If ``dtype`` is not a floating or complex dtype.
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
    if resolved.kind not in "fc":
        raise ValueError(
            f"{fn}: dtype={resolved} is not a floating or complex dtype; pass e.g. np.float32, "
            "np.float64, np.complex64 or np.complex128, or None to follow the inputs."
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
