"""Llama-family models trained on the cuda device against PyTorch on the same GPU, in one run.

The model is examples/llama.lisp's (RMSNorm, SwiGLU, rotary embeddings,
grouped-query attention, no biases, an output head apart from the
embedding) at two shapes nobody tuned sexpgpu for:

==========  ======  =====  =====  ========  ======  =====  ====  =========
shape       layers  width  heads  kv-heads  SwiGLU  vocab  seq   batches
==========  ======  =====  =====  ========  ======  =====  ====  =========
tinyllama   22      2048   32     4         5632    32000  2048  8
124m        12      768    12     4         2048    32000  1024  16 32
==========  ======  =====  =====  ========  ======  =====  ====  =========

bf16 products over f32 parameters, AdamW (0.9, 0.95, weight decay 0.1),
clipping at 1.0, on both sides. The peer is the same model in PyTorch
(tests/ir/torch_reference.py's `TorchLlama`: ``nn.RMSNorm``, SDPA with the
key/value heads repeated as Hugging Face's ``repeat_kv`` does) under
``torch.autocast`` with ``torch.optim.AdamW(fused=True)``: eager,
``torch.compile`` (default) and ``torch.compile(mode="reduce-overhead")``.
Each side runs in its own process with compile caches of its own that start
empty; the sides, the comparison and the table are benches/gpt2_cuda.py's.
Reported per side: tokens per second (the median step after ``--warmup``),
MFU against the bf16 matmul rate measured in the same run, the first step's
latency from the process's start, the allocator's peak, and for sexpgpu
its memory plan (the ``plan GiB`` column; ``memory`` in the JSON line says
peak against plan). The sides ``sexpgpu-products``, ``sexpgpu-1mib`` and
``sexpgpu-norms-kept`` are sexpgpu with one mechanism changed
(benches/gpt2_cuda.py's `SEXPGPU_SIDES`): the cheap values that products
read made again in the backward too (as PyTorch's partitioner does; less
memory, a pass more per value), 1 MiB of cuBLASLt workspace instead of
32 MiB, or the norms' values kept for the backward.

    python benches/llama_cuda.py                           # both shapes, every side
    python benches/llama_cuda.py --shapes 124m --sides sexpgpu compile
    python benches/llama_cuda.py --smoke                   # a tiny Llama on the CPU (CI)

``--smoke`` trains a one-layer Llama of width 32 for three steps, sexpgpu on
the ``cpu`` device and the eager peer on PyTorch's CPU device; its numbers
say nothing of a GPU. Results are recorded in benches/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests" / "ir"))
from gpt2_cuda import (  # noqa: E402
    PEERS,
    SEXPGPU_SIDES,
    adamw_step,
    compare,
    matmul_rate,
    one_side,
    table,
)

# The example's data and model, at the benchmark's sizes, with the benchmark's run.
_EXAMPLE = (ROOT / "examples" / "llama.lisp").read_text()
LLAMA = (
    """
(defparams (layers {layers}) (width {width}) (heads {heads}) (kv-heads {kv_heads}) (ffn {ffn})
  (seq {seq}) (vocab {vocab}) (rope-base 10000.0) (dropout 0.0))
"""
    + "(defdata"
    + _EXAMPLE.split("(defdata", 1)[1]
    .split("(defrun")[0]
    .replace(":seq seq :split 0.9)", ":seq seq :split 0.99)")
    + """
(defrun train :model llama :data text :loss (cross-entropy (llama tokens) next)
  :optimizer (adamw :lr 3e-4 :betas [0.9 0.95] :weight-decay 0.1) :clip 1.0
  :batch {batch} :microbatches {microbatches} :steps {steps} :dtype {dtype} :seed 1)
"""
)

# name -> (layers, width, heads, kv_heads, ffn, vocab, seq, batches, rows per microbatch)
SHAPES = {
    "tinyllama": (22, 2048, 32, 4, 5632, 32000, 2048, [8], 8),
    "124m": (12, 768, 12, 4, 2048, 32000, 1024, [16, 32], 16),
    "smoke": (1, 32, 4, 2, 48, 256, 16, [2], 2),
}
KEYS = ("layers", "width", "heads", "kv_heads", "ffn", "vocab", "seq")


def llama_step(args: argparse.Namespace, mode: str):
    """The peer's step, ``step(tokens) -> loss``; `mode` "eager" or torch.compile's."""
    import torch
    from torch_reference import TorchLlama

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(args.device)
    shape = {k: getattr(args, k) for k in KEYS}
    model = TorchLlama(**shape).to(dev)

    def loss(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev.type, torch.bfloat16):
            return model.loss(tokens, targets)

    return adamw_step(model, loss if mode == "eager" else torch.compile(loss, mode=mode), 3e-4)


def flops_per_token(args: argparse.Namespace) -> float:
    """Training FLOPs per token: 6 per weight of a product, plus attention's (PaLM's count).

    The embedding is a lookup (no product), so its table is left out; the
    head, every projection and the SwiGLU's three matrices count.
    """
    w, d = args.width, args.width // args.heads
    block = 2 * w * w + 2 * w * args.kv_heads * d + 3 * w * args.ffn
    weights = args.layers * block + w * args.vocab
    return 6 * weights + 12 * args.layers * w * args.seq


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("steps", 20), ("warmup", 5), ("timeout", 600)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--shapes", nargs="+", default=["tinyllama", "124m"], choices=SHAPES)
    parser.add_argument("--batches", type=int, nargs="+", help="instead of the shape's")
    parser.add_argument("--dtype", default="bf16", choices=["bf16"])
    sides = ["sexpgpu", "sexpgpu-products", *PEERS]
    parser.add_argument("--sides", nargs="+", default=sides, choices=[*SEXPGPU_SIDES, *PEERS])
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU")
    # One side of one shape, in a child process.
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    for key in KEYS:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.steps, args.warmup = ["smoke"], 3, 1
        args.device, args.sides = "cpu", ["sexpgpu", "sexpgpu-products", "eager"]
    return args


def main() -> None:
    args = _arguments()
    if args.side:
        print("RESULT " + json.dumps(one_side(args, LLAMA, llama_step)), flush=True)
        return
    rate = matmul_rate(args.device)
    print(f"bf16 matmul rate: {rate / 1e12:.0f} TFLOP/s")
    chosen = args.batches
    for name in args.shapes:
        *sizes, batches, rows = SHAPES[name]
        for key, value in zip(KEYS, sizes, strict=True):
            setattr(args, key, value)
        args.batches, args.rows = chosen or batches, rows
        per_token = flops_per_token(args)
        print(f"{name}: {per_token / 1e9:.3f} GFLOP per token")
        common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in KEYS]
        common += [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--rows={rows}"]
        common += [f"--device={args.device}"]
        table(compare(args, __file__, common, rate, per_token), args.batches, name)


if __name__ == "__main__":
    main()
