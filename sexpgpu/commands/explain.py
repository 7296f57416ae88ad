"""`sexpgpu explain FILE [--variant V] [--run NAME] [--graph train|eval] [--no-spans] [--device D]`.

Prints a header (parameters, FLOPs, the interpreter's planned peak memory)
as ``;`` comments, then the run's training graph (loss and gradients) or its
evaluation graph as S-expressions, one node per line with the source
position it comes from unless ``--no-spans``. The text reads back with
`sexpgpu.ir.printer.parse_graph`.

With ``--device cuda`` (or ``SEXPGPU_DEVICE=cuda``) the header also holds
the device's lowering report: the GPU and its capability, each pattern
matched and where, the attention backend, and the memory plan with its
parts. Without a GPU, ``SEXPGPU_MEMORY`` names the card to plan for. Where
the plan fits only by recomputing forward values in the backward, the
header says what it recomputes (``recompute: ...``) and the training graph
printed is the rewritten one, which the device runs.

`model_section` is the same summary with the parameter table, as a section
of ``sexpgpu check``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from sexpgpu.commands.options import add_experiment_options
from sexpgpu.devices.base import get_device
from sexpgpu.devices.cpu import CpuProgram
from sexpgpu.devices.memory_fit import recompute_lines
from sexpgpu.devices.shard import choose, shard_line
from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.compile import CompiledRun, compile_run
from sexpgpu.ir.printer import format_graph
from sexpgpu.ir.shape_rules import format_shape
from sexpgpu.lang import Experiment, RunDef, load_experiment
from sexpgpu.runtime.devices import DEVICE_KINDS
from sexpgpu.runtime.units import format_bytes
from sexpgpu.train.settings import microbatches_per_rank

__all__ = ["add_arguments", "format_flops", "main", "model_section", "summary_lines"]


def format_flops(flops: float) -> str:
    """``1.41 GFLOP``: three significant digits and a decimal prefix."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.3g} {prefix}FLOP"
    return f"{flops:.0f} FLOP"


def summary_lines(program: CompiledRun, run: RunDef) -> list[str]:
    """Parameter count, FLOPs and the interpreter's planned peak of `run`'s compiled program."""
    per_micro = program.flops_per_step
    micro = f"{run.microbatches} microbatch{'es' if run.microbatches != 1 else ''}"
    return [
        f"parameters: {program.param_count:,} in {len(program.params)} tensors",
        f"FLOPs per step: {format_flops(per_micro * run.microbatches)} ({micro} of "
        f"{run.batch} rows, {format_flops(per_micro)} each; matmuls forward and backward)",
        f"memory: {format_bytes(CpuProgram(program.train_graph).planned_peak_bytes)} planned peak "
        "on the cpu interpreter (one microbatch)",
    ]


def model_section(experiment: Experiment, runs: Sequence[RunDef]) -> list[str]:
    """`check`'s section: per run, the summary and every parameter with its shape."""
    lines: list[str] = []
    for run in runs:
        program = compile_run(experiment, run)
        lines.append(f"  {run.name} (model {run.model}, dtype {run.dtype})")
        lines += [f"    {line}" for line in summary_lines(program, run)]
        lines += [f"    {line}" for line in _recompute_lines(program, run, os.environ)]
        width = max(len(name) for name in program.params) if program.params else 0
        for name, info in program.params.items():
            shape = format_shape(info.shape)
            lines.append(f"    {name.ljust(width)}  {shape:<14} {info.init}".rstrip())
    return lines


