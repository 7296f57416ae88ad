"""Where sexpgpu.tn's sweep spends its time, beside src-method. Run on a GPU (but ``cpu``).

Eight parts, each printed as it is measured:

1. ``pieces``: the rates of what one site of the sweep is made of, at the
   sizes of ``--chi`` (a bond-``chi`` MPO times a bond-4 one, sketch ``chi``):
   a site's upload by each staging path, ZGEMM/CGEMM, QR of the sketch, the
   SVD drivers and eigh of an ``R`` factor, the host SVD.
2. ``profile``: one sweep (``--profile-sites``, ``--profile-chi``, ``--profile-dtype``)
   under torch.profiler, GPU time by kernel, with sexpgpu.tn's pass times.
3. ``variants``: wall time of sexpgpu.tn under staging threads and tile
   sizes, against src-method in the same process.
4. ``qr``: the QR of a ``(4 chi, chi)`` sketch: Householder (cuSOLVER) against
   sexpgpu.tn's CholeskyQR2 and two variants of it, with their orthogonality,
   and CholeskyQR2's pieces (the Cholesky by cuSOLVER, MAGMA and by halves).
5. ``busy``: whether each pass keeps the GPU busy (``--busy-sites``, complex128
   and complex64): per pass the wall time, the GPU's busy time (the union of
   its kernels' intervals, and of kernels and copies, from torch.profiler),
   its idle gaps, and the host's side from sexpgpu.tn's DEBUG log: the
   reading thread's time and the sweep's wait for sites, the writer thread's
   time and the wait for it, the wait on the QR checks.
6. ``uploads``: a 32 and a 61 MiB array to the device: staged through
   page-locked memory (the sweep's way), its own pages registered with the
   driver, or pageable.
7. ``thin``: `right_block` at a bulk site of ``--chi`` (all ``chi`` rows of
   the projected environment at once), with the thin layer's product in one Triton pass against the GEMM and
   the two permuted copies it replaces, complex64 and complex128.
8. ``cpu``: on the host, no GPU needed: one case of ``benches/tn_cpu.py``
   whose name holds ``--cpu-case``, warm, timed call by call: each product,
   QR and copy of the NumPy backend by its caller and shapes, their share of
   the sweep, and the rest (Python, reads, sketch draws); then its floor:
   the same products and QRs replayed one by one at their best of 7, beside
   a third of src-method's time. Run it with ``OPENBLAS_NUM_THREADS=1`` as
   the benchmark's ``--threads 1`` does.

    python3 dev/tn_profile.py [--chi 1000] [--parts pieces profile variants qr busy uploads thin cpu]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, "benches")
import src_method
from tn_gpu import inner, perturbed_identity, random_mpo

import sexpgpu.tn as tn
import sexpgpu.tn.backend as backend
import sexpgpu.tn.cholqr as cholqr
import sexpgpu.tn.plan as plan
import sexpgpu.tn.sweep as sweep
from sexpgpu.runtime.devices import Device


def clock(fn, reps: int = 5) -> float:
    """Median seconds of ``fn()``, the device synchronized around each call."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pieces(chi: int) -> None:
    dev = torch.device("cuda")
    xp = backend.TorchBackend(Device("cuda", 0))
    site = (np.random.default_rng(0).standard_normal((chi, chi, 2, 2, 2)) @ [1, 1j]).copy()
    mb = site.nbytes / 2**20
    print(f"## pieces, chi={chi}: one site {mb:.0f} MiB complex128")

    def staged(threads: int):
        def run():
            backend.STAGE_THREADS = threads
            backend._stagers.cache_clear()
            t, token, _total = xp.upload_async(site)
            xp.wait(token, t)

        return run

    pinned = torch.from_numpy(site).pin_memory()
    rows = {
        "pageable .to(cuda)": lambda: torch.from_numpy(site).to(dev),
        "pinned -> cuda (DMA only)": lambda: pinned.to(dev, non_blocking=True),
        "stage 1 thread + DMA": staged(1),
        "stage 4 threads + DMA": staged(4),
        "stage 8 threads + DMA": staged(8),
    }
    for name, fn in rows.items():
        t = clock(fn)
        print(f"upload   {name:28s} {t * 1e3:8.2f} ms  {site.nbytes / t / 1e9:6.1f} GB/s")
    backend.STAGE_THREADS = 4
    backend._stagers.cache_clear()
    for dtype in (torch.complex128, torch.complex64):
        m, k, n = 4 * chi, 4 * chi, chi
        a = torch.randn(m, k, dtype=dtype, device=dev)
        b = torch.randn(k, n, dtype=dtype, device=dev)
        t = clock(lambda a=a, b=b: a @ b)
        print(f"gemm     {dtype} {m}x{k}x{n}: {t * 1e3:8.2f} ms {8 * m * k * n / t / 1e12:6.1f} TF")
        y = torch.randn(4 * chi, chi, dtype=dtype, device=dev)
        t = clock(lambda y=y: torch.linalg.qr(y))
        print(f"qr       {dtype} {4 * chi}x{chi}: {t * 1e3:8.2f} ms")
        t = clock(lambda y=y: cholqr.cholesky_qr2(y, with_r=False))
        print(f"cqr2     {dtype} {4 * chi}x{chi}: {t * 1e3:8.2f} ms")
        r = torch.linalg.qr(y)[1]
        drivers = (None, "gesvd", "gesvdj", "gesvda") if dtype == torch.complex128 else (None,)
        for driver in drivers:
            t = clock(lambda r=r, d=driver: torch.linalg.svd(r, full_matrices=False, driver=d), 1)
            print(f"svd      {dtype} {chi}x{chi} driver={driver}: {t * 1e3:8.2f} ms")
        gram = r @ r.mH
        t = clock(lambda g=gram: torch.linalg.eigh(g), 3)
        print(f"eigh     {dtype} {chi}x{chi}: {t * 1e3:8.2f} ms")
        host = r.cpu().numpy()
        t = clock(lambda h=host: np.linalg.svd(h, full_matrices=False), 1)
        print(f"host svd {dtype} {chi}x{chi} (numpy): {t * 1e3:8.2f} ms")


