"""Complex matrix products on the host by the 3M method of NumPy's own BLAS.

A complex GEMM makes four real products per complex multiply-add; the 3M
method (Gauss's trick) makes three::

    (A_r + i A_i)(B_r + i B_i) = T_1 - T_2 + i (T_3 - T_1 - T_2)
    T_1 = A_r B_r,   T_2 = A_i B_i,   T_3 = (A_r + A_i)(B_r + B_i)

OpenBLAS's ``zgemm3m``/``cgemm3m`` form the sums while packing the blocks,
so the products run at the real GEMM's rate: a quarter fewer operations.
On the 2-core EPYC of benches/README.md a 400x100x400 complex128 product
takes 0.75 of ``zgemm``'s time (1.96 against 2.66 ms), 0.8 to 0.9 at
200x50x200, and more than ``zgemm`` where a side is below about 40 and the
packing dominates (`MIN_SIDE`). But OpenBLAS has no AVX-512 kernels for the
3M method: on an Intel Xeon with AVX-512 (OpenBLAS's ``SkylakeX`` kernels)
the same product takes 1.5 to 1.8 times ``zgemm``'s time, which runs there
at nearly twice its AVX2 rate. So whether the method pays is the machine's
fact, measured once per process (`choices`) on a product of the sweep's
size, and taken where it is at least 5% faster. The error bound is
normwise, as ``zgemm``'s,
with a somewhat larger constant (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., ch. 23); measured, both products differ from
the exact one by about 1e-15 relative in double precision.

NumPy does not expose the routine. Its wheels ship OpenBLAS (Linux:
``numpy.libs/libscipy_openblas64_*.so``), which exports it through CBLAS
(``scipy_cblas_zgemm3m64_``, 64-bit integers); `dot` calls it there through
ctypes (which releases the GIL, as NumPy does). Where NumPy runs on another
BLAS the library is not found and `dot` is ``np.dot``: the same product, four
real multiplications per complex one.
"""

from __future__ import annotations

import ctypes
import os
import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MIN_SIDE", "MIN_WORK", "available", "check_setting", "choices", "dot", "pin"]

# Where the 3M method pays, measured on the EPYC of benches/README.md at the
# sweep's shapes: each side at least MIN_SIDE and m n k at least MIN_WORK[dtype]
# (below, packing the sums costs more than the multiplication saves; in single
# precision the plain product runs twice as fast, so the 3M one pays later).
MIN_SIDE = 40
MIN_WORK = {"D": 1 << 18, "F": 1 << 20}

# The trial product (m, k, n) that decides whether the method pays here: past both
# bounds above, about the size of a bulk site's products at bond 50 to 100.
TRIAL = (192, 96, 192)
PAYS = 0.95  # the 3M product's best time against the plain one's, at most
# Set to 0 or 1, it decides instead of the trial (every process the same way).
ENV = "SEXPGPU_GEMM3M"

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_SYMBOLS = {"D": "scipy_cblas_zgemm3m64_", "F": "scipy_cblas_cgemm3m64_"}


@cache
def _routines() -> dict[str, Any]:
    """The 3M GEMMs of NumPy's bundled OpenBLAS by dtype char; empty where there are none."""
    here = Path(np.__file__).resolve().parent
    # Linux wheels keep it beside the package, macOS wheels inside it.
    found = sorted(here.parent.glob("numpy.libs/libscipy_openblas64_*.so"))
    found += sorted(here.glob(".dylibs/libscipy_openblas64_*.dylib"))
    if not found:
        return {}
    try:
        lib = ctypes.CDLL(str(found[0]))
    except OSError:
        return {}
    int64, ptr, enum = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    routines = {}
    for char, name in _SYMBOLS.items():
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.argtypes = [enum, enum, enum, int64, int64, int64, ptr, ptr, int64, ptr, int64]
        fn.argtypes += [ptr, ptr, int64]
        fn.restype = None
        routines[char] = fn
    return routines


def available(dtype: np.dtype) -> bool:
    """Whether products of ``dtype`` (complex64 or complex128) can take the 3M GEMM."""
    return dtype.kind == "c" and dtype.char in _routines()


_pinned: dict[str, bool] = {}


def choices() -> dict[str, bool]:
    """Whether this process takes the 3M GEMM, by dtype char ("D", "F"): pinned, set, or timed."""
    return {char: _chosen(char) for char in _SYMBOLS}


def pin(chosen: dict[str, bool]) -> None:
    """Take `chosen` (another process's `choices`) from now on: the same products, the same bits."""
    _pinned.update({char: bool(chosen[char]) for char in _SYMBOLS if char in chosen})


