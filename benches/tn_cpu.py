"""sexpgpu.tn against src-method 0.5.0 and quimb 1.15 on the CPU, in one run.

Every case runs each peer on the same inputs, interleaved, ``--reps`` times, and
reports the median wall time, the median CPU time of the process (every peer
is single-threaded under ``--threads 1``, so on a machine other work loads it
compares their work where wall times mostly measure the scheduler), and the
relative error against the exact,
uncompressed product. The error is computed from inner products of the
uncompressed network and the result in quimb, never densely:
``|x - y|^2 = |x|^2 + |y|^2 - 2 Re <x|y>``.

Peers: ``sexpgpu.tn.src`` (also with the paper's oversampling,
``oversample=None``); ``src_method.src``; quimb's ``src`` compression of
the lazy product network (``tensor_network_1d_compress(method="src")``); and
quimb's fastest exact method, ``dm`` (faster than ``direct`` here).

Run from the repository root::

    python benches/tn_cpu.py [--reps 5] [--threads 1] [--only NAME] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _threads_from_argv() -> None:
    # BLAS reads its thread count at import, so it is set before NumPy loads.
    if "--threads" in sys.argv:
        n = sys.argv[sys.argv.index("--threads") + 1]
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = n


_threads_from_argv()

import numpy as np  # noqa: E402
import quimb.tensor as qtn  # noqa: E402
import src_method  # noqa: E402
from quimb.tensor.tn1d.compress import tensor_network_1d_compress  # noqa: E402
from quimb.tensor.tnag.core import (  # noqa: E402
    tensor_network_apply_op_op,
    tensor_network_apply_op_vec,
)

import sexpgpu.tn as tn  # noqa: E402
from sexpgpu.tn import gemm3m  # noqa: E402

DTYPE = "complex128"
# Errors from inner products cancel to about sqrt(machine epsilon) of the norm.
ERROR_FLOOR = 1e-7


# --- inputs -----------------------------------------------------------------


def trotter_mpo(n: int, dt: float = 0.1, seed: int = 0) -> qtn.MatrixProductOperator:
    """One Trotter step of a disordered Heisenberg chain as an MPO of bond 4.

    ``U = U_odd U_even``, each layer a brick of two-site gates; every bond is
    crossed by one gate, split by an SVD into two halves.
    """
    rng = np.random.default_rng(seed)
    x = np.array([[0, 1], [1, 0]], dtype=complex)
    y = np.array([[0, -1j], [1j, 0]])
    z = np.diag([1.0 + 0j, -1.0])
    halves = {}
    for j in range(n - 1):
        h = np.kron(x, x) + np.kron(y, y) + np.kron(z, z)
        h = (
            h
            + rng.uniform(-1, 1) * np.kron(z, np.eye(2))
            + rng.uniform(-1, 1) * np.kron(np.eye(2), z)
        )
        w, v = np.linalg.eigh(h)
        gate = (v * np.exp(-1j * dt * w)) @ v.conj().T  # (ua ub, da db)
        m = gate.reshape(2, 2, 2, 2).transpose(0, 2, 1, 3).reshape(4, 4)  # (ua da, ub db)
        u, s, vh = np.linalg.svd(m)
        left = (u * np.sqrt(s)).reshape(2, 2, 4).transpose(2, 0, 1)  # (k, u, d)
        right = (np.sqrt(s)[:, None] * vh).reshape(4, 2, 2)  # (k, u, d)
        halves[j] = (left, right)
    eye = np.eye(2, dtype=complex)[None]
    arrays = []
    for j in range(n):
        from_left = halves[j - 1][1] if j > 0 else eye  # gate (j-1, j): bond l
        to_right = halves[j][0] if j < n - 1 else eye  # gate (j, j+1): bond r
        # even gates act first: W = odd @ even on the physical legs
        even, odd = (to_right, from_left) if j % 2 == 0 else (from_left, to_right)
        w = np.einsum("aux,bxd->abud", odd, even)  # (odd bond, even bond, u, d)
        # on even sites the odd gate's bond is l; on odd sites it is r
        site = w if j % 2 == 0 else w.transpose(1, 0, 2, 3)
        if j == 0:
            site = site[0]
        elif j == n - 1:
            site = site[:, 0]
        arrays.append(np.ascontiguousarray(site))
    return qtn.MatrixProductOperator(arrays)


def random_mpo(n: int, bond: int, seed: int) -> qtn.MatrixProductOperator:
    return qtn.MPO_rand(n, bond, phys_dim=2, dtype=DTYPE, seed=seed)


def random_mps(n: int, chi: int, seed: int) -> qtn.MatrixProductState:
    return qtn.MPS_rand_state(n, chi, phys_dim=2, dtype=DTYPE, seed=seed)


def perturbed_identity(n: int, seed: int) -> qtn.MatrixProductOperator:
    eye = qtn.MPO_identity(n, phys_dim=2, dtype=DTYPE)
    return eye + 1e-8 * qtn.MPO_rand(n, 3, phys_dim=2, dtype=DTYPE, seed=seed)


def smoke_cases() -> list[tuple[str, list, int]]:
    """One tiny case of each kind, for CI."""
    return [
        ("MPO.MPS random n=6 chi=4", [random_mpo(6, 2, 1), random_mps(6, 4, 2)], 4),
        ("MPO.MPO rand x (1+eps) n=6 chi=4", [random_mpo(6, 4, 5), perturbed_identity(6, 6)], 4),
        (
            "U.U.MPS Trotter n=6 chi=4",
            [trotter_mpo(6, seed=7), trotter_mpo(6, seed=8), random_mps(6, 4, 9)],
            4,
        ),
    ]


def make_cases() -> list[tuple[str, list, int]]:
    """(name, quimb trains in mathematical order, chi_out)."""
    cases = []
    for n, chi in [(20, 32), (20, 100), (30, 64)]:
        cases.append(
            (f"MPO.MPS random n={n} chi={chi}", [random_mpo(n, 4, 1), random_mps(n, chi, 2)], chi)
        )
        cases.append(
            (
                f"MPO.MPS Trotter n={n} chi={chi}",
                [trotter_mpo(n, seed=3), random_mps(n, chi, 4)],
                chi,
            )
        )
    for chi in (50, 100):
        cases.append(
            (
                f"MPO.MPO rand x (1+eps) n=20 chi={chi}",
                [random_mpo(20, chi, 5), perturbed_identity(20, 6)],
                chi,
            )
        )
    cases.append(
        (
            "U.U.MPS Trotter n=30 chi=64",
            [trotter_mpo(30, seed=7), trotter_mpo(30, seed=8), random_mps(30, 64, 9)],
            64,
        )
    )
    return cases


# --- the peers -----------------------------------------------------------------


def lazy_network(trains: list) -> qtn.TensorNetwork:
    """The uncompressed product as a quimb network (no contraction)."""
    net = trains[-1]
    for op in reversed(trains[:-1]):
        if isinstance(net, qtn.MatrixProductState) or hasattr(net, "site_ind_id"):
            net = tensor_network_apply_op_vec(op, net, contract=False)
        else:
            net = tensor_network_apply_op_op(op, net, contract=False)
    return net


def _wrap(arrays: list, is_mps: bool):
    return qtn.MatrixProductState(arrays) if is_mps else qtn.MatrixProductOperator(arrays)


def peers(trains: list, chi: int, is_mps: bool) -> dict:
    arrays = [list(t.arrays) for t in trains]
    return {
        "sexpgpu.tn": lambda seed: _wrap(tn.src(*arrays, chi_out=chi, seed=seed), is_mps),
        "src-method": lambda seed: _wrap(src_method.src(*arrays, chi_out=chi, seed=seed), is_mps),
        "sexpgpu.tn oversample=None": lambda seed: _wrap(
            tn.src(*arrays, chi_out=chi, seed=seed, oversample=None), is_mps
        ),
        "quimb src": lambda seed: tensor_network_1d_compress(
            lazy_network(trains), max_bond=chi, cutoff=0.0, method="src"
        ),
        "quimb dm": lambda seed: tensor_network_1d_compress(
            lazy_network(trains), max_bond=chi, cutoff=0.0, method="dm"
        ),
    }


# --- errors ------------------------------------------------------------------


def dot(x: qtn.TensorNetwork, y: qtn.TensorNetwork) -> complex:
    """<x|y> (Frobenius for operators), contracted along the chain."""
    bra = x.H
    bra.mangle_inner_()
    return complex((bra & y) ^ ...)


def rel_error(ref: qtn.TensorNetwork, ref_norm2: float, out: qtn.TensorNetwork) -> float:
    d2 = ref_norm2 + dot(out, out).real - 2 * dot(ref, out).real
    return float(np.sqrt(max(d2, 0.0) / ref_norm2))


# --- driver ------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=str, default=None, help="BLAS threads for every peer")
    parser.add_argument("--only", type=str, default=None, help="run cases whose name holds this")
    parser.add_argument("--skip", type=str, default="", help="comma-separated peers to skip")
    parser.add_argument("--smoke", action="store_true", help="tiny cases, one rep (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.reps = 1
    skip = {s for s in args.skip.split(",") if s}

    # Warm every peer once (imports, path caches) on a small case.
    small = [random_mpo(6, 2, 0), random_mps(6, 4, 0)]
    for fn in peers(small, 4, True).values():
        fn(0)

    # Whether sexpgpu.tn's host products take the 3M GEMM here (timed once per process).
    print(
        f"threads={os.environ.get('OPENBLAS_NUM_THREADS', 'default')} reps={args.reps} "
        f"3M products={gemm3m.choices()}"
    )
    header = (
        "| case | peer | median s | median CPU s | rel. error | time vs sexpgpu.tn "
        "| CPU time vs sexpgpu.tn |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|")
    for name, trains, chi in smoke_cases() if args.smoke else make_cases():
        if args.only and args.only not in name:
            continue
        is_mps = isinstance(trains[-1], qtn.MatrixProductState)
        ref = lazy_network(trains)
        ref_norm2 = dot(ref, ref).real
        runs = {k: v for k, v in peers(trains, chi, is_mps).items() if k not in skip}
        times: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        errors: dict[str, float] = {}
        for rep in range(args.reps):
            for peer, fn in runs.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                out = fn(rep)
                times[peer].append(time.perf_counter() - start)
                cpu[peer].append(time.process_time() - start_cpu)
                if rep == 0:
                    errors[peer] = rel_error(ref, ref_norm2, out)
        base = float(np.median(times["sexpgpu.tn"]))
        base_cpu = float(np.median(cpu["sexpgpu.tn"]))
        for peer in runs:
            med, med_cpu = float(np.median(times[peer])), float(np.median(cpu[peer]))
            err = f"{errors[peer]:.3e}" if errors[peer] >= ERROR_FLOOR else f"< {ERROR_FLOOR:.0e}"
            print(
                f"| {name} | {peer} | {med:.3f} | {med_cpu:.3f} | {err} | {med / base:.2f}x | "
                f"{med_cpu / base_cpu:.2f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
