"""The array backends the sweep is written against: NumPy and PyTorch.

A `Backend` is the handful of operations one SRC sweep needs: uploads and
downloads, reshapes and permutations, GEMMs (plain and batched over the
sketch index), QR, SVD, adjoints and a few reductions. `NumpyBackend` runs on
the host through BLAS/LAPACK; `TorchBackend` runs on one PyTorch device
(cuBLAS and cuSOLVER on a GPU, or PyTorch's CPU device, which CI uses to run
the GPU code path without a GPU), and factors tall sketches by CholeskyQR2
(`sexpgpu.tn.cholqr`) rather than Householder QR. PyTorch is imported only when a
`TorchBackend` is made.

Every value a backend hands back is its own array type; `to_host` always
gives a NumPy array. Sketches are drawn on the host (`sexpgpu.tn.sketch`) and
uploaded, so one seed gives one result on every backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import cache
from itertools import pairwise
from math import prod
from typing import Any

import numpy as np

from sexpgpu.runtime.devices import Device
from sexpgpu.runtime.units import MiB

from . import gemm3m
from .cholqr import cholesky_qr2
from .linalg import qr as host_qr
from .linalg import qr_basis as host_qr_basis
from .linalg import svd as host_svd

__all__ = ["Backend", "NumpyBackend", "TorchBackend", "torch_dtype"]

Array = Any

# Threads that copy a site into page-locked memory for its upload (and an
# output core out of it), and the smallest slice worth a thread of its own
# (on an H200's host: 4.6 ms a 61 MiB site with 8, 5.2 ms with 4).
STAGE_THREADS = min(8, os.cpu_count() or 1)
_STAGE_PIECE = 8 << 20

# How a GPU's single-precision products run (`TorchBackend(products=...)`): as
# they are, or in double ("double": complex64 widened). Three TF32 products of
# split halves were slower and less accurate, twice (benches/README.md).
PRODUCTS = ("single", "double")
# The default on a GPU; None: "double" where the GPU's double-precision products
# are fast (`wide_pays`), else "single" (benches/tn_gpu.py --products sets it).
GPU_PRODUCTS: str | None = None
# A widened complex64 product may take this many times the plain one and still
# be the GPU's default: 0.94 to 1.09 on an H200 at the sweep's shapes (FP64 on
# its tensor cores), far more where FP64 runs at 1/32 or 1/64 of FP32's rate
# (most GPUs outside the A100/H100 class, by their makers' figures).
WIDE_SLOWER = 2.0
_TRIAL_SIDE = 1024  # the timed product is square, about a sixteenth of a bulk site's at chi 1000
# The copies one such product makes of its operands and result stay under this
# many bytes, which the plan reserves (`Backend.product_slack`); the product's
# smallest dimension is at least _COPY_DIM, so the copies are small against
# its arithmetic.
PRODUCT_COPY_BYTES = 256 * MiB
_COPY_DIM = 512


class Backend:
    """The operations of the sweep on one device; see the module docstring.

    Attributes
    ----------
    name : str
        ``"numpy"`` or ``"torch"``.
    device : sexpgpu.runtime.devices.Device
        The device the arrays live on (``cpu:N`` for simulated ranks).
    is_host : bool
        Whether device arrays are host memory (no upload, no pinned tier).
    """

    name = "abstract"
    device: Device
    is_host = True

    # ----- moving data -------------------------------------------------------
    def upload(self, x: np.ndarray, *, non_blocking: bool = False) -> Array:
        """A device copy of the host array ``x`` (the array itself on the host)."""
        raise NotImplementedError

    def to_host(self, x: Array) -> np.ndarray:
        """``x`` as a NumPy array (a copy from a device)."""
        raise NotImplementedError

    def download(self, x: Array) -> Callable[[], np.ndarray]:
        """Start copying ``x`` to the host; call the result for the NumPy array.

        On a GPU the copy runs on a side stream, so the sweep queues the next
        site's work before it waits for this one's output core, and the array
        is a view of page-locked memory that is reused once it is dropped
        (`sexpgpu.tn.sink.CoreWriter` copies it out where a sink keeps it).
        """
        host = self.to_host(x)
        return lambda: host

    def pinned(self, shape: tuple[int, ...], dtype: np.dtype) -> Array:
        """A host buffer that device copies can use asynchronously (page-locked on a GPU)."""
        return np.empty(shape, dtype)

    def synchronize(self) -> None:
        """Wait for the work queued on the device."""

    # ----- making and shaping ------------------------------------------------
    def ones(self, shape: tuple[int, ...], dtype: np.dtype) -> Array:
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Array:
        raise NotImplementedError

    def permute(self, x: Array, perm: Sequence[int]) -> Array:
        raise NotImplementedError

    def contiguous(self, x: Array) -> Array:
        raise NotImplementedError

    def concat(self, xs: Sequence[Array], axis: int = 0) -> Array:
        raise NotImplementedError

    def copy_into(self, dst: Array, x: Array) -> None:
        """``dst[...] = x`` for a device or host ``dst``."""
        dst[...] = x

    @staticmethod
    def numel(x: Array) -> int:
        return prod(x.shape)

    def nbytes(self, x: Array) -> int:
        raise NotImplementedError

    # ----- arithmetic --------------------------------------------------------
    def dot(self, a: Array, b: Array, scratch: str | None = None) -> Array:
        """The matrix product of two 2-D arrays (one GEMM).

        ``scratch`` names a buffer the backend may write the result into and
        reuse for the next product of that name: for a temporary that is dead
        by then (on the host, a sweep's large temporaries are then not mapped
        and faulted in anew at every site; PyTorch's allocator reuses its
        blocks anyway).
        """
        raise NotImplementedError

    def matmul(self, a: Array, b: Array, scratch: str | None = None) -> Array:
        """The batched product ``(n, p, k) @ (n, k, q)``; ``scratch`` as in `dot`."""
        raise NotImplementedError

    def matmul_broadcast(self, a: Array, b: Array) -> Array:
        """``a @ b`` over the last two axes, the leading ones broadcast (as ``np.matmul``)."""
        raise NotImplementedError

    def product_slack(self, work: np.dtype) -> int:
        """Bytes one product of ``work`` arrays may hold beyond its operands and result."""
        return 0

    def adjoint(self, x: Array) -> Array:
        """The conjugate transpose of a matrix (a view where the library allows)."""
        raise NotImplementedError

    def qr(self, x: Array) -> tuple[Array, Array]:
        """Thin Householder QR, ``R``'s diagonal real and non-negative."""
        raise NotImplementedError

    def gemm_qr(self, x: Array, *, with_r: bool) -> tuple[Array, Array | None, Array | None]:
        """Thin QR the fastest way this backend has, and a flag set where it failed.

        Returns ``(q, r, failed)``: ``r`` may be None unless ``with_r``;
        ``failed`` is a device boolean (read it with `flag`), or None where
        the factorization cannot fail. Here: `qr` (on the host LAPACK's
        blocked Householder QR beat CholeskyQR2, measured on 4000x1000).
        """
        q, r = self.qr(x)
        return q, r, None

    def flag(self, failed: Array | None) -> Callable[[], bool]:
        """Start copying a device boolean to the host; call the result for its value."""
        if failed is None:
            return lambda: False
        value = self.download(failed)
        return lambda: bool(value())

    def svd(self, x: Array) -> tuple[Array, np.ndarray, Array]:
        """Thin SVD; the singular values come back on the host."""
        raise NotImplementedError

    def scale_rows(self, sv: np.ndarray, x: Array) -> Array:
        """``diag(sv) @ x`` for host singular values ``sv``."""
        raise NotImplementedError

    def thin_product(self, z: Array, g: Array, axes: Sequence[int]) -> Array | None:
        """``sum_{r, y} z[e, r, l, x, y] g[m, r, y, w]`` in one pass, or None.

        ``z`` is ``(E, R, L, X, Y)`` with any strides, ``g`` a small ``(M, R,
        Y, W)``; the result is C-contiguous with the axes ``(e, x, w, l,
        m)`` in the order ``axes`` (their positions). None where this backend
        has no routine for it: the caller multiplies and rearranges instead
        (`sexpgpu.tn.thin`).
        """
        return None

    def has_thin_product(self, contracted: int, bond: int, free_phys: int) -> bool:
        """Whether `thin_product` runs for a thin core of these sizes (see `thin.fits`)."""
        return False

    # ----- memory ------------------------------------------------------------
    def reset_peak(self) -> None:
        """Start a new high-water mark of device memory (GPU only)."""

    def device_peak(self) -> int | None:
        """The allocator's high-water mark in bytes, or None where there is none."""
        return None


