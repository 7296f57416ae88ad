"""Products with cuBLASLt's epilogues: the bias, gelu and their gradients inside the product.

PyTorch calls cuBLASLt for ``addmm`` (the bias epilogue) but keeps the
others to itself: gelu with its input kept for the backward (``GELU_AUX_BIAS``)
and gelu's gradient (``DGELU``); nor does it write a bf16 product as f32 into
a given tensor, or add it there (a gradient into its sum). This module calls the
library PyTorch has already loaded, through ctypes, on PyTorch's stream and
with a workspace of its own, so a CUDA graph can capture the calls.

cuBLASLt is column-major: the row-major ``d[M N] = a[M K] @ b[K N]`` is the
column-major ``d^T = b^T a^T``, so `b` goes first. A vector epilogue's
"rows" are then the columns of `d`: one bias value per output feature.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

__all__ = ["WORKSPACE", "Epilogue", "available", "matmul"]

log = logging.getLogger(__name__)


class Epilogue:
    """cuBLASLt's ``cublasLtEpilogue_t`` values (cublasLt.h)."""

    DEFAULT = 1  # d = a b (+ d, accumulating)
    BIAS = 4
    GELU_AUX_BIAS = 164  # d = gelu(a b + bias), aux = a b + bias
    DGELU = 192  # d = (a b) * gelu'(aux)


# cublasLt.h: cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t,
# cudaDataType_t, cublasComputeType_t.
_TRANSA, _TRANSB, _EPILOGUE, _BIAS_POINTER, _AUX_POINTER, _AUX_LD = 3, 4, 7, 8, 11, 12
_PREF_WORKSPACE, _PREF_REDUCTION_SCHEMES = 1, 3
_PREF_ALIGNMENT = {"a": 5, "b": 6, "c": 7, "d": 8}
# cublasLtReductionScheme_t: a split sum reduced in the compute or the output
# type, through the workspace (2, 4), never accumulated in place in the output
# (1), whose order varies run to run: the same inputs give the same bits.
_SAME_BITS_EVERY_RUN = 2 | 4
_COMPUTE_32F, _R_32F = 68, 0
_TYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
# Room for the split sums of the weights' gradients: a 768x768 f32 product split
# four ways over 32k rows needs 9 MiB, and with 1 MiB (what PyTorch gives its
# cuBLASLt handles) cuBLASLt picks kernels that do not split them, 2.5% slower
# on a 124M Llama (benches/README.md). The memory plan counts it (one a GPU).
WORKSPACE = 32 << 20
_HEURISTIC_BYTES = 96  # cublasLtMatmulHeuristicResult_t: algo (64), size_t, status, float, int[4]


