"""``sexpgpu plot RUN_DIR``: a PNG of the train and eval loss against the step."""

from __future__ import annotations

import argparse
from pathlib import Path

from sexpgpu.errors import SexpgpuError
from sexpgpu.train.metrics import read_metrics

__all__ = ["add_arguments", "main", "plot_losses"]


DESCRIPTION = """\
Draw a run's metrics into a PNG: the train and eval loss against the step."""

EPILOG = """\
examples:
  sexpgpu plot runs/train
  sexpgpu plot runs/train -o loss.png"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `sexpgpu plot`."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with metrics.jsonl")
    parser.add_argument("--output", "-o", metavar="PNG", help="default RUN_DIR/loss.png")


def plot_losses(run_dir: Path, output: Path) -> Path:
    """Draw ``train/loss`` and ``eval/loss`` of `run_dir` into the PNG `output`."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise SexpgpuError(
            "E-PLOT-001",
            "sexpgpu plot needs matplotlib, which is not installed",
            "plot",
            hint="pip install 'sexpgpu[plot]'",
        ) from None
    path = run_dir / "metrics.jsonl"
    series: dict[str, tuple[list[int], list[float]]] = {
        "train/loss": ([], []),
        "eval/loss": ([], []),
    }
    for record in read_metrics(path):
        if record["name"] in series and _is_point(record):
            series[record["name"]][0].append(record["step"])
            series[record["name"]][1].append(record["value"])
    if not series["train/loss"][0]:
        raise SexpgpuError(
            "E-PLOT-002",
            f"{path} has no train/loss records" if path.exists() else f"{path} does not exist",
            str(path),
            hint="point at the directory of a run (`sexpgpu run` writes runs/RUN-NAME by default)",
        )
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for name, (steps, values) in series.items():
        if steps:
            ax.plot(steps, values, label=name, marker="o" if name == "eval/loss" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(str(run_dir))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    if not output.suffix:  # matplotlib would add `.png` itself; name the file it writes
        output = output.with_name(output.name + ".png")
    formats = fig.canvas.get_supported_filetypes()
    if output.suffix[1:].lower() not in formats:
        plt.close(fig)
        raise SexpgpuError(
            "E-CLI-001",
            f"cannot write {output}: matplotlib writes no `{output.suffix}` images",
            str(output),
            hint=f"end --output with .png or another of {', '.join(sorted(formats))}",
        )
    try:
        fig.savefig(output)
    except OSError as err:
        raise SexpgpuError(
            "E-CLI-001",
            f"cannot write {output}: {err.strerror or err}",
            str(output),
            hint="choose a --output PNG in a folder you can write to",
        ) from None
    finally:
        plt.close(fig)
    return output


def _is_point(record: dict[str, object]) -> bool:
    # A hand-edited or damaged line may hold a record whose step or value is not a number.
    step, value = record["step"], record["value"]
    numbers = isinstance(step, int) and isinstance(value, (int, float))
    return numbers and not isinstance(step, bool) and not isinstance(value, bool)


def main(args: argparse.Namespace) -> int:
    """Write the loss plot of a run directory and print where."""
    run_dir = Path(args.run_dir)
    if run_dir.name == "metrics.jsonl" and run_dir.is_file():  # the file itself was named
        run_dir = run_dir.parent
    output = Path(args.output) if args.output else run_dir / "loss.png"
    print(f"wrote {plot_losses(run_dir, output)}")
    return 0
