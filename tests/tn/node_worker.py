"""One node of a multi-node `src` (run by test_tn_nodes.py as its own process).

    python node_worker.py OUT.npz CASE [fail]

The node variables come from the environment. The problem is built from fixed
seeds, so every node holds the same trains; ``fail`` makes this node's sweep
raise at its third left-to-right site.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
from tn_helpers import random_mpo, random_mps, wrapped_seams

from sexpgpu.errors import SexpgpuError
from sexpgpu.tn import Resources, src


def problem(case: str) -> tuple[list, dict]:
    """(trains, keywords) of a named case."""
    rng = np.random.default_rng(7)
    if case == "ket":
        return [random_mpo(9, 3, rng), random_mps(9, 6, rng)], {"chi_out": 7, "seed": 3}
    if case == "complex-oversampled":
        a = random_mpo(8, 2, rng, dtype=np.complex128)
        b = random_mpo(8, 3, rng, dtype=np.complex128)
        return [a, b], {"chi_out": 5, "seed": 11, "oversample": None}
    if case == "torch-backend":  # the GPU code path, on PyTorch's CPU device
        trains = [random_mpo(8, 2, rng, dtype=np.complex128), random_mps(8, 5, rng, np.complex128)]
        return trains, {"chi_out": 6, "seed": 2, "backend": "torch"}
    if case == "gpu":  # benches/tn_session.sh: nodes sharing one GPU (over Gloo)
        a = random_mpo(10, 8, rng, dtype=np.complex64)
        b = random_mpo(10, 3, rng, dtype=np.complex64)
        return [a, b], {"chi_out": 16, "seed": 4, "device": "gpu"}
    if case == "two-devices":
        trains = [random_mpo(8, 3, rng), random_mps(8, 5, rng)]
        return trains, {"chi_out": 6, "seed": 5, "resources": Resources(devices=2)}
    raise ValueError(case)


def solve(trains: list, kw: dict) -> list:
    """`src` of a case (the torch case through the seam that picks the backend)."""
    kw = dict(kw)
    if kw.pop("backend", None) is None:
        return src(*trains, **kw)
    with wrapped_seams(backend="torch"):
        return src(*trains, **kw)


def main() -> int:
    out, case = sys.argv[1], sys.argv[2]
    if sys.argv[3:] == ["fail"]:
        from sexpgpu.tn import sweep

        real = sweep.env_step
        calls = [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("simulated failure of this node")
            return real(*args, **kwargs)

        sweep.env_step = failing
    trains, kw = problem(case)
    try:
        result = solve(trains, kw)
    except SexpgpuError as err:
        np.savez(out, code=err.code, message=str(err))
        return 3
    np.savez(out, *result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
