"""Compare two run directories' training losses step by step (e.g. cpu vs cuda).

    python benches/compare_runs.py runs/cpu runs/cuda [--rtol 2e-2]
    python benches/compare_runs.py --smoke     # two 20-step runs of examples/mlp.lisp (CI)

Prints the largest relative difference of ``train/loss`` and ``eval/loss``
and exits 1 when it exceeds `--rtol` (bf16 tolerance by default). With
``--smoke`` it first trains examples/mlp.lisp twice for 20 steps on the cpu
device and compares the two runs at ``--rtol 0`` (one seed: the same bits).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from sexpgpu.train.metrics import read_series

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mlp.lisp"


def compare(first: Path, second: Path, rtol: float) -> int:
    """Print the largest differences of two runs' losses; 0 when within `rtol`."""
    worst = 0.0
    for name in ("train/loss", "eval/loss"):
        a, b = read_series(first, name), read_series(second, name)
        steps = sorted(set(a) & set(b))
        diffs = [abs(a[s] - b[s]) / abs(a[s]) for s in steps]
        top = max(diffs, default=float("nan"))
        worst = max(worst, top)
        last = steps[-1] if steps else None
        print(
            f"{name}: {len(steps)} steps, largest relative difference {top:.2e}; "
            f"step {last}: {a.get(last)} vs {b.get(last)}"
        )
    ok = worst <= rtol
    print(f"{'within' if ok else 'OUTSIDE'} rtol {rtol}")
    return 0 if ok else 1


def smoke() -> int:
    """Two runs of the digits MLP with one seed, compared bit for bit."""
    from sexpgpu.train import run_experiment

    with tempfile.TemporaryDirectory() as tmp:
        runs = [Path(tmp, name) for name in ("a", "b")]
        for out in runs:
            run_experiment(EXAMPLE, steps=20, out=out)
        return compare(*runs, rtol=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, nargs="?")
    parser.add_argument("b", type=Path, nargs="?")
    parser.add_argument("--rtol", type=float, default=2e-2)
    parser.add_argument("--smoke", action="store_true", help="compare two runs of mlp.lisp")
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    if args.a is None or args.b is None:
        parser.error("name two run directories (or --smoke)")
    return compare(args.a, args.b, args.rtol)


if __name__ == "__main__":
    sys.exit(main())