class NumpyBackend(Backend):
    """The host backend: NumPy with BLAS and LAPACK.

    Parameters
    ----------
    device : Device, optional
        The simulated rank this backend stands for (``cpu:N``).
    """

    name = "numpy"
    is_host = True

    def __init__(self, device: Device | None = None) -> None:
        self.device = device or Device("cpu", 0)
        self._scratch: dict[str, np.ndarray] = {}  # name -> buffer (`dot`)

    def upload(self, x: np.ndarray, *, non_blocking: bool = False) -> np.ndarray:
        return x

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    def ones(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.ones(shape, dtype)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def permute(self, x: np.ndarray, perm: Sequence[int]) -> np.ndarray:
        return x.transpose(perm)

    def contiguous(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x)

    def concat(self, xs: Sequence[np.ndarray], axis: int = 0) -> np.ndarray:
        return xs[0] if len(xs) == 1 else np.concatenate(xs, axis=axis)

    def nbytes(self, x: np.ndarray) -> int:
        return int(x.nbytes)

    def dot(self, a: np.ndarray, b: np.ndarray, scratch: str | None = None) -> np.ndarray:
        # np.dot, or for complex operands the 3M method where it pays
        if scratch is None:
            return gemm3m.dot(a, b)
        return gemm3m.dot(a, b, self._out(scratch, (a.shape[0], b.shape[1]), a, b))

    def matmul(self, a: np.ndarray, b: np.ndarray, scratch: str | None = None) -> np.ndarray:
        if scratch is None:
            return np.matmul(a, b)
        shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
        return np.matmul(a, b, out=self._out(scratch, shape, a, b))

    def _out(
        self, name: str | None, shape: tuple[int, ...], a: np.ndarray, b: np.ndarray
    ) -> np.ndarray | None:
        """The buffer ``name`` viewed as the product's result, grown as needed; None for no name."""
        if name is None:
            return None
        dtype, size = np.result_type(a, b), prod(shape)
        buf = self._scratch.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._scratch[name] = np.empty(size, dtype)
        return buf[:size].reshape(shape)

    def matmul_broadcast(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.matmul(a, b)

    def adjoint(self, x: np.ndarray) -> np.ndarray:
        return x.T.conj()

    def qr(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q, r = host_qr(x)  # both fresh arrays: the phases are applied in place
        phase = _unit(np.diagonal(r).copy(), np)  # R's diagonal made real and >= 0
        q *= phase
        r *= phase.conj()[:, None]
        return q, r

    def gemm_qr(self, x: np.ndarray, *, with_r: bool) -> tuple[np.ndarray, np.ndarray | None, None]:
        """`qr` (LAPACK's Householder); without ``with_r``, ``r`` is not formed."""
        if with_r:
            q, r = self.qr(x)
            return q, r, None
        q, diagonal = host_qr_basis(x)
        q *= _unit(diagonal, np)
        return q, None, None

    def svd(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        u, s, vh = host_svd(x)
        phase = _unit(u[np.abs(u).argmax(axis=0), np.arange(u.shape[1])], np)
        return u * phase.conj(), s, phase[:, None] * vh

    def scale_rows(self, sv: np.ndarray, x: np.ndarray) -> np.ndarray:
        return sv[:, None] * x


def _unit(values: Any, xp: Any) -> Any:
    """``values / |values|`` (1 where a value is 0), in NumPy or PyTorch (`xp`).

    QR and SVD factors are unique up to such phases, and LAPACK, cuSOLVER
    and their versions choose differently: fixing R's diagonal real and
    non-negative, and each left singular vector's largest entry likewise,
    makes every backend return the same factors, so one seed gives one
    result on every device.
    """
    size = abs(values)
    if xp is np:  # the same quotients in one ufunc call: the sweep asks once a site
        return np.divide(values, size, out=np.ones_like(values), where=size != 0)
    return xp.where(size == 0, xp.ones_like(values), values / xp.where(size == 0, 1, size))


@cache
def _stagers() -> ThreadPoolExecutor:
    """The threads of `copy_parallel`, shared by every backend and call."""
    return ThreadPoolExecutor(STAGE_THREADS, thread_name_prefix="sexpgpu-tn-stage")


def copy_parallel(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for a large array, in slices over a few threads.

    One thread copies a few GB/s on the host, slower than the host link and
    than the GPU's products with a site.
    """
    flat_dst, flat_src = dst.reshape(-1), np.ascontiguousarray(src).reshape(-1)
    pieces = min(STAGE_THREADS, max(1, flat_dst.nbytes // _STAGE_PIECE))
    if pieces == 1:
        np.copyto(flat_dst, flat_src)
        return
    cuts = np.linspace(0, flat_dst.size, pieces + 1).astype(int)
    jobs = [_stagers().submit(np.copyto, flat_dst[a:b], flat_src[a:b]) for a, b in pairwise(cuts)]
    for job in jobs:
        job.result()


def torch_dtype(dtype: np.dtype) -> Any:
    """The PyTorch dtype of a NumPy floating or complex dtype (imports PyTorch)."""
    import torch

    table = {
        np.dtype(np.float32): torch.float32,
        np.dtype(np.float64): torch.float64,
        np.dtype(np.complex64): torch.complex64,
        np.dtype(np.complex128): torch.complex128,
    }
    try:
        return table[np.dtype(dtype)]
    except KeyError:
        raise TypeError(
            f"the torch sweep computes in float32, float64, complex64 or complex128, not {dtype}"
        ) from None


class TorchBackend(Backend):
    """A PyTorch device: cuBLAS/cuSOLVER on a GPU, or PyTorch's CPU device.

    Parameters
    ----------
    device : Device
        ``cuda:N`` for a GPU; ``cpu:N`` runs on PyTorch's CPU device (the
        index names a simulated rank).
    products : {"single", "double"}, optional
        How large single-precision products run. ``"double"`` (the default
        on a GPU whose double precision is fast, `wide_pays`, or as
        `GPU_PRODUCTS` sets): a complex64 product is computed in complex128
        and rounded once; on an H200 ZGEMM, on the FP64 tensor cores, outruns
        CGEMM on the FP32 units, so the sweep is no slower and its error
        against the exact product falls about tenfold (benches/README.md).
        ``"single"`` (the default elsewhere): as they are. The rule depends
        on the shapes alone, so every budget still runs the same arithmetic.
    """

    name = "torch"

    def __init__(self, device: Device, *, products: str | None = None) -> None:
        import torch  # a device library, loaded only for this backend

        default, self._wide_gram = precision(device)
        products = products or default
        if products not in PRODUCTS:
            raise ValueError(f"products={products!r}: give one of {', '.join(PRODUCTS)}")
        self._torch = torch
        self.device = device
        self._products = products
        self.is_host = not device.is_cuda
        self._dev = device.torch_device()
        cuda = device.is_cuda
        # Uploads (the feed's thread) and downloads (output cores) each get a
        # stream: a download waits for the compute queued before it, which
        # uploads of the next sites must not.
        self._copy_stream = torch.cuda.Stream(self._dev) if cuda else None
        self._down_stream = torch.cuda.Stream(self._dev) if cuda else None

    def upload(self, x: np.ndarray, *, non_blocking: bool = False) -> Any:
        t = self._torch.from_numpy(np.ascontiguousarray(x))
        if not self.device.is_cuda:
            return t
        if non_blocking:
            # Through page-locked memory, so the copy is queued rather than
            # waited for (from pageable memory PyTorch synchronizes the stream).
            t = t.pin_memory()
        return t.to(self._dev, non_blocking=non_blocking)

    def upload_async(self, x: np.ndarray, check: bool = False) -> tuple[Any, Any, Any]:
        """Start copying ``x`` on the copy stream: the tensor, an event to wait for, a sum.

        The copy goes through page-locked memory (`copy_parallel`). With
        ``check``, the third item is the sum of the entries, a device scalar
        computed on the copy stream behind the upload: it is NaN or infinite
        where an entry is (or on an overflow). Read such sums with `finite`;
        the compute stream never waits for them. Without ``check``, None.
        """
        torch = self._torch
        if self._copy_stream is None:  # PyTorch's CPU device: the array itself
            t = self.upload(x)
            return t, None, t.sum() if check else None
        # One copy, straight into pinned memory (x may be a read-only memmap).
        host = torch.empty(x.shape, dtype=torch_dtype(x.dtype), pin_memory=True)
        copy_parallel(host.numpy(), x)
        with torch.cuda.stream(self._copy_stream):
            t = host.to(self._dev, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)  # the compute waits for the copy, not the sum
            total = t.sum() if check else None
        return t, (event, host), total

    def finite(self, totals: Sequence[Any]) -> list[bool]:
        """Whether each sum of `upload_async` is finite: one copy to the host.

        The copy runs on the copy stream, so it waits for the uploads (and
        their sums), never for the compute queued on the device.
        """
        if not totals:
            return []
        torch = self._torch
        stream = self._copy_stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            return torch.isfinite(torch.stack(list(totals))).cpu().tolist()

    def wait(self, token: Any, tensor: Any) -> Any:
        """Make the compute stream wait for an `upload_async` and return its tensor."""
        if token is not None:
            event, _host = token
            self._torch.cuda.current_stream(self._dev).wait_event(event)
            tensor.record_stream(self._torch.cuda.current_stream(self._dev))
        return tensor

    def to_host(self, x: Any) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x
        return x.detach().cpu().numpy()

    def download(self, x: Any) -> Callable[[], np.ndarray]:
        torch = self._torch
        if self._down_stream is None:
            return super().download(x)
        stream = self._down_stream
        stream.wait_stream(torch.cuda.current_stream(self._dev))
        with torch.cuda.stream(stream):
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host.copy_(x, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        x.record_stream(stream)  # x's memory is not reused before the copy is done

        def result() -> np.ndarray:
            event.synchronize()
            # A view: its page-locked block goes back to PyTorch's cache once the
            # caller drops it (a sink that keeps the core copies it out first).
            return host.numpy()

        return result

    def pinned(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        # Allocated page-locked (`.pin_memory()` would copy a pageable buffer).
        pin = self.device.is_cuda
        return self._torch.empty(shape, dtype=torch_dtype(dtype), pin_memory=pin)

    def synchronize(self) -> None:
        if self.device.is_cuda:
            self._torch.cuda.synchronize(self._dev)

    def ones(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        return self._torch.ones(shape, dtype=torch_dtype(dtype), device=self._dev)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        return self._torch.empty(shape, dtype=torch_dtype(dtype), device=self._dev)

    def permute(self, x: Any, perm: Sequence[int]) -> Any:
        return x.permute(*perm)

    def contiguous(self, x: Any) -> Any:
        return x.contiguous()

    def concat(self, xs: Sequence[Any], axis: int = 0) -> Any:
        return xs[0] if len(xs) == 1 else self._torch.cat(list(xs), dim=axis)

    def copy_into(self, dst: Any, x: Any) -> None:
        if isinstance(dst, np.ndarray):
            dst[...] = self.to_host(x)
        else:
            dst.copy_(x, non_blocking=True)

    def nbytes(self, x: Any) -> int:
        if isinstance(x, np.ndarray):
            return int(x.nbytes)
        return int(x.numel() * x.element_size())

    def dot(self, a: Any, b: Any, scratch: str | None = None) -> Any:
        return self._product(self._torch.mm, a, b)

    def matmul(self, a: Any, b: Any, scratch: str | None = None) -> Any:
        return self._product(self._torch.bmm, a, b)

    def matmul_broadcast(self, a: Any, b: Any) -> Any:
        return self._product(self._torch.matmul, a, b)

    def product_slack(self, work: np.dtype) -> int:
        return PRODUCT_COPY_BYTES if self._copied(work) else 0

    def _copied(self, work: np.dtype) -> bool:
        """Whether `products` copies large products of `work` (complex64 in ``double``)."""
        return self._products == "double" and work == np.complex64

    def _product(self, gemm: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
        """``gemm(a, b)``, in complex128 where `products` says so for a large one."""
        torch = self._torch
        if a.dtype != b.dtype or a.dtype != torch.complex64 or not self._copied(np.complex64):
            return gemm(a, b)
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        batch = prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        copies = 2 * a.element_size() * batch * (m * k + k * n + m * n)
        if min(m, k, n) < _COPY_DIM or copies > PRODUCT_COPY_BYTES:
            return gemm(a, b)
        wide = torch.complex128
        return gemm(a.to(wide), b.to(wide)).to(torch.complex64)

    def adjoint(self, x: Any) -> Any:
        # Materialized, so that every product that reads it takes the same GEMM path.
        return x.mH.resolve_conj()

    def qr(self, x: Any) -> tuple[Any, Any]:
        q, r = self._torch.linalg.qr(x, mode="reduced")
        phase = _unit(self._torch.diagonal(r), self._torch)
        return q * phase, phase.conj()[:, None] * r

    def gemm_qr(self, x: Any, *, with_r: bool) -> tuple[Any, Any | None, Any | None]:
        """CholeskyQR2 (`sexpgpu.tn.cholqr`) for a tall ``x``; Householder for a wide one."""
        if x.shape[0] < x.shape[1]:  # the Gram matrix would be singular
            q, r = self.qr(x)
            return q, r, None
        return cholesky_qr2(x, with_r=with_r, wide=self._wide_gram)

    @property
    def products(self) -> tuple[str, bool]:
        """How single-precision work runs here: `products`, and whether Gram matrices are double."""
        return self._products, self._wide_gram

    def svd(self, x: Any) -> tuple[Any, np.ndarray, Any]:
        torch = self._torch
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        columns = torch.arange(u.shape[1], device=u.device)
        phase = _unit(u[u.abs().argmax(dim=0), columns], torch)
        return u * phase.conj(), s.cpu().numpy(), phase[:, None] * vh

    def scale_rows(self, sv: np.ndarray, x: Any) -> Any:
        scale = self._torch.from_numpy(np.ascontiguousarray(sv)).to(self._dev, dtype=x.dtype)
        return scale[:, None] * x

    def has_thin_product(self, contracted: int, bond: int, free_phys: int) -> bool:
        from . import thin

        return thin.available(self._dev) and thin.fits(contracted, bond, free_phys)

    def thin_product(self, z: Any, g: Any, axes: Sequence[int]) -> Any | None:
        from . import thin

        e, r, rows, x, y = z.shape
        m, w = g.shape[0], g.shape[3]
        if not self.has_thin_product(r * y, m, max(x, w)):
            return None
        sizes = (e, x, w, rows, m)
        result = self._torch.empty([sizes[a] for a in axes], dtype=z.dtype, device=z.device)
        thin.thin_product(z, g, result.permute([list(axes).index(a) for a in range(5)]))
        return result

    def reset_peak(self) -> None:
        if self.device.is_cuda:
            self._torch.cuda.reset_peak_memory_stats(self._dev)

    def device_peak(self) -> int | None:
        if not self.device.is_cuda:
            return None
        return int(self._torch.cuda.max_memory_allocated(self._dev))


def precision(device: Device) -> tuple[str, bool]:
    """A device's default `products`, and whether CholeskyQR2 forms Gram matrices in double.

    Double where it runs fast: on a CPU the Gram matrices (small against the
    site's products) but not the products; on a GPU both, where `wide_pays`
    (or as `GPU_PRODUCTS` sets the products); elsewhere neither, with more
    sketches falling back to Householder QR (`cholqr`).
    """
    if not device.is_cuda:
        return "single", True
    fast = wide_pays(device.index)
    return GPU_PRODUCTS or ("double" if fast else "single"), fast


@cache
def wide_pays(index: int) -> bool:
    """Whether complex64 products in complex128 cost at most `WIDE_SLOWER` times on GPU `index`.

    Timed once per process and GPU: the best of five of each, a square
    complex64 product against the same widened, multiplied and narrowed.
    """
    import torch

    device = torch.device("cuda", index)
    g = torch.Generator(device=device).manual_seed(0)
    side = (_TRIAL_SIDE, _TRIAL_SIDE)
    a, b = (torch.randn(side, dtype=torch.complex64, device=device, generator=g) for _ in "ab")

    def best(product: Callable[[], Any]) -> float:
        product()  # the library's first call (its handles, its workspace)
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            product()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return min(times)

    with torch.cuda.device(device):
        plain = best(lambda: a @ b)
        wide = best(lambda: (a.to(torch.complex128) @ b.to(torch.complex128)).to(torch.complex64))
    return wide <= WIDE_SLOWER * plain
