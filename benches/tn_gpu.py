"""sexpgpu.tn against src-method 0.5.0 on one GPU, in the same run.

Case: the MPO product ``A B`` with ``A`` a random MPO of bond ``chi`` and ``B``
a perturbed identity (identity + 1e-8 times a random MPO of bond 3: bond 4),
physical dimension 2, ``chi_out = chi``, complex128 and complex64. Each peer
runs ``--reps`` times after one warm-up, interleaved; the median wall time is
reported (inputs on the host, result back on the host, both included).

Errors, from inner products computed on the GPU (never dense):
``|x - y| / |x|`` between the two results, and against the exact product ``A B``
(bond ``4 chi``) when ``--exact`` is given and its transfer matrices fit.
The plan and the measured device peak of sexpgpu.tn are read from its
``sexpgpu.tn`` DEBUG log. ``--gpu-memory`` adds an out-of-core case: the same
product under a device budget smaller than its environments.

Run from the repository root on a machine with a GPU, CuPy and src-method::

    python benches/tn_gpu.py [--sites 25 50] [--chi 1000] [--reps 5]
                             [--dtypes complex128 complex64] [--gpu-memory 2GiB]
                             [--products single|double]

``--products`` sets how sexpgpu.tn runs its large single-precision products
on the GPU (`sexpgpu.tn.backend.GPU_PRODUCTS`: in double, or as they are;
by default in double where the GPU's double-precision products are fast,
`sexpgpu.tn.backend.wide_pays`).

``--smoke`` runs a tiny case of every path on the CPU (CI).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np
import torch

import sexpgpu.tn as tn
from sexpgpu.runtime.devices import Device
from sexpgpu.tn import backend
from sexpgpu.tn.backend import PRODUCTS


class PlanLog(logging.Handler):
    """Keeps the plan, peak and pass-time lines of the last sexpgpu.tn call.

    Also counts the sites whose CholeskyQR2 failed and were redone by
    Householder QR (each costs both).
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.fallbacks = 0

    def clear(self) -> None:
        self.lines.clear()
        self.fallbacks = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith(("SRC plan", "SRC peaks")) or "pass:" in text:
            self.lines.append(text)
        elif "CholeskyQR2 failed" in text:
            self.fallbacks += 1


def random_mpo(n: int, chi: int, rng: np.random.Generator, dtype: str) -> list[np.ndarray]:
    """A random MPO of bond ``chi`` (capped toward the ends), quimb's layout."""
    bonds = [min(chi, 4 ** (j + 1), 4 ** (n - 1 - j)) for j in range(n - 1)]
    sites = []
    for j in range(n):
        shape = ([bonds[j - 1]] if j else []) + ([bonds[j]] if j < n - 1 else []) + [2, 2]
        a = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
        sites.append((a / np.linalg.norm(a) * 2).astype(dtype))
    return sites


def perturbed_identity(n: int, rng: np.random.Generator, dtype: str, eps: float = 1e-8):
    """``I + eps R`` as an MPO of bond 4 (``R`` random of bond 3), quimb's layout."""
    sites = []
    for j in range(n):
        core = np.zeros((4, 4, 2, 2), complex)
        core[0, 0] = np.eye(2)
        r = rng.standard_normal((3, 3, 2, 2)) + 1j * rng.standard_normal((3, 3, 2, 2))
        core[1:, 1:] = r / np.linalg.norm(r) * (eps if j == 0 else 1.0)
        if j == 0:  # boundaries enter and leave both blocks
            core = core[0] + core[1]
        elif j == n - 1:
            core = core[:, 0] + core[:, 1]
        sites.append(core.astype(dtype))
    return sites


def _pad(train: list[np.ndarray], device: str) -> list[torch.Tensor]:
    out = []
    for j, t in enumerate(train):
        t = torch.from_numpy(np.ascontiguousarray(t)).to(device, torch.complex128)
        if j == 0:
            t = t[None]
        if j == len(train) - 1:
            t = t[:, None]
        out.append(t)
    return out


def inner(bra: list[list[np.ndarray]], ket: list[list[np.ndarray]], device: str) -> complex:
    """``<bra|ket>`` of two MPO products (each one or two layers), by transfer matrices."""
    b = [_pad(t, device) for t in bra]
    k = [_pad(t, device) for t in ket]
    env = torch.ones([1] * (len(b) + len(k)), dtype=torch.complex128, device=device)
    for j in range(len(b[0])):
        env = _transfer(env, [t[j] for t in b], [t[j] for t in k])
    return complex(env.reshape(-1)[0].item())


