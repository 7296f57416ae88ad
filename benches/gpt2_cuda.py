"""GPT-2 small trained on the cuda device against PyTorch on the same GPU, in one run.

sexpgpu's side is the product's path: the experiment below through
`prepare_run` and the run loop (data loader, metrics, the device's fused,
CUDA-graph step). The peers are the same model written in PyTorch (tied
embedding, learned positions, pre-norm blocks, SDPA attention, tanh gelu)
under ``torch.autocast`` in bf16 over f32 parameters with
``torch.optim.AdamW(fused=True)`` and the same clipping: eager,
``torch.compile`` (default) and ``torch.compile(mode="reduce-overhead")``.
Each side runs in its own process. benches/llama_cuda.py reuses the sides,
the comparison and the table with a Llama-family model. Reported per side: tokens per second
(the median step after `--warmup`), MFU against the bf16 matmul rate
measured in the same run, the first step's latency (compilation included,
from the process's start, with compile caches of its own that start empty),
and the allocator's peak; sexpgpu's also its
memory plan and its stacking line.

Besides ``sexpgpu``, sexpgpu's side can run with one of its module
settings changed, to measure a mechanism against the default in one run
(`SEXPGPU_SIDES`): ``sexpgpu-products`` makes the cheap values products read
again in the backward too (docs/ir.md, "Cheap values, always");
``sexpgpu-1mib`` offers the cuBLASLt products 1 MiB of workspace instead
of 32 MiB (the default before 2026-12-06), with which the weights'
gradients, written in f32 straight into their sums, cannot split their
long sums as PyTorch's cuBLAS products do; ``sexpgpu-norms-kept`` keeps
the values of norms, gelu and softmax for the backward instead of making
them again there (the default until 2026-12-06; elementwise values are
made again either way).

    python benches/gpt2_cuda.py                        # batch 16 and 32, every side
    python benches/gpt2_cuda.py --batches 16 --sides sexpgpu eager
    python benches/gpt2_cuda.py --sides sexpgpu sexpgpu-1mib reduce-overhead
    python benches/gpt2_cuda.py --smoke                # a tiny GPT on the CPU (CI)

``--smoke`` trains a one-layer GPT of width 32 for three steps, sexpgpu on
the ``cpu`` device and the eager peer on PyTorch's CPU device (torch.compile
is left out: it compiles for minutes there). It checks that the script runs
end to end without a GPU, in seconds; its numbers say nothing of a GPU.

Results are recorded in benches/README.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()
sys.path.insert(0, str(Path(__file__).parent))
from cpu_interpreter import GPT as CPU_GPT  # noqa: E402

from sexpgpu.ir.ops import ELEMENTWISE  # noqa: E402

# sexpgpu's sides: module -> {name: value} set in the side's process before it plans.
SEXPGPU_SIDES: dict[str, dict[str, dict[str, object]]] = {
    "sexpgpu": {},
    "sexpgpu-products": {"sexpgpu.devices.cuda.planner": {"CHEAP_INTO_PRODUCTS": True}},
    "sexpgpu-1mib": {"sexpgpu.devices.cuda.cublaslt": {"WORKSPACE": 1 << 20}},
    "sexpgpu-norms-kept": {"sexpgpu.ir.recompute": {"ONE_PASS": ELEMENTWISE}},
}
PEERS = ["eager", "compile", "reduce-overhead"]

GPT = (
    CPU_GPT.split("(defrun")[0].replace(":seq seq)", ":seq seq :split 0.99)")
    + """
(defrun train :model gpt :data text :loss (cross-entropy (gpt tokens) next)
  :optimizer (adamw :lr 6e-4 :betas [0.9 0.95] :weight-decay 0.1) :clip 1.0
  :batch {batch} :microbatches {microbatches} :steps {steps} :dtype {dtype} :seed 1)