def _cqr2_inverse(y):
    """CholeskyQR2 with R^{-1} formed once and applied by a GEMM (the alternative to a TRSM)."""
    x = y.to(cholqr._wider(y.dtype))
    for _ in range(2):
        r, _info = torch.linalg.cholesky_ex(x.mH @ x, upper=True)
        eye = torch.eye(r.shape[0], dtype=r.dtype, device=r.device)
        x = x @ torch.linalg.solve_triangular(r, eye, upper=True)
    return x.to(y.dtype)


def _cqr2_native(y):
    """CholeskyQR2 in the sketch's own precision (what the double Gram matrix replaces)."""
    x = y
    for _ in range(2):
        r, _info = torch.linalg.cholesky_ex(x.mH @ x, upper=True)
        x = torch.linalg.solve_triangular(r, x, upper=True, left=False)
    return x


def _blocked_cholesky(g, block: int):
    """Upper Cholesky by halves down to ``block`` (cuSOLVER's below): TRSM and GEMM between."""
    n = g.shape[0]
    if n <= block:
        return torch.linalg.cholesky_ex(g, upper=True)[0]
    h = n // 2
    r11 = _blocked_cholesky(g[:h, :h], block)
    r12 = torch.linalg.solve_triangular(r11.mH, g[:h, h:], upper=False)  # R11^H R12 = G12
    r22 = _blocked_cholesky(g[h:, h:] - r12.mH @ r12, block)
    r = torch.zeros_like(g)
    r[:h, :h], r[:h, h:], r[h:, h:] = r11, r12, r22
    return r


def _magma_cholesky(g):
    torch.backends.cuda.preferred_linalg_library("magma")
    try:
        return torch.linalg.cholesky_ex(g, upper=True)
    finally:
        torch.backends.cuda.preferred_linalg_library("default")


