"""The `sexpgpu` command: parses arguments, runs one subcommand, renders errors.

Each subcommand lives in `sexpgpu.commands.<name>` and offers
``add_arguments(parser)`` and ``main(args) -> int``. Only this module and the
commands print; libraries log. User errors print as rendered `SexpgpuError`s;
a Python traceback is shown only with ``SEXPGPU_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from sexpgpu import __version__
from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.oom import is_allocation_failure

__all__ = ["COMMANDS", "main"]

# name -> one-line help; the module sexpgpu.commands.<name> implements it.
COMMANDS: dict[str, str] = {
    "check": "read and check an experiment, and print it resolved",
    "doctor": "check that this host meets the floor for a device (cpu or cuda)",
    "run": "train a run of an experiment file and write its run directory",
    "plot": "draw runs' loss, learning rate, gradient norm, accuracy and tokens/s into a PNG",
    "sample": "continue a prompt with a trained language model (seeded)",
    "export": "write a checkpoint as a Hugging Face transformers folder (GPT-2, Llama)",
    "eval": "evaluate a checkpoint: loss, perplexity, accuracy (and one JSON line)",
    "explain": "print the IR of a run's training graph, with its parameters, FLOPs and memory",
}

_DEBUG_ENV = "SEXPGPU_DEBUG"


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage mistakes as SexpgpuError instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SexpgpuError("E-CLI-001", message, self.prog, hint=f"run `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sexpgpu", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sexpgpu {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"sexpgpu.commands.{name}")
        command = sub.add_parser(
            name,
            help=help_text,
            description=getattr(module, "DESCRIPTION", help_text),
            epilog=getattr(module, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    debug = os.environ.get(_DEBUG_ENV, "") not in ("", "0")
    args = None
    try:
        args = build_parser().parse_args(argv)
        levels = [logging.WARNING, logging.INFO, logging.DEBUG]
        logging.basicConfig(level=levels[min(args.verbose, 2)], format="%(name)s: %(message)s")
        if args.command is None:
            build_parser().print_help()
            return 2
        return int(args._module.main(args) or 0)
    except SexpgpuError as err:
        if debug:
            raise
        print(err.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`sexpgpu check ... | head`): stop quietly,
        # and keep Python from complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as err:  # an internal error: hide the frames unless debugging
        if debug:
            raise
        if is_allocation_failure(err):  # where nothing retried it: the machine's, not a bug
            print(_out_of_memory(args, err).render(), file=sys.stderr)
            return 1
        print(
            f"internal error: {type(err).__name__}: {err}\n"
            f"  this is a bug in sexpgpu; set {_DEBUG_ENV}=1 to see the traceback",
            file=sys.stderr,
        )
        return 70


def _out_of_memory(args: argparse.Namespace | None, err: BaseException) -> SexpgpuError:
    """E-MEM-002 for memory that ran out outside the paths that retry and split."""
    command = f"sexpgpu {getattr(args, 'command', None) or ''}".strip()
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    return SexpgpuError(
        "E-MEM-002",
        f"memory ran out in {command}: {first}",
        command,
        hint="free memory held by other processes, or use a smaller model, :batch or "
        "--device; SEXPGPU_MEMORY (docs/devices.md) plans a run for less",
    )
