"""``sexpgpu run FILE``: train a run of an experiment and write its run directory."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sexpgpu.train.loop import StepReport
from sexpgpu.train.runner import prepare_run

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `sexpgpu run`."""
    parser.add_argument("file", help="the experiment file (.lisp)")
    parser.add_argument("--variant", help="apply this defvariant")
    parser.add_argument("--run", help="the defrun to train (default: the only one)")
    parser.add_argument("--steps", type=int, help="optimizer steps (overrides :steps)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: SEXPGPU_DEVICE or cpu")
    parser.add_argument(
        "--resume",
        metavar="latest|PATH",
        help="continue from the newest complete checkpoint, or from a step-N folder",
    )
    parser.add_argument("--out", metavar="DIR", help="the run directory (default runs/RUN-NAME)")


def _plain_progress(steps: int) -> Any:
    every = max(1, steps // 20)

    def show(r: StepReport) -> None:
        if r.step % every and r.step != r.steps and r.eval_step != r.step:
            return
        line = (
            f"step {r.step}/{r.steps}  loss {r.loss:.4f}  lr {r.lr:.3g}  "
            f"grad-norm {r.grad_norm:.3g}  {r.tokens_per_s:,.0f} tok/s  eta {r.eta_s:.0f}s"
        )
        if r.eval_step == r.step:
            line += f"  eval {r.eval_loss:.4f}"
            if r.eval_accuracy is not None:
                line += f"  acc {r.eval_accuracy:.3f}"
        print(line, flush=True)

    return show


class _RichProgress:
    """A rich progress bar with the latest loss, for terminals."""

    def __init__(self, steps: int) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self.task = self.progress.add_task("train", total=steps, info="")

    def __call__(self, r: StepReport) -> None:
        info = f"loss {r.loss:.4f}  {r.tokens_per_s:,.0f} tok/s"
        if r.eval_loss is not None:
            info += f"  eval {r.eval_loss:.4f}"
        if r.eval_accuracy is not None:
            info += f"  acc {r.eval_accuracy:.3f}"
        self.progress.update(self.task, completed=r.step, info=info)


def main(args: argparse.Namespace) -> int:
    """Train the run with progress on stdout; exit status 0 when it finishes."""
    trainer = prepare_run(
        args.file,
        variant=args.variant,
        run=args.run,
        steps=args.steps,
        out=args.out,
        resume=args.resume,
        device=args.device,
    )
    steps = trainer.settings.steps
    if sys.stdout.isatty():
        display = _RichProgress(steps)
        trainer.on_step = display
        with display.progress:
            summary = trainer.run()
    else:
        trainer.on_step = _plain_progress(steps)
        summary = trainer.run()
    done = f"done: step {summary.step}"
    if summary.loss is not None:
        done += f", loss {summary.loss:.4f}"
    if summary.eval_loss is not None:
        done += f", eval loss {summary.eval_loss:.4f}"
    if summary.eval_accuracy is not None:
        done += f", eval accuracy {summary.eval_accuracy:.4f}"
    print(f"{done}, {summary.seconds:.1f}s -> {trainer.run_dir}")
    return 0
