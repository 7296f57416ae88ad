"""Options several commands share: the experiment they read and the checkpoint they load."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sexpgpu.runtime.devices import DEVICE_KINDS

__all__ = ["add_device_option", "add_experiment_options", "add_resume_option", "load_trained_from"]


def add_experiment_options(parser: argparse.ArgumentParser, run_help: str) -> None:
    """FILE, ``--variant``, ``--run`` and ``--set NAME=VALUE`` (repeatable)."""
    parser.add_argument("file", metavar="FILE", help="the experiment file (.lisp)")
    parser.add_argument("--variant", metavar="V", help="apply this defvariant")
    parser.add_argument("--run", metavar="R", help=run_help)
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a defparams value after the variant (repeatable), e.g. --set lr=3e-4",
    )


def add_resume_option(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """``--resume latest|PATH``: the run folder's newest checkpoint, or a step-N folder."""
    parser.add_argument(
        "--resume",
        metavar="latest|PATH",
        required=required,
        help="the newest complete checkpoint of the run folder (latest), or a step-N folder",
    )


def load_trained_from(args: argparse.Namespace, resume: str) -> Any:
    """The trained model of FILE, ``--variant``, ``--set``, ``--run`` and ``--out``.

    With the parameters of the checkpoint `resume` names
    (`sexpgpu.train.trained.load_trained`); says on stderr which run folder
    ``latest`` took when it is not ``runs/RUN-NAME``.
    """
    from sexpgpu.train.resume import claimed_note
    from sexpgpu.train.trained import load_trained

    trained = load_trained(
        args.file,
        resume=resume,
        variant=args.variant,
        sets=args.sets,
        run=args.run,
        out=args.out,
    )
    note = claimed_note(trained.folder, trained.run.name, args.out, resume)
    if note is not None:
        print(note, file=sys.stderr)  # stdout is the command's result
    return trained


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device cpu|cuda`` (default ``SEXPGPU_DEVICE``, else cpu)."""
    parser.add_argument(
        "--device", choices=DEVICE_KINDS, help=f"default: SEXPGPU_DEVICE or {DEVICE_KINDS[0]}"
    )
