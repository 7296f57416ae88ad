"""Single-precision products on the tensor cores, split in two halves (`TorchBackend`).

A GPU's TF32 tensor cores multiply float32 operands rounded to 10 mantissa
bits, several times faster than its FP32 units run a float32 GEMM. Split
each operand ``x`` into ``hi = tf32(x)`` and ``lo = tf32(x - hi)``, each
rounded to the nearest TF32 number: ``x - hi - lo`` is at most ``2**-22
|x|``. Then

    a b  ~  hi_a hi_b + hi_a lo_b + lo_a hi_b

(the ``lo_a lo_b`` term, at most ``2**-22 |a||b|``, is left out): three
tensor-core products, summed in float32, give float32's precision (the
"3xTF32" of CUTLASS). A complex64 product is one real product of block
matrices (the smaller operand doubled), so it is three as well.

The rounding is done here, by masking the mantissa, so every device (and
PyTorch's CPU device, which tests it) multiplies the same numbers; only the
order of the float32 sums differs from one GEMM library to another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["split_bytes", "split_product"]

# float32's low 13 mantissa bits cleared (0xFFFFE000 as a signed int32): TF32's 10 remain;
# half of the last kept bit is added first, so the cut rounds to nearest.
_TF32_MASK, _TF32_HALF = -8192, 4096


def split_bytes(m: int, k: int, n: int, batch: int, complex_: bool) -> int:
    """The bytes `split_product` holds beside its operands and result."""
    if complex_:  # the smaller operand doubled into a block matrix, the other stacked
        small, large = sorted((m * k, k * n))
        operands, result = 4 * small + 2 * large, 2 * m * n
    else:
        operands, result = m * k + k * n, m * n
    # float32: each operand's hi and lo (a complex one's real form made lo in place); the
    # result and one product's temporary.
    return 4 * batch * (2 * operands + 2 * result)


def split_product(torch: Any, gemm: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    """``gemm(a, b)`` for float32 or complex64 `a`, `b` by three TF32 products of halves."""
    if not a.is_complex():
        return _three(torch, gemm, a, b, owned=False)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    ar, ai, br, bi = a.real, a.imag, b.real, b.imag
    if m * k <= k * n:  # [ar -ai; ai ar] [br; bi] = [re; im]
        left = torch.cat([torch.cat([ar, -ai], -1), torch.cat([ai, ar], -1)], -2)
        c = _three(torch, gemm, left, torch.cat([br, bi], -2), owned=True)
        return torch.complex(c[..., :m, :], c[..., m:, :])
    # [ar ai] [br bi; -bi br] = [re im]
    right = torch.cat([torch.cat([br, bi], -1), torch.cat([-bi, br], -1)], -2)
    c = _three(torch, gemm, torch.cat([ar, ai], -1), right, owned=True)
    return torch.complex(c[..., :n], c[..., n:])


def _three(torch: Any, gemm: Callable[[Any, Any], Any], a: Any, b: Any, *, owned: bool) -> Any:
    """The three products; `owned` operands (made here) become their own lo halves."""
    hi_a, lo_a = _halves(torch, a, owned)
    hi_b, lo_b = _halves(torch, b, owned)
    del a, b
    with _tf32(torch):
        c = gemm(lo_a, hi_b)  # the small terms first, then the large one
        c += gemm(hi_a, lo_b)
        c += gemm(hi_a, hi_b)
    return c


def _halves(torch: Any, x: Any, owned: bool) -> tuple[Any, Any]:
    """``hi, lo``, both exact in TF32, with ``x - hi - lo`` at most ``2**-22 |x|``.

    An `owned` `x` (contiguous, made by the caller) is made `lo` in place.
    """
    x = x.contiguous()
    hi = _rounded(torch, x.clone())
    return hi, _rounded(torch, x.sub_(hi) if owned else x - hi)


def _rounded(torch: Any, x: Any) -> Any:
    """`x` (float32, contiguous, finite) rounded to TF32's mantissa, to nearest, in place.

    On the bits: a float's magnitude grows with its pattern, and a carry out of
    the mantissa moves the exponent up, as rounding up should.
    """
    x.view(torch.int32).add_(_TF32_HALF).bitwise_and_(_TF32_MASK)
    return x


@contextmanager
def _tf32(torch: Any) -> Iterator[None]:
    """float32 products on the tensor cores for the block's length (PyTorch's flag is global)."""
    flags = torch.backends.cuda.matmul
    # `allow_tf32` sets PyTorch's old switch and its newer per-backend one alike (the
    # cuda device sets it so); where the newer one was set apart, reading the old one
    # raises, and the newer one is used alone: mixing them makes PyTorch's readers raise.
    try:
        name, value, before = "allow_tf32", True, flags.allow_tf32
    except RuntimeError:
        name, value, before = "fp32_precision", "tf32", flags.fp32_precision
    setattr(flags, name, value)
    try:
        yield
    finally:
        setattr(flags, name, before)
