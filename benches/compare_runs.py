"""Compare two run directories' training losses step by step (e.g. cpu vs cuda).

    python benches/compare_runs.py runs/cpu runs/cuda [--rtol 2e-2]

Prints the largest relative difference of ``train/loss`` and ``eval/loss``
and exits 1 when it exceeds `--rtol` (bf16 tolerance by default).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sexpgpu.train.metrics import read_series


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--rtol", type=float, default=2e-2)
    args = parser.parse_args()
    worst = 0.0
    for name in ("train/loss", "eval/loss"):
        a, b = read_series(args.a, name), read_series(args.b, name)
        steps = sorted(set(a) & set(b))
        diffs = [abs(a[s] - b[s]) / abs(a[s]) for s in steps]
        top = max(diffs, default=float("nan"))
        worst = max(worst, top)
        last = steps[-1] if steps else None
        print(
            f"{name}: {len(steps)} steps, largest relative difference {top:.2e}; "
            f"step {last}: {a.get(last)} vs {b.get(last)}"
        )
    ok = worst <= args.rtol
    print(f"{'within' if ok else 'OUTSIDE'} rtol {args.rtol}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
