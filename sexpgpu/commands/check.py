"""`sexpgpu check FILE [--variant V] [--run NAME]`: read and check an experiment, print it resolved.

The report is a sequence of sections, each a `Section` in `SECTIONS`: a
title and a function from the experiment and the chosen runs to lines. The
language's own sections (`LANGUAGE_SECTIONS`) come first, then the traced
model's parameters, FLOPs and memory (`sexpgpu.commands.explain.model_section`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sexpgpu.commands.explain import model_section
from sexpgpu.commands.options import add_experiment_options
from sexpgpu.lang import Experiment, RunDef, load_experiment, unparse
from sexpgpu.lang.paths import file_problem
from sexpgpu.lang.values import show_value

__all__ = ["LANGUAGE_SECTIONS", "SECTIONS", "Section", "add_arguments", "main", "render_report"]

_INDENT = "  "


@dataclass(frozen=True)
class Section:
    """One part of the report: its title and the lines under it (none: the section is left out)."""

    title: str
    render: Callable[[Experiment, Sequence[RunDef]], list[str]]


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Rows as aligned columns, indented."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(map(len, rows)))]
    lines = []
    for row in rows:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append((_INDENT + "  ".join(cells)).rstrip())
    return lines


def _parameters(experiment: Experiment, runs: Sequence[RunDef]) -> list[str]:
    rows = []
    for name, value in experiment.params.items():
        note = ""
        if name in experiment.sets:
            note = f"--set (default {show_value(experiment.defaults[name])})"
        elif name in experiment.overridden:
            note = f"{experiment.variant} (default {show_value(experiment.defaults[name])})"
        elif value != experiment.defaults.get(name, value):
            note = f"derived (default {show_value(experiment.defaults[name])})"
        rows.append((name, show_value(value), note))
    return _table(rows)


def _data(experiment: Experiment, runs: Sequence[RunDef]) -> list[str]:
    rows = []
    for data in experiment.data.values():
        source = f"({data.kind}{'' if data.path is None else ' ' + show_value(str(data.path))})"
        settings = [f"{key} {_show(value)}" for key, value in data.options.items()]
        problem = None if data.path is None else file_problem(data.path)
        if problem is not None:
            # check reads no data, but a file that is not there is worth saying before a run.
            what = "file not found" if problem[0] == "does not exist" else problem[0]
            settings.append(f"{what} (`run` stops with E-DATA-001)")
        rows.append((data.name, source, ", ".join(settings)))
    return _table(rows)


def _functions(experiment: Experiment, runs: Sequence[RunDef]) -> list[str]:
    return _table(
        [
            (fn.name, "(" + " ".join(a.name for a in fn.args) + ")")
            for fn in experiment.functions.values()
        ]
    )


def _models(experiment: Experiment, runs: Sequence[RunDef]) -> list[str]:
    return _table(
        [
            (m.name, "(" + " ".join(a.name for a in m.inputs) + ")")
            for m in experiment.models.values()
        ]
    )


def _runs(experiment: Experiment, runs: Sequence[RunDef]) -> list[str]:
    lines = []
    for run in runs:
        lines.append(f"{_INDENT}{run.name}")
        rows = [
            ("model", run.model),
            ("data", run.data),
            ("loss", unparse(run.loss)),
            ("optimizer", _call(run.optimizer.name, run.optimizer.options)),
            ("schedule", _call(run.schedule.name, run.schedule.options)),
            ("clip", "none" if run.clip is None else _show(run.clip)),
            ("batch", str(run.batch)),
            ("microbatches", str(run.microbatches)),
            ("steps", str(run.steps)),
            ("dtype", run.dtype),
            ("seed", str(run.seed)),
            ("eval", "none" if run.eval is None else
             f"every {run.eval.every} steps, {run.eval.batches} batches"),
            ("checkpoint", "none" if run.checkpoint is None else
             f"every {run.checkpoint.every} steps to {show_value(run.checkpoint.location)}"),
            ("diagnostics", ", ".join(
                f"{d.name} every {d.every} ({d.reduce})" for d in run.diagnostics) or "none"),
        ]  # fmt: skip
        lines += [_INDENT + line for line in _table(rows)]
    return lines


def _call(name: str, options: Mapping[str, object]) -> str:
    parts = [name] + [f":{key.replace('_', '-')} {_show(value)}" for key, value in options.items()]
    return "(" + " ".join(parts) + ")"


def _show(value: object) -> str:
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return "[" + " ".join(value) + "]"  # names, such as a data set's fields
    if isinstance(value, tuple):
        return "[" + " ".join(_show(v) for v in value) + "]"
    return show_value(value)


# What the language layer alone can say about an experiment.
LANGUAGE_SECTIONS: tuple[Section, ...] = (
    Section("parameters", _parameters),
    Section("data", _data),
    Section("functions", _functions),
    Section("models", _models),
    Section("runs", _runs),
)

# The report's sections in order; add a Section here to extend `check`.
SECTIONS: list[Section] = [
    *LANGUAGE_SECTIONS,
    Section("traced model: parameters, FLOPs, memory", model_section),
]


def render_report(
    experiment: Experiment, runs: Sequence[RunDef], sections: Sequence[Section] | None = None
) -> str:
    """The report `check` prints: a header, then every section with lines.

    Parameters
    ----------
    experiment
        A loaded experiment.
    runs
        The runs to describe (all of them, or the one chosen with --run).
    sections
        The sections to render, in order (default: `SECTIONS`).
    """
    header = str(experiment.path)
    if experiment.variant is not None:
        header += f" (variant {experiment.variant})"
    elif experiment.variants:
        header += f" (variants: {', '.join(experiment.variants)})"
    out = [header]
    for section in SECTIONS if sections is None else sections:
        lines = section.render(experiment, runs)
        if lines:
            out += ["", section.title, *lines]
    return "\n".join(out)


DESCRIPTION = """\
Read and check an experiment file without running it, and print it resolved:
every parameter (after the variant and --set), data set, function, model and
run, with the model's parameters, FLOPs and a memory estimate. Errors are
printed with their code, position and a hint."""

EPILOG = """\
examples:
  sexpgpu check examples/gpt.lisp --variant smoke
  sexpgpu check examples/mlp.lisp --set hidden=256 --run train"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `sexpgpu check`."""
    add_experiment_options(parser, "describe only this run")


def main(args: argparse.Namespace) -> int:
    """Print the report of the experiment and its runs; exit status 0."""
    experiment = load_experiment(args.file, variant=args.variant, sets=args.sets)
    runs = list(experiment.runs.values()) if args.run is None else [experiment.run(args.run)]
    print(render_report(experiment, runs))
    return 0
