"""``sexpgpu eval FILE --resume latest|PATH``: a checkpoint's loss, perplexity and accuracy."""

from __future__ import annotations

import argparse
import json

from sexpgpu.commands.options import (
    add_device_option,
    add_experiment_options,
    add_resume_option,
    load_trained_from,
)

__all__ = ["DESCRIPTION", "EPILOG", "add_arguments", "main"]

DESCRIPTION = """\
Evaluate a checkpoint of a run alone: the mean loss over the run's eval batches
(the split's eval part, or the data set's :eval source), its perplexity
(exp(loss), for token losses) and the argmax accuracy where the model
classifies. The numbers equal what the run recorded as eval/loss and
eval/accuracy at that step. The last line is one JSON object for scripts."""

EPILOG = """\
examples:
  sexpgpu eval examples/gpt.lisp --variant smoke --resume latest
  sexpgpu eval examples/mlp.lisp --resume runs/train/checkpoints/step-300 --batches 50"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `sexpgpu eval`."""
    add_experiment_options(parser, "the defrun the checkpoint belongs to (default: the only one)")
    add_resume_option(parser, required=True)
    parser.add_argument("--out", metavar="DIR", help="the run folder of --resume latest")
    parser.add_argument("--data", metavar="NAME", help="evaluate on this defdata instead")
    parser.add_argument(
        "--batches", metavar="M", type=int, help="eval batches (default the run's :eval :batches)"
    )
    add_device_option(parser)


def main(args: argparse.Namespace) -> int:
    """Print the evaluation, then the same as one JSON line."""
    from sexpgpu.train.evaluate import evaluate_trained

    trained = load_trained_from(args, args.resume)
    result = evaluate_trained(trained, data=args.data, batches=args.batches, device=args.device)
    data = args.data or trained.run.data
    step = trained.checkpoint.step
    line = f"{trained.checkpoint.where}: step {step}, data {data}, {result.batches} batches: "
    line += f"loss {result.loss:.4f}"
    record: dict[str, object] = {"step": step, "data": data, "batches": result.batches}
    record["loss"] = result.loss
    if result.perplexity is not None:
        line += f", perplexity {result.perplexity:.4g}"
        record["perplexity"] = result.perplexity
    if result.accuracy is not None:
        line += f", accuracy {result.accuracy:.4f}"
        record["accuracy"] = result.accuracy
    record["checkpoint"] = trained.checkpoint.where
    print(line)
    print(json.dumps(record))
    return 0