def _library_path() -> str | None:
    """The libcublasLt this process has loaded (PyTorch's), else its usual name."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        pass
    major = (torch.version.cuda or "12").split(".")[0]
    return f"libcublasLt.so.{major}"


@functools.cache
def _lib() -> ctypes.CDLL | None:
    torch.cuda.init()  # loads PyTorch's CUDA libraries, cuBLASLt among them
    try:
        lib = ctypes.CDLL(_library_path())
    except OSError as error:
        log.warning("cuBLASLt not found (%s); products keep their epilogues apart", error)
        return None
    p, u64, i64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64
    sigs = {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), ctypes.c_int, ctypes.c_int],
        "cublasLtMatmulDescSetAttribute": [p, ctypes.c_int, p, ctypes.c_size_t],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), ctypes.c_int, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceSetAttribute": [p, ctypes.c_int, p, ctypes.c_size_t],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, ctypes.c_int, p, ctypes.POINTER(ctypes.c_int)],  # noqa: E501
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, p, p, ctypes.c_size_t, p],
    }  # fmt: skip
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt: {what} returned status {status}")


def _set(setter, obj, attr: int, value: int, ctype=ctypes.c_int32) -> None:
    box = ctype(value)
    _check(setter(obj, attr, ctypes.byref(box), ctypes.sizeof(box)), f"attribute {attr}")


@functools.cache
def _handle(device: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _workspace(device: int) -> torch.Tensor:
    return torch.empty(WORKSPACE, dtype=torch.uint8, device=torch.device("cuda", device))


def _operand(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """How cuBLASLt reads row-major `t` ``[R C]`` as the column-major ``C x R``, or None.

    (whether it transposes the layout, the layout's rows, columns and leading
    dimension): rows of `t` laid out contiguously are that matrix as it is;
    columns laid out contiguously are its transpose.
    """
    r, c = t.shape
    s0, s1 = t.stride()
    if s1 == 1 and s0 >= max(c, 1):
        return 0, c, r, s0
    if s0 == 1 and s1 >= max(r, 1):
        return 1, r, c, s1
    return None


def _alignment(*tensors: torch.Tensor | None) -> tuple[int, ...]:
    out = []
    for t in tensors:
        ptr = 256 if t is None else t.data_ptr()
        out.append(min(256, ptr & -ptr if ptr else 256))
    return tuple(out)


@dataclass(frozen=True)
class _Plan:
    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ...]  # b, a, d: cuBLASLt's A, B and D
    algo: ctypes.Array


@functools.lru_cache(maxsize=256)
def _plan(device, dtype, d_dtype, a_op, b_op, m, n, epilogue, aux_ld, align) -> _Plan | None:
    """The descriptors and the heuristic's algorithm for one shape, or None where none runs it.

    `dtype` is the operands', `d_dtype` the result's (and the summand's, where it adds).
    """
    lib = _lib()
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "desc")
    setter = lib.cublasLtMatmulDescSetAttribute
    _set(setter, desc, _TRANSA, b_op[0])
    _set(setter, desc, _TRANSB, a_op[0])
    _set(setter, desc, _EPILOGUE, epilogue)
    if aux_ld:
        _set(setter, desc, _AUX_LD, aux_ld, ctypes.c_int64)
    layouts = []
    operands = zip((dtype, dtype, d_dtype), (b_op, a_op, (0, m, n, m)), strict=True)
    for kind, (_, rows, cols, ld) in operands:
        layout = ctypes.c_void_p()
        made = lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _TYPES[kind], rows, cols, ld)
        _check(made, "layout")
        layouts.append(layout)
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
    pset = lib.cublasLtMatmulPreferenceSetAttribute
    _set(pset, pref, _PREF_WORKSPACE, WORKSPACE, ctypes.c_uint64)
    _set(pset, pref, _PREF_REDUCTION_SCHEMES, _SAME_BITS_EVERY_RUN, ctypes.c_uint32)
    for key, bytes_ in zip(("b", "a", "c", "d"), align, strict=True):
        _set(pset, pref, _PREF_ALIGNMENT[key], bytes_, ctypes.c_uint32)
    result = (ctypes.c_uint8 * _HEURISTIC_BYTES)()
    found = ctypes.c_int(0)
    b_l, a_l, d_l = layouts
    status = lib.cublasLtMatmulAlgoGetHeuristic(
        _handle(device), desc, b_l, a_l, d_l, d_l, pref, 1, result, ctypes.byref(found)
    )
    if status != 0 or found.value < 1:
        log.warning("cuBLASLt: no algorithm for epilogue %d at %dx%d (%d)", epilogue, m, n, status)
        return None
    return _Plan(desc, (b_l, a_l, d_l), result)


def available(device: torch.device) -> bool:
    """Whether cuBLASLt's epilogues can run on `device` (a CUDA GPU with the library found)."""
    return device.type == "cuda" and torch.cuda.is_available() and _lib() is not None


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    epilogue: int,
    *,
    bias: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor | None:
    """``a[M K] @ b[K N]`` with `epilogue`, into a new ``[M N]`` or `out`; None where it cannot.

    `bias` ``[N]`` is read (``BIAS``, ``GELU_AUX_BIAS``); `aux` ``[M N]``,
    contiguous, is written (``GELU_AUX_BIAS``: the gelu's input) or read
    (``DGELU``: the forward's gelu input). `out`, contiguous ``[M N]`` of
    the operands' dtype or f32, takes the result, rounded once from the
    f32 sums; with `accumulate` the result is added to what it holds.
    """
    ops = _operand(a), _operand(b)
    if None in ops or a.dtype not in _TYPES or b.dtype != a.dtype:
        return None
    m_rows, n_cols = a.shape[0], b.shape[1]
    d = torch.empty((m_rows, n_cols), dtype=a.dtype, device=a.device) if out is None else out
    fits = d.shape == (m_rows, n_cols) and d.is_contiguous() and d.device == a.device
    if not fits or d.dtype not in (a.dtype, torch.float32):
        return None
    if d.numel() == 0 or a.shape[1] == 0:
        return None
    align = _alignment(b, a, d, d)
    plan = _plan(
        a.device.index, a.dtype, d.dtype, ops[0], ops[1], n_cols, m_rows, epilogue,
        n_cols if aux is not None else 0, align,
    )  # fmt: skip
    if plan is None:
        return None
    lib = _lib()
    # Pointers change with each call; the descriptor is the plan's, so set them now
    # (the library reads them at the call, and a CUDA graph keeps what it saw).
    setter = lib.cublasLtMatmulDescSetAttribute
    for attr, t in ((_BIAS_POINTER, bias), (_AUX_POINTER, aux)):
        if t is not None:
            _set(setter, plan.desc, attr, t.data_ptr(), ctypes.c_uint64)
    one, beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if accumulate else 0.0)
    b_l, a_l, d_l = plan.layouts
    device = a.device.index
    stream = torch.cuda.current_stream(a.device).cuda_stream
    _check(
        lib.cublasLtMatmul(
            _handle(device), plan.desc, ctypes.byref(one), b.data_ptr(), b_l, a.data_ptr(), a_l,
            ctypes.byref(beta), d.data_ptr(), d_l, d.data_ptr(), d_l, plan.algo,
            _workspace(device).data_ptr(), WORKSPACE, stream,
        ),
        "cublasLtMatmul",
    )  # fmt: skip
    return d