def _transfer(env, bra, ket):
    # env (bra bonds.., ket bonds..); each product runs u -> d through its layers.
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    left = [next(letters) for _ in range(len(bra) + len(ket))]
    right = [next(letters) for _ in left]
    up, down = next(letters), next(letters)
    terms, ops = [], [env]
    for side, layers, offset in (("bra", bra, 0), ("ket", ket, len(bra))):
        legs = [up] + [next(letters) for _ in layers[:-1]] + [down]
        for i, core in enumerate(layers):
            terms.append(f"{left[offset + i]}{right[offset + i]}{legs[i]}{legs[i + 1]}")
            ops.append(core.conj() if side == "bra" else core)
    spec = f"{''.join(left)},{','.join(terms)}->{''.join(right)}"
    return torch.einsum(spec, *ops)


def rel_diff(x, y, device: str, xx: float | None = None) -> float:
    """``|x - y| / |x|`` from inner products (``xx``: ``<x|x>``, when already known)."""
    xx = inner(x, x, device).real if xx is None else xx
    yy, xy = inner(y, y, device).real, inner(x, y, device).real
    return float(np.sqrt(max(xx + yy - 2 * xy, 0.0) / xx)) if xx > 0 else float("nan")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int, device: str) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def run_case(n, chi, dtype, reps, exact, resources, log, device):
    import src_method

    where = "gpu" if device == "cuda" else "cpu"
    rng = np.random.default_rng(0)
    a, b = random_mpo(n, chi, rng, dtype), perturbed_identity(n, rng, dtype)
    # Scale A to norm 1, spread over the sites: a random MPO's norm falls like
    # chi^(-n/2), past the range of complex64 and of one site's entries.
    per_site = inner([a], [a], device).real ** (-0.5 / n)
    a = [(site * per_site).astype(dtype) for site in a]

    def ours():
        return tn.apply(a, b, chi, seed=1, device=where, resources=resources)

    def theirs():
        return src_method.apply(a, b, chi, seed=1, device=where)

    ours(), theirs()  # warm-up
    ours_times, theirs_times = [], []
    for _ in range(reps):
        log.clear()
        t, x = timed(ours, 1, device)
        ours_times.append(t)
        t, y = timed(theirs, 1, device)
        theirs_times.append(t)
    t_ours, t_theirs = statistics.median(ours_times), statistics.median(theirs_times)
    y = [np.asarray(c) for c in y]
    row = {
        "case": f"MPO.MPO n={n} chi={chi} {dtype}" + (" out-of-core" if resources else ""),
        "sexpgpu.tn s": t_ours,
        "src-method s": t_theirs,
        "ratio": t_theirs / t_ours,
        "error between": rel_diff([x], [y], device),
    }
    if exact:
        norm = inner([a, b], [a, b], device).real  # the exact product's, once for both
        row["error sexpgpu.tn"] = rel_diff([a, b], [x], device, norm)
        row["error src-method"] = rel_diff([a, b], [y], device, norm)
    row["QR fallbacks"] = log.fallbacks
    row["log"] = list(log.lines)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[25, 50])
    parser.add_argument("--chi", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["complex128", "complex64"])
    parser.add_argument("--exact", action="store_true", help="errors against the exact A B")
    parser.add_argument("--gpu-memory", default="2GiB", help="budget of the out-of-core case")
    parser.add_argument("--products", choices=PRODUCTS, help="sexpgpu.tn's on the GPU")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny run on the CPU (both peers), for CI"
    )
    args = parser.parse_args()
    if args.products:
        backend.GPU_PRODUCTS = args.products
    device = "cuda"
    if args.smoke:  # every path of the script, in seconds, without a GPU
        args.sites, args.chi, args.reps, args.exact, args.gpu_memory = [6], 8, 1, True, ""
        device = "cpu"
    log = PlanLog()
    logger = logging.getLogger("sexpgpu.tn")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(log)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (smoke)"
    chosen = backend.TorchBackend(Device("cuda", 0)).products if device == "cuda" else None
    print(f"# {name}, torch {torch.__version__}, products and double Gram matrices {chosen}")
    cases = [(n, dtype, None) for n in args.sites for dtype in args.dtypes]
    if args.gpu_memory:
        cases.append((max(args.sites), "complex128", tn.Resources(gpu_memory=args.gpu_memory)))
    for n, dtype, budget in cases:  # each row as soon as it is measured
        try:
            exact = args.exact and not budget
            row = run_case(n, args.chi, dtype, args.reps, exact, budget, log, device)
        except MemoryError as err:  # a budget below the working set is refused
            print(f"MPO.MPO n={n} chi={args.chi} {dtype} under {budget}: {err}", flush=True)
            continue
        lines = row.pop("log")
        print(
            " | ".join(
                f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()
            ),
            flush=True,
        )
        for line in lines:
            print("    ", line, flush=True)


if __name__ == "__main__":
    main()