"""
)


def sexpgpu_side(args: argparse.Namespace, template: str = GPT) -> dict:
    """sexpgpu's side: `template` (a run's text, formatted with `args`) through the run loop."""
    from sexpgpu.train import prepare_run
    from sexpgpu.train.metrics import read_metrics

    # The batch as microbatches of at most `--rows` rows: stacking chooses how many a call runs.
    micro = max(1, args.batch // args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.lisp"
        text = template.format(
            **{**vars(args), "batch": args.batch // micro, "microbatches": micro}
        )
        path.write_text(text)
        ended: dict[int, float] = {}  # step -> when its report came (its loss read)

        def on_step(report) -> None:
            ended.setdefault(report.step, time.perf_counter())

        began = time.perf_counter()
        trainer = prepare_run(path, out=Path(tmp) / "run", device=args.device, on_step=on_step)
        prepared = time.perf_counter() - began  # the plan: trace, compile, dry call
        summary = trainer.run()
        records = list(read_metrics(Path(tmp) / "run" / "metrics.jsonl"))
    all_times = [r["value"] for r in records if r["name"] == "train/step_time_s"]
    notes = [r["value"] for r in records if r["name"] == "annotation"]
    peaks = [r["value"] for r in records if r["name"] == "runtime/peak_bytes"]
    losses = [r["value"] for r in records if r["name"] == "train/loss"]
    return {
        "side": "sexpgpu",
        "step_s": statistics.median(all_times[args.warmup :]),
        # Start-up, plan, compile, initialization and the first step, to its loss on
        # the host, as the peers' (the run's evaluation and checkpoint come later).
        "first_step_s": ended[1] - STARTED,
        "peak_bytes": max(peaks),
        "planned_bytes": trainer.plan.total,
        "memory": summary.memory,
        "stacking": next((n for n in notes if n.startswith("stacking")), None),
        "fused": next((n for n in notes if n.startswith("fused:")), None),
        "started_s": began - STARTED,
        "prepare_s": prepared,
        "cuda_graph": any("CUDA graph" in n for n in notes),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def torch_step(args: argparse.Namespace, mode: str):
    """The peer's step on the GPU, ``step(tokens) -> loss``; `mode` "eager" or torch.compile's."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(args.device)

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
            with torch.autocast(dev.type, torch.bfloat16):
                x = F.embedding(tokens, self.wte) + self.wpe[: tokens.shape[1]]
                for block in self.blocks:
                    x = block(x)
                logits = self.ln(x) @ self.wte.T
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    model = Gpt().to(dev)
    return adamw_step(model, model if mode == "eager" else torch.compile(model, mode=mode), 6e-4)


def adamw_step(model, loss_of, lr: float, fused: bool = True):
    """The peers' step, ``step(tokens) -> loss``: `loss_of` the next tokens, its gradients
    clipped at 1.0, AdamW (betas 0.9 and 0.95, weight decay 0.1), as the sexpgpu side runs."""
    import torch

    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=fused
    )

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = loss_of(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def torch_side(args: argparse.Namespace, mode: str, make_step=None) -> dict:
    """A peer's side: ``make_step(args, mode)`` (default `torch_step`) timed over random tokens."""
    import numpy as np
    import torch

    step = (make_step or torch_step)(args, mode)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq + 1)
    data = [torch.from_numpy(rng.integers(0, 256, shape)).to(args.device) for _ in range(4)]
    times, first = [], None
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.steps):
        if on_gpu:
            torch.cuda.synchronize()
        began = time.perf_counter()
        step(data[i % len(data)]).item()
        times.append(time.perf_counter() - began)
        if first is None:
            first = time.perf_counter() - STARTED
    return {
        "step_s": statistics.median(times[args.warmup :]),
        "first_step_s": first,
        "peak_bytes": int(torch.cuda.max_memory_allocated()) if on_gpu else 0,
    }


def matmul_rate(device: str) -> float:
    """The bf16 matmul rate this GPU reaches (FLOP/s), 8192^3 through cuBLAS.

    On the CPU (``--smoke``): one 256^3 product, timed once.
    """
    import torch

    if device == "cpu":
        a, b = (torch.randn(256, 256, dtype=torch.bfloat16) for _ in range(2))
        began = time.perf_counter()
        a @ b
        return 2 * 256**3 / (time.perf_counter() - began)
    from triton.testing import do_bench

    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = do_bench(lambda: a @ b, warmup=50, rep=300)
    return 2 * n**3 / (ms * 1e-3)


def flops_per_token(args: argparse.Namespace) -> float:
    """Training FLOPs per token: 6 per parameter plus attention's (the PaLM appendix count)."""
    w, layers = args.width, args.layers
    params = args.vocab * w + args.seq * w + layers * (12 * w * w + 13 * w) + 2 * w
    return 6 * params + 12 * layers * w * args.seq


