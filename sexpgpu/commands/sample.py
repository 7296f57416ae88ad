"""``sexpgpu sample FILE --prompt TEXT``: continue a prompt with a trained language model."""

from __future__ import annotations

import argparse
import os
import sys

from sexpgpu.commands.options import (
    add_device_option,
    add_experiment_options,
    add_resume_option,
    load_trained_from,
)
from sexpgpu.errors import SexpgpuError

__all__ = ["DESCRIPTION", "EPILOG", "add_arguments", "main"]

DESCRIPTION = """\
Continue a prompt with the model of a trained run: a language model over bytes
((bytes ...), (python-stdlib): the prompt is text, the output UTF-8) or over
token ids ((tokens ...): the prompt and output are ids). The same --seed gives
the same text on one device. A prompt longer than the model's seq keeps its
last seq tokens (said once); each new token reads the last seq. On cuda each
token replays one captured CUDA graph of the model's step."""

EPILOG = """\
examples:
  sexpgpu sample examples/gpt.lisp --variant smoke --resume latest --prompt 'def main('
  sexpgpu sample examples/gpt.lisp --resume runs/train/checkpoints/step-5000 \\
      --prompt 'import os' --tokens 500 --temperature 0.8 --top-k 40 --device cuda"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `sexpgpu sample`."""
    add_experiment_options(parser, "the defrun the checkpoint belongs to (default: the only one)")
    add_resume_option(parser, required=False)
    parser.add_argument("--out", metavar="DIR", help="the run folder of --resume latest")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="what to continue")
    parser.add_argument("--tokens", type=int, default=256, metavar="N", help="new tokens (256)")
    parser.add_argument(
        "--temperature", type=float, default=1.0, metavar="T", help="1.0; 0 takes the argmax"
    )
    parser.add_argument("--top-k", type=int, metavar="K", help="draw among the K likeliest")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="the draws' seed (0)")
    add_device_option(parser)


def _check_options(args: argparse.Namespace) -> None:
    def bad(option: str, message: str, hint: str) -> SexpgpuError:
        return SexpgpuError("E-CLI-001", message, option, hint=hint)

    if args.tokens < 0:
        raise bad("--tokens", f"--tokens {args.tokens} is negative", "give --tokens 0 or more")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise bad(
            "--temperature",
            f"--temperature {args.temperature} is not a finite number >= 0",
            "give --temperature 0 (argmax) or a positive number such as 0.8",
        )
    if args.top_k is not None and args.top_k < 1:
        raise bad("--top-k", f"--top-k {args.top_k} is not positive", "give --top-k 1 or more")
    if not 0 <= args.seed < 2**63:
        raise bad("--seed", f"--seed {args.seed} is out of range", "give a seed 0 <= S < 2**63")


def main(args: argparse.Namespace) -> int:
    """Print the prompt and its continuation as they are drawn."""
    from sexpgpu.ir.compile import output_graph
    from sexpgpu.runtime.config import RuntimeConfig
    from sexpgpu.train.sampling import BYTE_SOURCES, Sampler, Vocabulary, check_samplable

    _check_options(args)
    trained = load_trained_from(args, args.resume or "latest")
    data = trained.experiment.data[trained.run.data]
    if data.kind not in (*BYTE_SOURCES, "tokens"):
        raise SexpgpuError(
            "E-SAMPLE-001",
            f"run `{trained.run.name}` trains on ({data.kind} ...), not on tokens or bytes",
            data.span or data.name,
            hint="sample continues token or byte streams: (tokens ...), (bytes ...)",
        )
    graph = output_graph(trained.experiment, trained.run)
    seq, size = check_samplable(graph, str(trained.experiment.path))
    vocab = Vocabulary(size, data.kind in BYTE_SOURCES)
    prompt = vocab.encode(args.prompt)
    config = RuntimeConfig.from_env(os.environ, device=args.device)
    if config.device == "cuda":
        from sexpgpu.devices.cuda.decode import TorchDecodeStep

        step = TorchDecodeStep(graph, trained.params, config.local_devices[0])
    else:
        from sexpgpu.train.sampling import cpu_step

        step = cpu_step(graph, trained.params)
    if len(prompt) > seq:
        print(
            f"sample: the prompt has {len(prompt)} tokens; the model reads {seq}: "
            f"continuing its last {seq}",
            file=sys.stderr,
        )
    sampler = Sampler(step, seq, vocab)
    decode = vocab.decoder()
    sys.stdout.write(args.prompt if vocab.byte_level else " ".join(map(str, prompt)))
    drawn = sampler.generate(
        prompt, args.tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed
    )
    for token in drawn:
        sys.stdout.write(decode([token]))
        sys.stdout.flush()
    sys.stdout.write(decode([]) + "\n")
    return 0