def _recompute_lines(compiled: CompiledRun, run: RunDef, environ: Mapping[str, str]) -> list[str]:
    """What the cpu device recomputes or shards to fit the host (or ``SEXPGPU_MEMORY``).

    Over the simulated ranks ``SEXPGPU_DEVICES`` names, where the run's
    microbatches divide over them (else one rank); [] where nothing is needed.
    """
    from sexpgpu.runtime.config import RuntimeConfig

    config = RuntimeConfig.from_env(environ, device="cpu")
    ranks = config.local_size if run.microbatches % config.world_size == 0 else 1
    world = ranks * config.nodes if ranks > 1 else 1
    plan, shards = choose(
        get_device("cpu"),
        compiled,
        config.shard_optimizer,
        world,
        optimizer=run.optimizer.name,
        ranks=ranks,
        memory=config.memory,
    )
    lines = [*recompute_lines(plan), *shard_line(shards, config.shard_optimizer)]
    lines = [f"{line} (cpu)" for line in lines]
    if not plan.memory.fits:
        lines.append("memory: the plan does not fit the budget; a run would stop with E-MEM-001")
    return lines


DESCRIPTION = """\
Print the IR of a run's training graph (loss and gradients) or evaluation
graph, after the passes, with each node's source position, the parameters,
FLOPs and memory; with --device cuda also the lowering report and plan."""

EPILOG = """\
examples:
  sexpgpu explain examples/mlp.lisp
  sexpgpu explain examples/gpt.lisp --variant smoke --graph eval --no-spans --device cuda"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_experiment_options(parser, "the run to explain (default: the only one)")
    parser.add_argument(
        "--graph",
        choices=("train", "eval"),
        default="train",
        help="the training graph (loss and gradients; default) or the evaluation graph",
    )
    parser.add_argument("--no-spans", action="store_true", help="leave out source positions")
    parser.add_argument("--device", choices=DEVICE_KINDS, help="add this device's lowering report")


def main(args: argparse.Namespace) -> int:
    experiment = load_experiment(args.file, variant=args.variant, sets=args.sets)
    run = experiment.run(args.run)
    program = compile_run(experiment, run)
    device = args.device or os.environ.get("SEXPGPU_DEVICE", "").strip().lower() or None
    report: list[str] = []
    if device is not None:  # the graph printed is the one the device runs (it may recompute)
        report, program = lowering_report(program, run, device, os.environ)
    graph = program.train_graph if args.graph == "train" else program.eval_graph
    where = str(experiment.path)
    if experiment.variant:
        where += f" (variant {experiment.variant})"
    header = [f"{where}, run {run.name}: {args.graph} graph, {len(graph.nodes())} nodes"]
    header += summary_lines(program, run) + report
    print("\n".join(f"; {line}" for line in header))
    print(format_graph(graph, spans=not args.no_spans))
    return 0


def lowering_report(
    compiled: CompiledRun, run: RunDef, device: str, environ: Mapping[str, str]
) -> tuple[list[str], CompiledRun]:
    """The `device`'s report on `compiled` (patterns, kernels, memory plan; one rank), and
    the run it plans: `compiled`, or its training graph recomputing what the plan chose.

    With no GPU visible, a cuda report needs ``SEXPGPU_MEMORY`` as the card to plan for.
    """
    from sexpgpu.runtime.config import RuntimeConfig
    from sexpgpu.runtime.devices import visible_gpu_count

    visible = None
    if device == "cuda" and visible_gpu_count() == 0:
        if not environ.get("SEXPGPU_MEMORY", "").strip():
            raise SexpgpuError(
                "E-DP-001",
                "no GPU is visible to report the cuda lowering for",
                "--device",
                hint="name the card to plan for, e.g. SEXPGPU_MEMORY=80GiB sexpgpu explain "
                "FILE --device cuda",
            )
        visible = 1  # plan for the named card
    config = RuntimeConfig.from_env(environ, device=device, visible_gpus=visible)
    backend = get_device(device)
    plan, shards = choose(
        backend,
        compiled,
        config.shard_optimizer,
        config.world_size,
        optimizer=run.optimizer.name,
        ranks=config.local_size,
        memory=config.memory,
        microbatches=microbatches_per_rank(run.microbatches, config.world_size),
    )
    lines = [*backend.report(plan), *shard_line(shards, config.shard_optimizer)]
    if not plan.memory.fits:
        lines.append("memory: the plan does not fit the budget; a run would stop with E-MEM-001")
    return lines, plan.compiled
