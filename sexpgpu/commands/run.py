"""``sexpgpu run FILE``: train a run of an experiment and write its run directory."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sexpgpu.commands.options import add_experiment_options
from sexpgpu.lang.runs import LOGGERS
from sexpgpu.runtime.devices import DEVICE_KINDS
from sexpgpu.train.loop import StepReport
from sexpgpu.train.resume import claimed_note
from sexpgpu.train.runner import prepare_run

__all__ = ["add_arguments", "duration", "main"]


DESCRIPTION = """\
Train a run of an experiment file: compile it, then step, evaluate and
checkpoint as its defrun says, on the cpu (the IR interpreter) or on GPUs.
Records go to the run folder (default runs/RUN-NAME): metrics.jsonl,
status.json, run.json and checkpoints/step-N. --set changes a defparams value
after the variant; --resume continues a run; --init-from starts from a Hugging
Face transformers folder; --log mirrors the metrics to TensorBoard or W&B."""

EPILOG = """\
examples:
  sexpgpu run examples/gpt.lisp --variant smoke --steps 200
  sexpgpu run examples/gpt.lisp --variant smoke --set lr=3e-4 --resume latest --steps 300"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `sexpgpu run`."""
    add_experiment_options(parser, "the defrun to train (default: the only one)")
    parser.add_argument("--steps", type=int, help="optimizer steps (overrides :steps)")
    parser.add_argument(
        "--device", choices=DEVICE_KINDS, help=f"default: SEXPGPU_DEVICE or {DEVICE_KINDS[0]}"
    )
    parser.add_argument(
        "--resume",
        metavar="latest|PATH",
        help="continue from the newest complete checkpoint, or from a step-N folder",
    )
    parser.add_argument("--out", metavar="DIR", help="the run directory (default runs/RUN-NAME)")
    parser.add_argument(
        "--log",
        action="append",
        default=[],
        choices=LOGGERS,
        help="mirror the metrics to tensorboard (event files in the run folder) or wandb "
        "(offline without WANDB_API_KEY); repeatable, beside the run's :log",
    )
    parser.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from a transformers folder (GPT-2 or Llama) of the model's sizes",
    )


def duration(seconds: float) -> str:
    """A time left as people read it: ``42s``, ``12m05s``, ``3h07m``, ``4d03h``."""
    if seconds != seconds:  # NaN
        return "-"
    if seconds >= 1e4 * 86400:  # a --steps far beyond what this machine will see
        return ">10000d"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 48 * 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def first_step_line(seconds: float, startup: tuple[tuple[str, float], ...] = ()) -> str:
    """``first step after 3.2 s``: the wait from the command's start, compiling included.

    With `startup`, its phases: ``...: front end 0.4 s, plan 1.9 s, load 0.3 s, step 0.6 s``.
    """
    line = f"first step after {seconds:.1f} s (runtime/first_step_s)"
    if startup:
        line += ": " + ", ".join(f"{phase} {s:.1f} s" for phase, s in startup)
    return line


def _plain_progress(steps: int) -> Any:
    every = max(1, steps // 20)

    def show(r: StepReport) -> None:
        if r.first_step_s is not None:
            print(first_step_line(r.first_step_s, r.startup), flush=True)
        if r.step % every and r.step != r.steps and r.eval_step != r.step:
            return
        line = (
            f"step {r.step}/{r.steps}  loss {r.loss:.4f}  lr {r.lr:.3g}  "
            f"grad-norm {r.grad_norm:.3g}  {r.tokens_per_s:,.0f} {r.unit}/s  "
            f"eta {duration(r.eta_s)}"
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
        if r.first_step_s is not None:
            self.progress.console.print(first_step_line(r.first_step_s, r.startup))
        info = f"loss {r.loss:.4f}  {r.tokens_per_s:,.0f} {r.unit}/s"
        if r.eval_loss is not None:
            info += f"  eval {r.eval_loss:.4f}"
        if r.eval_accuracy is not None:
            info += f"  acc {r.eval_accuracy:.3f}"
        self.progress.update(self.task, completed=r.step, info=info)


class _Terminated(KeyboardInterrupt):
    """A second SIGTERM: the run ends at once, as on a second Ctrl-C."""


class _StopHandler:
    """SIGINT and SIGTERM (a preempted job): the first stops the run after the step
    in flight, with a checkpoint there; a second stops it at once."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.signum: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise _Terminated if signum == signal.SIGTERM else KeyboardInterrupt
        self.signum = signum
        self.trainer.stop.set()
        print(
            "stopping after this step, with a checkpoint (Ctrl-C again stops at once)",
            file=sys.stderr,
            flush=True,
        )


@contextmanager
def _stop_on_signals(handler: _StopHandler) -> Iterator[None]:
    # Without it Ctrl-C stops mid-step and SIGTERM ends the process on the spot,
    # leaving status.json "running"; handlers can only be set from the main thread.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Callable[..., Any] | int | None] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def main(args: argparse.Namespace) -> int:
    """Train the run with progress on stdout; exit status 0 when it finishes."""
    started = time.perf_counter()  # the first step's wait counts from here
    trainer = prepare_run(
        args.file,
        variant=args.variant,
        sets=args.sets,
        run=args.run,
        steps=args.steps,
        out=args.out,
        resume=args.resume,
        device=args.device,
        init_from=args.init_from,
        log=args.log,
        announce=lambda line: print(line, flush=True),
        started=started,
    )
    steps = trainer.settings.steps
    if args.out is None and args.resume is None and trainer.run_dir.name != trainer.run_name:
        earlier = trainer.run_dir.with_name(trainer.run_name)
        print(
            f"run folder: {trainer.run_dir} ({earlier} holds an earlier run; "
            "--resume latest continues the newest folder of this experiment's run)",
            flush=True,
        )
    if not trainer.devices[0].startswith("cpu"):
        print("\n".join(trainer.report), flush=True)  # the lowering report
    note = claimed_note(trainer.run_dir, trainer.run_name, args.out, args.resume)
    if note is not None:
        print(note)
    handler = _StopHandler(trainer)
    try:
        with _stop_on_signals(handler):
            if sys.stdout.isatty():
                display = _RichProgress(steps)
                trainer.on_step = display
                with display.progress:
                    summary = trainer.run()
            else:
                trainer.on_step = _plain_progress(steps)
                summary = trainer.run()
    except _Terminated:
        print("terminated", file=sys.stderr)
        return 143  # 128 + SIGTERM, as a shell reports it
    if summary.interrupted:
        kept = "checkpoint written" if trainer.location is not None else "no :checkpoint location"
        print(
            f"interrupted after step {summary.step} ({kept}); --resume latest continues",
            file=sys.stderr,
        )
        return 143 if handler.signum == signal.SIGTERM else 130  # 128 + the signal
    done = f"done: step {summary.step}"
    if summary.loss is not None:
        done += f", loss {summary.loss:.4f}"
    if summary.eval_loss is not None:
        done += f", eval loss {summary.eval_loss:.4f}"
    if summary.eval_accuracy is not None:
        done += f", eval accuracy {summary.eval_accuracy:.4f}"
    if summary.memory is not None:
        print(summary.memory)
    if trainer.lead_node:
        print(f"{done}, {summary.seconds:.1f}s -> {trainer.run_dir}")
    else:  # node 0 writes the records
        print(f"{done}, {summary.seconds:.1f}s (node 0 writes the records)")
    return 0
