"""The IR's element types and how the CPU stores each one.

``bf16`` values live in float32 arrays whose low 16 bits are zero: every
value stored as bf16 is rounded to the nearest bf16 (ties to even), and the
arithmetic between stores is float32. `round_bf16` is that rounding.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np

__all__ = ["FLOATS", "DType", "numpy_dtype", "round_bf16"]


class DType(StrEnum):
    """An element type; compares equal to its name (``DType.F32 == "f32"``)."""

    F32 = "f32"
    BF16 = "bf16"
    F64 = "f64"
    INT32 = "int32"
    BOOL = "bool"


FLOATS = frozenset({DType.F32, DType.BF16, DType.F64})

_NUMPY = {
    DType.F32: np.dtype(np.float32),
    DType.BF16: np.dtype(np.float32),
    DType.F64: np.dtype(np.float64),
    DType.INT32: np.dtype(np.int32),
    DType.BOOL: np.dtype(np.bool_),
}


def numpy_dtype(dtype: DType) -> np.dtype:
    """The NumPy dtype the CPU interpreter stores `dtype` in (bf16 -> float32)."""
    return _NUMPY[dtype]


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round a float32 array to bf16 values in place and return it.

    Round to nearest, ties to even, on the float32 bit pattern (what
    ``torch.tensor(x).to(torch.bfloat16)`` does); NaN stays NaN and
    infinities stay infinite.

    Parameters
    ----------
    x
        A writeable float32 array.
    """
    assert x.dtype == np.float32 and x.flags.writeable
    bits = x.view(np.uint32)
    nan = np.isnan(x)
    lsb = bits >> 16
    lsb &= np.uint32(1)
    lsb += np.uint32(0x7FFF)
    bits += lsb
    bits &= np.uint32(0xFFFF0000)
    if nan.any():
        x[nan] = np.nan
    return x