def one_side(args: argparse.Namespace, template: str = GPT, make_step=None) -> dict:
    """The side `args.side` at batch `args.batch`, with tokens/s."""
    if args.side in SEXPGPU_SIDES:
        for module, settings in SEXPGPU_SIDES[args.side].items():
            for name, value in settings.items():
                setattr(importlib.import_module(module), name, value)
        result = sexpgpu_side(args, template)
    else:
        mode = {"eager": "eager", "compile": "default"}.get(args.side, args.side)
        result = torch_side(args, mode, make_step)
    result["side"] = args.side
    result["batch"] = args.batch
    result["tokens_per_s"] = args.batch * args.seq / result["step_s"]
    return result


def cold(cache: str) -> dict[str, str]:
    """The environment of one side's process: compile caches of its own, empty.

    Inductor and Triton keep what they compiled on disk between processes, so
    without this a side would start from the kernels the sides before it
    compiled (torch.compile's two modes share most of theirs), and the first
    step would not be the cold start it claims to be.
    """
    return {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
        # sexpgpu's compile cache, which points the two above into itself.
        "SEXPGPU_CACHE": os.path.join(cache, "sexpgpu"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("layers", 12),
        ("width", 768),
        ("heads", 12),
        ("seq", 1024),
        ("vocab", 50304),
        ("steps", 20),
        ("warmup", 5),
        ("timeout", 400),
        ("rows", 16),  # sexpgpu's microbatch: 16 rows, so batch 32 is two, stacked
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtype", default="bf16", choices=["bf16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    sides = ["sexpgpu", *PEERS]
    parser.add_argument("--sides", nargs="+", default=sides, choices=[*SEXPGPU_SIDES, *PEERS])
    parser.add_argument("--side", help=argparse.SUPPRESS)  # one side, in a child process
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: --smoke
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on the CPU")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.width, args.heads, args.seq, args.vocab = 1, 32, 2, 16, 256
        args.steps, args.warmup, args.rows, args.batches = 3, 1, 2, [2]
        args.device, args.sides = "cpu", ["sexpgpu", "eager"]
    if args.side:
        print("RESULT " + json.dumps(one_side(args)), flush=True)
        return
    rate = matmul_rate(args.device)
    per_token = flops_per_token(args)
    print(f"bf16 matmul rate: {rate / 1e12:.0f} TFLOP/s; {per_token / 1e9:.3f} GFLOP per token")
    common = [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "heads", "seq", "vocab")]
    common += [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--rows={args.rows}"]
    common += [f"--device={args.device}"]
    rows = compare(args, __file__, common, rate, per_token)
    table(rows, args.batches, "gpt2-small")


def compare(
    args: argparse.Namespace, script: str, common: list[str], rate: float, per_token: float
) -> list[dict]:
    """Each side of `script` at each batch in its own process (cold caches); one row each."""
    rows = []
    for batch in args.batches:
        for side in args.sides:
            cmd = [sys.executable, script, f"--side={side}", f"--batch={batch}", *common]
            try:
                with tempfile.TemporaryDirectory() as cache:
                    done = subprocess.run(
                        cmd, capture_output=True, text=True, timeout=args.timeout, env=cold(cache)
                    )
                lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
                result = json.loads(lines[-1][7:]) if lines else {"error": done.stderr[-800:]}
            except subprocess.TimeoutExpired:
                result = {"error": f"timed out after {args.timeout} s"}
            result.update(side=result.get("side", side), batch=batch)
            if "tokens_per_s" in result:
                result["mfu"] = result["tokens_per_s"] * per_token / rate
            print(json.dumps(result), flush=True)
            rows.append(result)
    return rows


def table(rows: list[dict], batches: list[int], label: str = "") -> None:
    """The rows as a Markdown table: speed, MFU, first step, peak (sexpgpu: and its plan)."""
    head = (
        "| shape | batch | side | tokens/s | MFU | first step s | peak GiB | plan GiB | vs peer |"
    )
    print(head)
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in batches:
        mine = [r for r in rows if r["batch"] == batch and "tokens_per_s" in r]
        peers = [r["tokens_per_s"] for r in mine if not r["side"].startswith("sexpgpu")]
        best = max(peers, default=float("nan"))
        for r in mine:
            plan = r.get("planned_bytes")
            plan = "" if plan is None else f"{plan / 2**30:.1f}"
            print(
                f"| {label} | {batch} | {r['side']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                f"{r['first_step_s']:.1f} | {r['peak_bytes'] / 2**30:.1f} | {plan} | "
                f"{r['tokens_per_s'] / best:.2f}x |"
            )


if __name__ == "__main__":
    main()