def qr(chi: int) -> None:
    """Householder QR of a (4 chi, chi) sketch against the CholeskyQR2 variants."""
    dev = torch.device("cuda")
    m, n = 4 * chi, chi
    print(f"## qr of a {m}x{n} sketch (kappa 1e3), median of 20")
    for dtype in (torch.complex128, torch.complex64):
        u, _ = torch.linalg.qr(torch.randn(m, n, dtype=torch.complex128, device=dev))
        v, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.complex128, device=dev))
        s = torch.logspace(0, -3, n, dtype=torch.float64, device=dev)
        y = ((u * s) @ v.mH).to(dtype)
        wide = y.to(cholqr._wider(dtype))
        gram = wide.mH @ wide
        r = torch.linalg.cholesky_ex(gram, upper=True)[0]
        rows = {
            "householder (torch.linalg.qr)": lambda y=y: torch.linalg.qr(y)[0],
            "cholesky_qr2 (sexpgpu.tn)": lambda y=y: cholqr.cholesky_qr2(y, with_r=False)[0],
            "cholesky_qr2, R^-1 by GEMM": lambda y=y: _cqr2_inverse(y),
            "cholesky_qr2 in own precision": lambda y=y: _cqr2_native(y),
        }
        for name, fn in rows.items():
            t = clock(fn, 20)
            q = fn().to(torch.complex128)
            eye = torch.eye(n, dtype=q.dtype, device=dev)
            ortho = torch.linalg.matrix_norm(q.mH @ q - eye).item()
            print(f"qr       {dtype} {name:32s} {t * 1e3:8.2f} ms  ||Q^H Q - I||_F {ortho:.1e}")
        parts = {
            "  gram (double)": lambda w=wide: w.mH @ w,
            "  cholesky_ex (double)": lambda g=gram: torch.linalg.cholesky_ex(g, upper=True),
            "  cholesky_ex, MAGMA": lambda g=gram: _magma_cholesky(g),
            "  cholesky by halves to 128": lambda g=gram: _blocked_cholesky(g, 128),
            "  cholesky by halves to 256": lambda g=gram: _blocked_cholesky(g, 256),
            "  cholesky by halves to 512": lambda g=gram: _blocked_cholesky(g, 512),
            "  solve_triangular (double)": lambda w=wide, r=r: torch.linalg.solve_triangular(
                r, w, upper=True, left=False
            ),
            "  flag to host (sync)": lambda y=y: bool(cholqr.cholesky_qr2(y, with_r=False)[2]),
        }
        for name, fn in parts.items():
            print(f"qr       {dtype} {name:32s} {clock(fn, 20) * 1e3:8.2f} ms")


