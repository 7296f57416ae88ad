"""The smoke GPT's eval loss under each optimizer: `adamw` (the file's) against `muon`.

    python benches/optimizers.py [--steps 300] [--out DIR] [--smoke]

Each optimizer trains a copy of ``examples/gpt.lisp`` whose ``:optimizer``
form is replaced (variants override parameters, not forms), through the
command line a user types::

    python -m sexpgpu run COPY.lisp --variant smoke --device cpu --out OUT/NAME

and the table gives each eval loss (every 50 steps, 20 batches) and the
time. Each call trains into a folder of its own (``runs/optimizers/DATE-TIME``
unless `--out` names one; a temporary one at `--smoke`), so a second call
never meets the first one's checkpoints. `--smoke` runs 4 steps of each, to
check the script (CI).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sexpgpu.train.metrics import read_series

ROOT = Path(__file__).resolve().parents[1]
ADAMW = "(adamw :lr lr :betas [0.9 0.95] :weight-decay 0.1)"
FORMS = {
    "adamw": ADAMW,
    # Muon's own defaults (lr 0.02, momentum 0.95, Nesterov, 5 steps) on the hidden
    # matrices; the embedding, the tied head and the vectors on AdamW at the file's rate.
    "muon": "(muon :lr 0.02 :adamw-lr lr :betas [0.9 0.95])",
}


def train(name: str, out: Path, steps: int) -> float:
    """Run the copy of the file with optimizer `name`; the seconds it took."""
    text = (ROOT / "examples" / "gpt.lisp").read_text()
    assert ADAMW in text, "examples/gpt.lisp's optimizer changed: update FORMS"
    copy = out / f"gpt_{name}.lisp"
    copy.write_text(text.replace(ADAMW, FORMS[name]))
    command = [sys.executable, "-m", "sexpgpu", "run", str(copy), "--variant", "smoke"]
    command += ["--device", "cpu", "--steps", str(steps), "--out", str(out / name)]
    began = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, help="a new folder (default: one of this call's)")
    parser.add_argument("--smoke", action="store_true", help="4 steps of each (CI)")
    args = parser.parse_args()
    steps = 4 if args.smoke else args.steps
    if args.out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.out = Path(tempfile.mkdtemp()) if args.smoke else Path("runs/optimizers") / stamp
    args.out.mkdir(parents=True, exist_ok=True)
    print("| optimizer | eval loss by step | train loss at the end | time |")
    print("|---|---|---|---|")
    for name in FORMS:
        seconds = train(name, args.out, steps)
        evals = read_series(args.out / name, "eval/loss")
        losses = read_series(args.out / name, "train/loss")
        assert max(losses) == steps, (name, sorted(losses)[-3:])
        shown = ", ".join(f"{s}: {v:.4f}" for s, v in sorted(evals.items()))
        print(f"| {name} | {shown or '-'} | {losses[steps]:.4f} | {seconds:.0f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
