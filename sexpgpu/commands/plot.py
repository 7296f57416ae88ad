"""``sexpgpu plot RUN [RUN ...]``: a PNG of runs' metrics, one panel per kind, runs side by side."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.train.metrics import read_series

__all__ = ["DESCRIPTION", "EPILOG", "PANELS", "add_arguments", "main", "plot_runs"]

DESCRIPTION = """\
Draw runs' metrics into one PNG, a panel each: the loss (train and eval), the
learning rate, the gradient norm, the eval accuracy (when a run has one) and
tokens/s, against the step. Several runs are drawn in the same panels, a
color each. --smooth N draws the train series as the mean of their last N
points over the raw ones. Points that are NaN, infinite or too large to draw
(beyond 1e300) are left out, and each panel says how many."""

EPILOG = """\
examples:
  sexpgpu plot runs/train
  sexpgpu plot runs/train runs/train-2 --smooth 20 -o compare.png"""

_LIMIT = 1e300  # larger values overflow matplotlib's axis arithmetic


@dataclass(frozen=True)
class Panel:
    """One panel: its title and the metrics drawn in it (label -> name, smoothed or not)."""

    title: str
    series: tuple[tuple[str, str, bool], ...]
    optional: bool = False  # drawn only when some run has its metrics


PANELS = (
    Panel("loss", (("train", "train/loss", True), ("eval", "eval/loss", False))),
    Panel("learning rate", (("lr", "train/lr", False),)),
    Panel("gradient norm", (("grad norm", "train/grad_norm", True),)),
    Panel("eval accuracy", (("eval", "eval/accuracy", False),), optional=True),
    Panel("tokens/s", (("tokens/s", "train/tokens_per_s", True),)),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `sexpgpu plot`."""
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help="run folders holding metrics.jsonl (one or more)"
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="PNG",
        help="the image (default RUN/loss.png for one run, plot.png here for several)",
    )
    parser.add_argument(
        "--smooth", type=int, default=1, metavar="N", help="mean of the last N points (1: raw)"
    )


def _pyplot() -> Any:
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
    return plt


def _read_run(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every plotted metric of a run (E-PLOT-002 without train/loss, E-PLOT-003 unreadable)."""
    path = run_dir / "metrics.jsonl"
    if path.exists() and not path.is_file():
        raise SexpgpuError(
            "E-PLOT-003",
            f"{path} is not a file",
            str(path),
            hint="point at a run folder: metrics.jsonl is the file `sexpgpu run` writes",
        )
    try:
        series = {name: read_series(run_dir, name) for p in PANELS for _, name, _ in p.series}
    except OSError as err:
        raise SexpgpuError(
            "E-PLOT-003",
            f"cannot read {path}: {err.strerror or err}",
            str(path),
            hint="check the file's permissions",
        ) from None
    if not _points(series["train/loss"])[0]:
        what = "no train/loss records" + (" that can be drawn" if series["train/loss"] else "")
        raise SexpgpuError(
            "E-PLOT-002",
            f"{path} has {what}" if path.exists() else f"{path} does not exist",
            str(path),
            hint="point at the directory of a run (`sexpgpu run` writes runs/RUN-NAME by default)",
        )
    return series


def _points(series: dict[Any, Any]) -> tuple[list[int], list[float], int]:
    """The drawable (step, value) points in step order, and how many were left out."""
    steps, values, dropped = [], [], 0
    for step, value in sorted((k, v) for k, v in series.items() if _is_step(k)):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and math.isfinite(value) and abs(value) <= _LIMIT:
            steps.append(step)
            values.append(float(value))
        else:
            dropped += 1
    return steps, values, dropped


def _is_step(step: object) -> bool:
    return isinstance(step, int) and not isinstance(step, bool)


def _smoothed(values: list[float], n: int) -> list[float]:
    """The mean of each point and the n - 1 before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def plot_runs(run_dirs: list[Path], output: Path, smooth: int = 1) -> Path:
    """Draw the `PANELS` of every run of `run_dirs` into the image `output`."""
    if smooth < 1:
        raise SexpgpuError(
            "E-CLI-001", f"--smooth {smooth} is not positive", "--smooth",
            hint="give --smooth 1 (raw) or more points to average",
        )  # fmt: skip
    plt = _pyplot()
    runs = {str(d): _read_run(d) for d in run_dirs}
    panels = [
        p
        for p in PANELS
        if not p.optional or any(s[name] for s in runs.values() for _, name, _ in p.series)
    ]
    cols = 2
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.6 * rows), dpi=100, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels, strict=False):
        dropped = 0
        for r, (run, series) in enumerate(runs.items()):
            color = colors[r % len(colors)]
            for label, name, smoothable in panel.series:
                steps, values, left_out = _points(series[name])
                dropped += left_out
                if not steps:
                    continue
                tag = f"{run} {label}" if len(runs) > 1 else label
                style = {"color": color, "linestyle": "--" if label == "eval" else "-"}
                if label == "eval" and len(steps) < 50:
                    style["marker"] = "o"
                if smoothable and smooth > 1:
                    ax.plot(steps, values, alpha=0.25, color=color)
                    values = _smoothed(values, smooth)
                ax.plot(steps, values, label=tag, **style)
        title = panel.title + (
            f" ({dropped} points not drawn: NaN, inf or huge)" if dropped else ""
        )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(", ".join(runs) if len(runs) < 4 else f"{len(runs)} runs")
    fig.tight_layout()
    return _save(plt, fig, output)


def _save(plt: Any, fig: Any, output: Path) -> Path:
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


def main(args: argparse.Namespace) -> int:
    """Write the plot of the run folders and print where."""
    run_dirs = []
    for text in args.runs:
        run_dir = Path(text)
        if run_dir.name == "metrics.jsonl" and run_dir.is_file():  # the file itself was named
            run_dir = run_dir.parent
        run_dirs.append(run_dir)
    if args.output:
        output = Path(args.output)
    else:
        output = run_dirs[0] / "loss.png" if len(run_dirs) == 1 else Path("plot.png")
    print(f"wrote {plot_runs(run_dirs, output, args.smooth)}")
    return 0