def _chosen(char: str) -> bool:
    return _pinned[char] if char in _pinned else _decided(char)


def check_setting(fn: str) -> bool | None:
    """`ENV`'s choice (None: unset, the trial decides); a value not 0 or 1 is a ValueError."""
    setting = os.environ.get(ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(
            f"{fn}: {ENV} must be 0 (NumPy's complex products) or 1 (the 3M GEMM where it "
            f"pays by shape), or unset (timed on this machine), got {setting!r}."
        )
    return None if not setting else setting == "1"


@cache
def _decided(char: str) -> bool:
    """This process's own choice: the setting where there is one, else the trial's."""
    if char not in _routines():
        return False
    setting = check_setting("sexpgpu.tn")
    return _faster_here(char) if setting is None else setting


def _faster_here(char: str) -> bool:
    """Whether the 3M GEMM beats ``np.dot`` by `PAYS` on `TRIAL` here (best of interleaved runs)."""
    m, k, n = TRIAL
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, 2 * k)).view(np.complex128).astype(char)
    b = rng.standard_normal((k, 2 * n)).view(np.complex128).astype(char)
    out = np.empty((m, n), char)
    plain, three = [], []
    for _ in range(8):  # the first of each warms the caches and BLAS's buffers
        began = time.perf_counter()
        np.dot(a, b, out=out)
        plain.append(time.perf_counter() - began)
        began = time.perf_counter()
        _gemm3m(a, b, out)
        three.append(time.perf_counter() - began)
    return min(three[1:]) <= PAYS * min(plain[1:])


def _pays(work: int, dtype: np.dtype) -> bool:
    """Whether a product of ``work`` multiply-adds (each side long enough) takes the 3M GEMM."""
    return available(dtype) and work >= MIN_WORK[dtype.char] and _chosen(dtype.char)


def _operand(x: np.ndarray) -> tuple[int, int] | None:
    """``(transpose flag, leading dimension)`` of a row-major view of ``x``, or None."""
    item, (down, across) = x.itemsize, x.strides  # bytes to the next row, to the next column
    if across == item and down % item == 0 and down >= max(1, x.shape[1]) * item:
        return _NO_TRANS, down // item
    if down == item and across % item == 0 and across >= max(1, x.shape[0]) * item:
        return _TRANS, across // item
    return None


def dot(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a @ b`` for 2-D arrays: by the 3M GEMM where it is found and pays, else ``np.dot``.

    ``out``, if given, is C-contiguous of the result's shape and dtype (as for ``np.dot``).
    """
    (m, k), n = a.shape, b.shape[1]
    if min(m, k, n) < MIN_SIDE or a.dtype != b.dtype or not _pays(m * k * n, a.dtype):
        return np.dot(a, b, out=out)
    ta, tb = _operand(a), _operand(b)
    if ta is None or tb is None:
        return np.dot(a, b, out=out)
    if out is None:
        out = np.empty((m, n), a.dtype)
    return _gemm3m(a, b, out, ta, tb)


def _gemm3m(
    a: np.ndarray,
    b: np.ndarray,
    out: np.ndarray,
    ta: tuple[int, int] | None = None,
    tb: tuple[int, int] | None = None,
) -> np.ndarray:
    """``out = a @ b`` by the 3M GEMM; `ta`, `tb`: the operands' `_operand` (row-major if None)."""
    (m, k), n = a.shape, b.shape[1]
    ta, tb = ta or (_NO_TRANS, k), tb or (_NO_TRANS, n)
    assert out.flags.c_contiguous and out.shape == (m, n) and out.dtype == a.dtype
    one, zero = _scalars(a.dtype.char)
    _routines()[a.dtype.char](
        _ROW_MAJOR, ta[0], tb[0], m, n, k,
        one, _address(a), ta[1], _address(b), tb[1], zero, _address(out), n,
    )  # fmt: skip
    return out


def _address(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


def _scalars(char: str) -> tuple[int, int]:
    """Addresses of ``alpha = 1`` and ``beta = 0`` in ``char``'s dtype."""
    return _constants(char)[2]


@cache
def _constants(char: str) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """``alpha = 1``, ``beta = 0`` in ``char``'s dtype and their addresses, made once.

    The cache keeps the arrays, so the addresses stay valid; reading an
    address costs about a microsecond, a few per product.
    """
    one, zero = np.ones(1, char), np.zeros(1, char)
    return one, zero, (_address(one), _address(zero))
