"""``sexpgpu export FILE --resume PATH --to hf DIR``: a checkpoint as a `transformers` folder."""

from __future__ import annotations

import argparse

from sexpgpu.commands.options import add_experiment_options, add_resume_option, load_trained_from
from sexpgpu.errors import SexpgpuError

__all__ = ["DESCRIPTION", "EPILOG", "FORMATS", "add_arguments", "main"]

FORMATS = ("hf",)

DESCRIPTION = """\
Write a checkpoint's model as a folder Hugging Face transformers loads
(config.json and model.safetensors, in transformers' names and layouts):
models shaped as examples/gpt.lisp become GPT2LMHeadModel, models shaped as
examples/llama.lisp LlamaForCausalLM. Before writing, the model's logits are
compared with the architecture's (a NumPy reference) on random ids; a model
that maps to neither is refused with the first difference from each named."""

EPILOG = """\
examples:
  sexpgpu export examples/gpt.lisp --variant smoke --resume latest --to hf gpt-hf
  sexpgpu export examples/llama.lisp --resume runs/train/checkpoints/step-5000 --to hf llama-hf

then, in Python:
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained("gpt-hf")"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `sexpgpu export`."""
    add_experiment_options(parser, "the defrun the checkpoint belongs to (default: the only one)")
    add_resume_option(parser, required=True)
    parser.add_argument("--out", metavar="DIR", help="the run folder of --resume latest")
    parser.add_argument(
        "--to",
        nargs=2,
        required=True,
        metavar=("FORMAT", "DIR"),
        help="hf and the folder to write (new or empty)",
    )


def main(args: argparse.Namespace) -> int:
    """Write the folder and say which architecture it holds."""
    from sexpgpu.train.hf import export_hf

    kind, folder = args.to
    if kind not in FORMATS:
        raise SexpgpuError(
            "E-CLI-001",
            f"--to {kind}: unknown format",
            "--to",
            hint=f"formats: {', '.join(FORMATS)} (a Hugging Face transformers folder)",
        )
    trained = load_trained_from(args, args.resume)
    arch, out = export_hf(trained, folder)
    step = trained.checkpoint.step
    print(f"wrote {out} ({arch}, step {step} of {trained.checkpoint.where})")
    return 0