class Passes(logging.Handler):
    """Collects sexpgpu.tn's pass times and waits for sites."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        keys = ("pass:", "waited", "CholeskyQR2 failed")
        if any(key in text for key in keys) or text.startswith("SRC p"):
            self.lines.append(text)


def problem(n: int, chi: int, dtype: str):
    """The benchmark's problem, A at norm 1 spread over its sites (as benches/tn_gpu.py).

    Unscaled, complex64's environments underflow and the QR falls back.
    """
    rng = np.random.default_rng(0)
    a, b = random_mpo(n, chi, rng, dtype), perturbed_identity(n, rng, dtype)
    per_site = inner([a], [a]).real ** (-0.5 / n)
    return [(site * per_site).astype(dtype) for site in a], b


def profile(n: int, chi: int, dtype: str, passes: Passes) -> None:
    from torch.profiler import ProfilerActivity, profile

    a, b = problem(n, chi, dtype)
    print(f"## profile, n={n} chi={chi} {dtype}")
    ours = clock(lambda: tn.apply(a, b, chi, seed=1, device="gpu"), 2)
    theirs = clock(lambda: src_method.apply(a, b, chi, seed=1, device="gpu"), 2)
    print(f"wall: sexpgpu.tn {ours:.3f} s, src-method {theirs:.3f} s, ratio {theirs / ours:.2f}")
    passes.lines.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tn.apply(a, b, chi, seed=1, device="gpu")
        torch.cuda.synchronize()
    print("\n".join(passes.lines))
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=20, max_name_column_width=50
    )
    print(table)


def variants(n: int, chi: int, passes: Passes) -> None:
    print(f"## variants, n={n} chi={chi}")
    for dtype in ("complex128", "complex64"):
        a, b = problem(n, chi, dtype)
        theirs = clock(lambda a=a, b=b: src_method.apply(a, b, chi, seed=1, device="gpu"), 2)
        print(f"{dtype}: src-method {theirs:.3f} s")
        for threads, tile in ((1, 256), (4, 256), (4, 1024)):
            backend.STAGE_THREADS = threads
            backend._stagers.cache_clear()
            plan.TILE_BYTES = tile << 20
            passes.lines.clear()
            t = clock(lambda a=a, b=b: tn.apply(a, b, chi, seed=1, device="gpu"), 2)
            print(
                f"{dtype}: threads={threads} tile={tile} MiB: {t:.3f} s, "
                f"ratio {theirs / t:.2f}; " + "; ".join(passes.lines[-4:])
            )
    backend.STAGE_THREADS, plan.TILE_BYTES = 4, 256 << 20
    backend._stagers.cache_clear()


def _union(intervals: list[tuple[float, float]], lo: float, hi: float) -> tuple[float, list]:
    """Microseconds of ``[lo, hi]`` covered by ``intervals``, and the gaps between them."""
    covered, gaps, at = 0.0, [], lo
    for a, b in sorted(intervals):
        a, b = max(a, lo), min(b, hi)
        if b <= a or b <= at:
            continue
        if a > at:
            gaps.append(a - at)
        covered += b - max(a, at)
        at = b
    if hi > at:
        gaps.append(hi - at)
    return covered, gaps


def _marked(name: str, fn):
    """``fn`` inside a torch.profiler range called ``name`` (the passes' windows)."""
    from torch.profiler import record_function

    def wrapped(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapped


def busy(n: int, chi: int, dtypes: list[str], passes: Passes) -> None:
    """Per pass: wall time, GPU busy and idle time, and the host's waits."""
    from torch.profiler import ProfilerActivity, profile, record_function

    print(f"## busy, n={n} chi={chi}")
    originals = sweep._left_to_right, sweep._right_to_left
    sweep._left_to_right = _marked("tn: left-to-right", originals[0])
    sweep._right_to_left = _marked("tn: right-to-left", originals[1])
    try:
        for dtype in dtypes:
            a, b = problem(n, chi, dtype)

            def run(a=a, b=b):
                return tn.apply(a, b, chi, seed=1, device="gpu")

            run()  # warm-up: allocator pools, page-locked blocks, cuBLAS handles
            torch.cuda.synchronize()
            passes.lines.clear()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
            print(f"{dtype}: wall {wall:.3f} s; the host's side (sexpgpu.tn DEBUG log):")
            fallbacks = sum("CholeskyQR2 failed" in line for line in passes.lines)
            for line in passes.lines:
                if "CholeskyQR2 failed" not in line:
                    print(f"    {line}")
            print(f"    QR fallbacks: {fallbacks}")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with record_function("tn: apply"):
                    run()
                torch.cuda.synchronize()
            _print_busy(prof, dtype)
    finally:
        sweep._left_to_right, sweep._right_to_left = originals


def _print_busy(prof, dtype: str) -> None:
    """The GPU's busy time in each pass's window, from the profiler's trace."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    marks = {  # the host's ranges (their copies on the GPU's timeline are "gpu_user_annotation")
        e["name"]: (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("tn: ")
    }
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    copies = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in ("gpu_memcpy", "gpu_memset")
    ]
    ltr, rtl, whole = marks["tn: left-to-right"], marks["tn: right-to-left"], marks["tn: apply"]
    # a pass's window runs to the next one's start: the sweep synchronizes in between
    windows = {"left to right": (ltr[0], rtl[0]), "right to left": (rtl[0], whole[1])}
    for name, (lo, hi) in windows.items():
        span = hi - lo
        on, gaps = _union(kernels, lo, hi)
        either, _ = _union(kernels + copies, lo, hi)
        long = [g for g in gaps if g > 500]
        print(
            f"{dtype} {name} (profiled): {span / 1e3:8.1f} ms; kernels busy {on / 1e3:8.1f} ms "
            f"({on / span:.0%}), kernels or copies {either / 1e3:8.1f} ms; idle gaps over 0.5 ms: "
            f"{len(long)}, {sum(long) / 1e3:.1f} ms; largest {max(gaps, default=0) / 1e3:.1f} ms"
        )


def uploads() -> None:
    """A site's upload: staged through page-locked memory, or its own pages registered."""
    print("## uploads, median of 8 arrays (each upload a different array)")
    for mib in (32, 61):
        _uploads_of(mib)


def _uploads_of(mib: int) -> None:
    cudart = torch.cuda.cudart()
    arrays = [np.full(mib << 17, float(i)) for i in range(8)]  # float64, mib MiB each
    dev = torch.empty(arrays[0].size, dtype=torch.float64, device="cuda")
    turn = iter(range(10**9))

    def pick():
        return arrays[next(turn) % len(arrays)]

    def staged():
        x = pick()
        host = torch.empty(x.shape, dtype=torch.float64, pin_memory=True)
        backend.copy_parallel(host.numpy(), x)
        dev.copy_(host, non_blocking=True)

    def registered(copy=True):
        x = pick()
        assert int(cudart.cudaHostRegister(x.ctypes.data, x.nbytes, 0)) == 0
        if copy:
            dev.copy_(torch.from_numpy(x), non_blocking=True)
            torch.cuda.current_stream().synchronize()
        assert int(cudart.cudaHostUnregister(x.ctypes.data)) == 0

    def pageable():
        dev.copy_(torch.from_numpy(pick()))

    x = arrays[0]
    cudart.cudaHostRegister(x.ctypes.data, x.nbytes, 0)
    pinned = torch.from_numpy(x).is_pinned()
    cudart.cudaHostUnregister(x.ctypes.data)
    print(f"{mib} MiB: registered memory counts as pinned: {pinned}")
    rows = {
        "staged (copy_parallel + DMA)": staged,
        "registered, DMA, unregistered": registered,
        "register + unregister alone": lambda: registered(copy=False),
        "pageable .copy_": pageable,
    }
    for name, fn in rows.items():
        print(f"{mib} MiB: {name:32s} {clock(fn, 8) * 1e3:7.2f} ms", flush=True)


def thin(chi: int) -> None:
    from sexpgpu.tn.contractions import right_block

    xp = backend.TorchBackend(Device("cuda", 0))
    for dtype in (torch.complex64, torch.complex128):
        gen = torch.Generator("cuda").manual_seed(0)

        def draw(*shape):
            return torch.randn(*shape, dtype=dtype, device="cuda", generator=gen)

        cores = [draw(chi, chi, 2, 2), draw(4, 4, 2, 2)]
        proj = draw(chi, chi, 4)
        fused = right_block(xp, proj, cores)
        t_fused = clock(lambda: right_block(xp, proj, cores), 20)
        xp.thin_product = lambda *args: None  # the GEMM and the copies
        plain = right_block(xp, proj, cores)
        t_plain = clock(lambda: right_block(xp, proj, cores), 20)
        del xp.thin_product
        diff = float((fused - plain).norm() / plain.norm())
        print(
            f"right_block {str(dtype)[6:]:10s} chi={chi}: GEMMs and copies {t_plain * 1e3:6.2f} ms, "
            f"thin kernel {t_fused * 1e3:6.2f} ms, relative difference {diff:.1e}",
            flush=True,
        )


def cpu(case: str) -> None:
    import tn_cpu  # quimb's and src-method's inputs, loaded for this part only

    cases = {name: (trains, chi) for name, trains, chi in tn_cpu.make_cases()}
    name = next(k for k in cases if case in k)
    trains, chi = cases[name]
    arrays = [list(t.arrays) for t in trains]

    def run():
        return tn.src(*arrays, chi_out=chi, seed=0)

    src_method.src(*arrays, chi_out=chi, seed=0)  # the allocator's state in the benchmark
    run()
    calls: dict[tuple, list] = collections.defaultdict(lambda: [0, 0.0])
    real = {m: getattr(backend.NumpyBackend, m) for m in ("dot", "matmul", "matmul_broadcast")}
    real |= {m: getattr(backend.NumpyBackend, m) for m in ("gemm_qr", "contiguous")}

    def timed(method, fn):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_name
            start = time.perf_counter()
            out = fn(self, *args, **kwargs)
            shapes = tuple(tuple(a.shape) for a in args if hasattr(a, "shape"))
            entry = calls[(method, caller, shapes)]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            return out

        return wrapper

    for method, fn in real.items():
        setattr(backend.NumpyBackend, method, timed(method, fn))
    try:
        start = time.perf_counter()
        run()
        total = time.perf_counter() - start
    finally:
        for method, fn in real.items():
            setattr(backend.NumpyBackend, method, fn)
    timed_total = sum(t for _n, t in calls.values())
    print(f"## cpu: {name}: {total * 1e3:.2f} ms, {timed_total / total:.0%} in the calls below")
    for (method, caller, shapes), (n, t) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:20]:
        print(f"{t * 1e3:8.2f} ms {t / total:5.1%} {n:4d}x {method:16s} <{caller:22s} {shapes}")
    cpu_floor(run, lambda seed: src_method.src(*arrays, chi_out=chi, seed=seed), real)


def cpu_floor(run, peer, real: dict) -> None:
    """The sweep's products and QRs, each replayed alone at its best of 7 (warm caches).

    Their sum is what the sweep would take if nothing else ran and every call
    ran at this core's best rate for its shape: a floor under the sweep's
    time, set beside a third of src-method's (the issue's 3x), medians of 5.
    """
    kept: list[tuple[str, object, tuple]] = []
    xp = backend.NumpyBackend()

    def keeping(method, fn):
        def wrapper(self, *args, **kwargs):
            kept.append((method, lambda a=args, k=kwargs: fn(xp, *a, **k), args))
            return fn(self, *args, **kwargs)

        return wrapper

    replayed = ("dot", "matmul", "matmul_broadcast", "gemm_qr")
    for method in replayed:
        setattr(backend.NumpyBackend, method, keeping(method, real[method]))
    try:
        run()
    finally:
        for method in replayed:
            setattr(backend.NumpyBackend, method, real[method])
    floor: dict[str, float] = collections.defaultdict(float)
    for method, call, _args in kept:
        call()
        floor[method] += min(_seconds(call) for _ in range(7))
    ours = float(np.median([_seconds(run) for _ in range(5)]))
    theirs = float(np.median([_seconds(lambda s=s: peer(s)) for s in range(5)]))
    parts = ", ".join(f"{m} {t * 1e3:.1f}" for m, t in floor.items())
    total = sum(floor.values())
    print(
        f"## floor: products and QRs at their best {total * 1e3:.1f} ms ({parts}); the sweep "
        f"{ours * 1e3:.1f} ms ({total / ours:.0%} of it); src-method {theirs * 1e3:.1f} ms, "
        f"a third of it {theirs / 3 * 1e3:.1f} ms",
        flush=True,
    )


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chi", type=int, default=1000)
    parser.add_argument("--profile-sites", type=int, default=20)
    parser.add_argument("--profile-chi", type=int, default=500)
    parser.add_argument("--profile-dtype", default="complex128")
    parser.add_argument("--variant-sites", type=int, default=25)
    parser.add_argument("--busy-sites", type=int, default=50)
    parser.add_argument("--busy-dtypes", nargs="+", default=["complex128", "complex64"])
    parser.add_argument("--parts", nargs="+", default=["pieces", "profile", "variants", "qr"])
    parser.add_argument("--cpu-case", default="MPO.MPO rand x (1+eps) n=20 chi=100")
    args = parser.parse_args()
    passes = Passes()
    logger = logging.getLogger("sexpgpu.tn")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(passes)
    if torch.cuda.is_available():
        print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    if "pieces" in args.parts:
        pieces(args.chi)
    if "profile" in args.parts:
        profile(args.profile_sites, args.profile_chi, args.profile_dtype, passes)
    if "variants" in args.parts:
        variants(args.variant_sites, args.chi, passes)
    if "qr" in args.parts:
        qr(args.chi)
    if "busy" in args.parts:
        busy(args.busy_sites, args.chi, args.busy_dtypes, passes)
    if "uploads" in args.parts:
        uploads()
    if "thin" in args.parts:
        thin(args.chi)
    if "cpu" in args.parts:
        cpu(args.cpu_case)


if __name__ == "__main__":
    main()
