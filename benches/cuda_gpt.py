"""Training a GPT on the cuda device vs PyTorch eager on the same GPU, in one run.

sexpgpu's side is the product's path: the experiment below through
`prepare_run` and the run loop (data loader, metrics, the device's step). The
peer is the same model written in PyTorch (tied embedding, learned
positions, pre-norm blocks, SDPA attention, tanh gelu) trained with
``torch.autocast`` in bf16 over f32 parameters and ``torch.optim.AdamW``
(its default foreach implementation), with the same batch, microbatches and
clipping. Both report tokens per second (the median step after `--warmup`)
and the allocator's peak; sexpgpu's also its memory plan.

    python benches/cuda_gpt.py                       # GPT-2 small shape, bf16
    python benches/cuda_gpt.py --vocab 256 --steps 20 # examples/gpt.lisp's full size

Results are recorded in benches/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cpu_interpreter import GPT as CPU_GPT

GPT = CPU_GPT.split("(defrun")[0].replace(":seq seq)", ":seq seq :split 0.99)") + """
(defrun train :model gpt :data text :loss (cross-entropy (gpt tokens) next)
  :optimizer (adamw :lr 6e-4 :betas [0.9 0.95] :weight-decay 0.1) :clip 1.0
  :batch {batch} :microbatches {microbatches} :steps {steps} :dtype {dtype} :seed 1)
"""


def sexpgpu_side(args: argparse.Namespace) -> dict:
    from sexpgpu.train import prepare_run
    from sexpgpu.train.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt.lisp"
        path.write_text(GPT.format(**vars(args)))
        trainer = prepare_run(path, out=Path(tmp) / "run", device="cuda")
        summary = trainer.run()
        records = list(read_metrics(Path(tmp) / "run" / "metrics.jsonl"))
    times = [r["value"] for r in records if r["name"] == "train/step_time_s"][args.warmup :]
    peaks = [r["value"] for r in records if r["name"] == "runtime/peak_bytes"]
    losses = [r["value"] for r in records if r["name"] == "train/loss"]
    step = statistics.median(times)
    return {
        "side": "sexpgpu",
        "step_s": step,
        "tokens_per_s": args.batch * args.seq * args.microbatches / step,
        "peak_bytes": max(peaks),
        "planned_bytes": trainer.plan.total,
        "memory": summary.memory,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def torch_side(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = args.width
            self.ln1, self.ln2 = nn.LayerNorm(w), nn.LayerNorm(w)
            self.qkv, self.o = nn.Linear(w, 3 * w), nn.Linear(w, w)
            self.up, self.down = nn.Linear(w, 4 * w), nn.Linear(4 * w, w)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, w = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(w, dim=-1)
            heads = [t.view(b, s, args.heads, w // args.heads).transpose(1, 2) for t in (q, k, v)]
            y = F.scaled_dot_product_attention(*heads, is_causal=True)
            x = x + self.o(y.transpose(1, 2).reshape(b, s, w))
            return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Parameter(torch.randn(args.vocab, args.width) * 0.02)
            self.wpe = nn.Parameter(torch.randn(args.seq, args.width) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.ln = nn.LayerNorm(args.width)

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = F.embedding(tokens, self.wte) + self.wpe[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.ln(x) @ self.wte.T
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    model = Gpt().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq + 1)
    data = [torch.from_numpy(rng.integers(0, 256, shape)).to(dev) for _ in range(4)]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    times = []
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for m in range(args.microbatches):
            tokens = data[(step + m) % len(data)]
            with torch.autocast("cuda", dtype, enabled=dtype != torch.float32):
                loss = model(tokens[:, :-1], tokens[:, 1:]) / args.microbatches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - began)
    step = statistics.median(times[args.warmup :])
    return {
        "side": "torch eager",
        "step_s": step,
        "tokens_per_s": args.batch * args.seq * args.microbatches / step,
        "peak_bytes": int(torch.cuda.max_memory_allocated()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("layers", 12),
        ("width", 768),
        ("heads", 12),
        ("seq", 1024),
        ("vocab", 50257),
        ("batch", 8),
        ("microbatches", 4),
        ("steps", 12),
        ("warmup", 2),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    parser.add_argument("--side", default="both", choices=["both", "sexpgpu", "torch"])
    args = parser.parse_args()
    results = []
    if args.side in ("both", "sexpgpu"):
        results.append(sexpgpu_side(args))
    if args.side in ("both", "torch"):
        results.append(torch_side(args))
    for r in results:
        print(json.dumps(r))
    if len(results) == 2:
        ours, peer = results
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
        gib = 2**30
        print(
            f"tokens/s: sexpgpu {ours['tokens_per_s']:,.0f}, torch eager "
            f"{peer['tokens_per_s']:,.0f} ({ratio:.2f}x); peak {ours['peak_bytes'] / gib:.2f} "
            f"GiB vs {peer['peak_bytes'] / gib:.2f} GiB; {ours['memory']}"
        )

if __name__ == "__main__":
    main()
