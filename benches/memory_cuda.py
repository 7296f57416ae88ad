"""Past one GPU's memory: the Llama example scaled until it does not fit, sexpgpu against PyTorch.

For each size (layers x width, at sequence 2048): sexpgpu runs
`examples/llama.lisp` through `prepare_run` and the run loop, its plan
choosing what to recompute; the peer is the same model in PyTorch (RMSNorm,
rotary embeddings, grouped-query SDPA attention, SwiGLU, no biases) under
``torch.autocast`` in bf16 over f32 parameters with
``torch.optim.AdamW(fused=True)``, ``torch.compile`` of the model and
``torch.utils.checkpoint`` around every block, the usual way past memory in
PyTorch. Each side and size runs in its own process. Reported per side and
size: whether it trains, tokens per second (the median step after
`--warmup`), the allocator's peak, and sexpgpu's recompute line and plan;
then the largest size each side trains, and the FLOPs sexpgpu adds at a
budget of 60% of its no-recompute plan (the plan alone, for the first size
or for `--flops-sizes`: 60% of a plan is below the parameters, gradients and
moments alone where activations are a small part of it, and then no
recomputation fits).

    python benches/memory_cuda.py                         # the sizes, on one GPU
    python benches/memory_cuda.py --sizes 16x2048 32x3072 # some of them
    python benches/memory_cuda.py --card 40 --sizes 8x4096 11x4096 12x4096  # a 40 GiB card
    python benches/memory_cuda.py --card 40 --sizes 13x4096 --sides torch   # one side
    python benches/memory_cuda.py --smoke                 # on the CPU in seconds: the paths
    python benches/memory_cuda.py --card 40 --sizes 13x4096 --profile --logs L  # kernels, in L
    python benches/memory_cuda.py --sizes 13x4096 --sides sexpgpu --flops-sizes 16x2048 13x4096@16

``--profile`` runs each side's steps after the warm-up (but the last) under
``torch.profiler`` and writes the kernels that took longest, per step, into
the side's log (``--logs``).

``--card GIB`` makes the GPU a smaller card for both sides alike: PyTorch's
caching allocator refuses more than GIB in each process
(``torch.cuda.set_per_process_memory_fraction``), and sexpgpu also plans
into it (``SEXPGPU_MEMORY``). Past a card's memory is then reached at sizes
that compile in a minute, not ten. Both sides' allocators grow their
segments in place (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
sexpgpu's default and torchtitan's) unless the environment sets it.

``--smoke`` runs tiny sizes on the CPU: sexpgpu's cpu device with a budget
that makes it recompute, the peer eager (no torch.compile, whose C++ build
takes minutes on a CPU). Results are recorded in benches/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from gpt2_cuda import adamw_step  # noqa: E402

LLAMA = ROOT / "examples" / "llama.lisp"
# Sizes (layers, width) from comfortable to past one H200 without recomputation.
SIZES = ["16x2048", "24x2048", "32x2560", "32x3072", "40x3584", "48x4096"]
SMOKE_SIZES = ["2x64"]
SIDES = ("sexpgpu", "torch")


def shape(size: str, args: argparse.Namespace) -> dict:
    """Layers, width, heads (128 wide, 16 at smoke size), kv-heads (a quarter), ffn (8/3 width)."""
    layers, width = (int(x) for x in size.split("x"))
    head = 16 if args.smoke else 128
    heads = max(1, width // head)
    ffn = 64 * ((8 * width // 3 + 63) // 64)
    return {"layers": layers, "width": width, "heads": heads, "kv": max(1, heads // 4), "ffn": ffn}


def variant(size: str, args: argparse.Namespace) -> str:
    s = shape(size, args)
    dtype = "f32" if args.smoke else "bf16"
    return (
        f"(defvariant bench (layers {s['layers']}) (width {s['width']}) (heads {s['heads']}) "
        f"(kv-heads {s['kv']}) (ffn {s['ffn']}) (seq {args.seq}) (batch {args.batch}) "
        f'(microbatches 1) (dtype "{dtype}") (eval-every 1000000) (checkpoint-every 1000000))'
    )


def sexpgpu_side(size: str, args: argparse.Namespace) -> dict:
    from sexpgpu.errors import SexpgpuError
    from sexpgpu.train import prepare_run
    from sexpgpu.train.metrics import read_metrics

    device = "cpu" if args.smoke else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama.lisp"
        path.write_text(LLAMA.read_text() + variant(size, args))
        environ = dict(os.environ)
        if args.smoke:  # a budget the smoke size fits only by recomputing
            plain = plain_plan(path, device)
            budget = plain.total - 0.3 * plain.parts["activations"]
            environ["SEXPGPU_MEMORY"] = str(int(budget))
        elif args.card:
            environ["SEXPGPU_MEMORY"] = f"{args.card}GiB"
            limit_card(args.card)
        try:
            profiled = Profiled(args)
            trainer = prepare_run(
                path, variant="bench", steps=args.steps, out=Path(tmp) / "run",
                device=device, environ=environ, on_step=lambda r: profiled.at(r.step),
            )  # fmt: skip
        except SexpgpuError as error:
            if error.code != "E-MEM-001":
                raise
            return {"fits": False, "why": error.message}
        trainer.run()
        records = list(read_metrics(Path(tmp) / "run" / "metrics.jsonl"))
    times = [r["value"] for r in records if r["name"] == "train/step_time_s"]
    notes = [r["value"] for r in records if r["name"] == "annotation"]
    peaks = [r["value"] for r in records if r["name"] == "runtime/peak_bytes"]
    return {
        "fits": True,
        "step_s": statistics.median(times[args.warmup :] or times),
        "peak_bytes": max(peaks),
        "plan": next((n for n in notes if n.startswith("memory: plan")), None),
        "recompute": next((n for n in notes if n.startswith("recompute:")), "none"),
    }


class Profiled:
    """Steps ``--warmup`` + 1 to ``--steps`` - 1 under ``torch.profiler`` where ``--profile`` asks.

    `at(step)` is called after each step (counted from 1); the kernels that
    took longest are printed per step when the last one is done.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.first, self.last = args.warmup + 1, args.steps - 1
        self.gpu, self.prof = not args.smoke, None
        if args.profile and self.last >= self.first:
            from torch.profiler import ProfilerActivity, profile

            kind = ProfilerActivity.CUDA if self.gpu else ProfilerActivity.CPU
            self.prof = profile(activities=[kind])

    def at(self, step: int) -> None:
        if self.prof is None:
            return
        if step == self.first - 1:
            self.prof.start()
        elif step == self.last:
            if self.gpu:
                import torch

                torch.cuda.synchronize()
            self.prof.stop()
            self.report()

    def report(self) -> None:
        steps = self.last - self.first + 1
        key = "device_time_total" if self.gpu else "cpu_time_total"
        events = sorted(self.prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
        total = sum(getattr(e, key) for e in events)
        print(f"profile: {total / 1e3 / steps:.1f} ms a step in kernels, steps {self.first}-"
              f"{self.last}")  # fmt: skip
        for e in events[:40]:
            ms = getattr(e, key) / 1e3 / steps
            print(f"profile: {ms:9.2f} ms {e.count / steps:7.1f}x  {e.key[:150]}")


def limit_card(gib: float) -> None:
    """This process's CUDA allocations refused past `gib` GiB, as on a card of that size."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))


def plain_plan(path: Path, device: str):
    """The run's memory plan without recomputation (a `MemoryPlan`, against no budget)."""
    from sexpgpu.devices.base import get_device
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment

    experiment = load_experiment(path, variant="bench")
    run = experiment.run(None)
    compiled = compile_run(experiment, run)
    plan = get_device(device).plan(compiled, optimizer=run.optimizer.name, ranks=1, memory=2**62)
    return plan.memory


def flops_at_60(size: str, args: argparse.Namespace) -> dict:
    """The FLOPs the plan adds at a budget of 60% of the no-recompute plan (nothing run)."""
    from sexpgpu.devices.base import get_device
    from sexpgpu.devices.memory_fit import recompute_lines
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment

    device = "cpu" if args.smoke else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama.lisp"
        path.write_text(LLAMA.read_text() + variant(size, args))
        total = plain_plan(path, device).total
        experiment = load_experiment(path, variant="bench")
        run = experiment.run(None)
        compiled = compile_run(experiment, run)
    budget = int(0.6 * total)
    plan = get_device(device).plan(compiled, optimizer=run.optimizer.name, ranks=1, memory=budget)
    done = plan.recompute
    return {
        "plain_bytes": total,
        "fits": plan.memory.fits,
        "flops_ratio": done.flops / done.base_flops if done is not None else 1.0,
        "line": (recompute_lines(plan) or ["no recomputation needed"])[0],
    }


def torch_side(size: str, args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    on_gpu = not args.smoke
    dev = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu and args.card:
        limit_card(args.card)
    try:
        step = torch_step(shape(size, args), args, dev)
    except torch.OutOfMemoryError as error:  # the parameters and moments alone
        return {"fits": False, "why": str(error).splitlines()[0]}
    rng = np.random.default_rng(0)
    data = [torch.from_numpy(rng.integers(0, 256, (args.batch, args.seq + 1))) for _ in range(4)]
    data = [d.to(dev) for d in data]
    times = []
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    profiled = Profiled(args)
    try:
        for i in range(args.steps):
            profiled.at(i)
            if on_gpu:
                torch.cuda.synchronize()
            began = time.perf_counter()
            step(data[i % len(data)]).item()
            times.append(time.perf_counter() - began)
        profiled.at(args.steps)
    except torch.OutOfMemoryError as error:
        return {"fits": False, "why": str(error).splitlines()[0]}
    return {
        "fits": True,
        "step_s": statistics.median(times[args.warmup :] or times),
        "peak_bytes": int(torch.cuda.max_memory_allocated()) if on_gpu else 0,
    }


def torch_step(s: dict, args: argparse.Namespace, dev):
    """The peer's step, ``step(tokens) -> loss``: compiled, each block checkpointed."""
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.checkpoint import checkpoint

    width, heads, kv = s["width"], s["heads"], s["kv"]
    hd = width // heads

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(width), nn.RMSNorm(width)
            self.q = nn.Linear(width, heads * hd, bias=False)
            self.kv = nn.Linear(width, 2 * kv * hd, bias=False)
            self.o = nn.Linear(width, width, bias=False)
            self.gate_up = nn.Linear(width, 2 * s["ffn"], bias=False)
            self.down = nn.Linear(s["ffn"], width, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            h = self.n1(x)
            q = self.q(h).view(b, t, heads, hd).transpose(1, 2)
            k, v = self.kv(h).view(b, t, 2 * kv, hd).transpose(1, 2).chunk(2, dim=1)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, width))
            gate, up = self.gate_up(self.n2(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)

    def rope(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, width)
            self.blocks = nn.ModuleList(Block() for _ in range(s["layers"]))
            self.norm = nn.RMSNorm(width)
            self.head = nn.Linear(width, 256, bias=False)
            angles = torch.outer(
                torch.arange(args.seq, dtype=torch.float32),
                10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd),
            )
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

        def forward(self, tokens, targets):
            with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
                x = self.embed(tokens)
                for block in self.blocks:
                    x = checkpoint(block, x, self.cos, self.sin, use_reentrant=False)
                logits = self.head(self.norm(x))
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    model = Llama().to(dev)
    loss_of = model if args.smoke else torch.compile(model)
    return adamw_step(model, loss_of, 3e-4, fused=dev.type == "cuda")


def params_of(size: str, args: argparse.Namespace) -> int:
    s = shape(size, args)
    w, hd = s["width"], s["width"] // s["heads"]
    per_layer = w * w * 2 + 2 * w * s["kv"] * hd + 3 * w * s["ffn"] + 2 * w
    return s["layers"] * per_layer + 2 * 256 * w + w


def child(args: argparse.Namespace) -> None:
    """One side and size, in this process (``--side``): its result as a RESULT line."""
    if args.side == "sexpgpu":
        result = sexpgpu_side(args.size, args)
    elif args.side == "flops60":
        result = flops_at_60(args.size, args)
    else:
        result = torch_side(args.size, args)
    if result.get("fits") and "step_s" in result:
        result["tokens_per_s"] = args.batch * args.seq / result["step_s"]
    print("RESULT " + json.dumps(result), flush=True)


def run_child(side: str, size: str, args: argparse.Namespace) -> dict:
    flags = [f"--seq={args.seq}", f"--batch={args.batch}", f"--steps={args.steps}"]
    flags += [f"--warmup={args.warmup}", *(["--smoke"] if args.smoke else [])]
    flags += [f"--card={args.card}"] if args.card else []
    flags += ["--profile"] if args.profile and side != "flops60" else []
    cmd = [sys.executable, __file__, f"--side={side}", f"--size={size}", *flags]
    env = {
        # Both sides' allocators grow segments in place (sexpgpu's default, torchtitan's).
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired as timeout:
        done = None
        out, err = timeout.stdout or "", timeout.stderr or ""
    else:
        out, err = done.stdout, done.stderr
    if args.logs:  # the child's whole output: a failure's traceback, sexpgpu's report
        logs = Path(args.logs)
        logs.mkdir(parents=True, exist_ok=True)
        text = [t.decode(errors="replace") if isinstance(t, bytes) else t for t in (out, err)]
        (logs / f"{side}_{size}.log").write_text("\n".join(text))
    if done is None:
        return {"error": f"timed out after {args.timeout} s"}
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][7:])
    # The exception's own line (a traceback's last), not the frames above it.
    last = [x for x in err.splitlines() if x.strip() and not x.startswith(" ")]
    return {"error": (last[-1] if last else err)[-400:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, seconds")
    parser.add_argument("--sizes", nargs="+", help="LAYERSxWIDTH (default: the ladder)")
    for name, default in (("seq", 2048), ("batch", 8), ("steps", 10), ("warmup", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--card", type=float, help="GiB the GPU may use, both sides alike")
    parser.add_argument("--logs", help="a folder for each side and size's whole output")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--profile", action="store_true", help="kernel times into --logs")
    parser.add_argument(
        "--flops-sizes",
        nargs="+",
        metavar="SIZE[@BATCH]",
        help="where to plan at 60%% of the no-recompute plan (default: the first size; none)",
    )
    parser.add_argument("--side", help=argparse.SUPPRESS)  # one side, in a child process
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke and args.seq == 2048:
        args.seq, args.batch, args.steps, args.warmup = 64, 2, 3, 1
    if args.side:
        child(args)
        return
    sizes = args.sizes or (SMOKE_SIZES if args.smoke else SIZES)
    card = f", a {args.card:g} GiB card" if args.card else ""
    print(f"seq {args.seq}, batch {args.batch}, {args.steps} steps ({args.warmup} warm-up){card}")
    print("| size | parameters | side | trains | tokens/s | peak GiB | recompute |")
    print("|---|---|---|---|---|---|---|")
    largest: dict[str, str] = {}
    for size in sizes:
        for side in args.sides:
            r = run_child(side, size, args)
            trains = "yes" if r.get("fits") else "no" if "fits" in r else "error"
            rate = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-"
            peak = f"{r['peak_bytes'] / 2**30:.1f}" if r.get("peak_bytes") else "-"
            note = (
                r.get("recompute", "checkpoint every block")
                if side == "sexpgpu"
                else ("checkpoint every block")
            )
            if trains != "yes":
                note = r.get("why") or r.get("error", "")
            print(f"| {size} | {params_of(size, args) / 1e9:.2f}B | {side} | {trains} | {rate} | "
                  f"{peak} | {note.splitlines()[0] if note else ''} |", flush=True)  # fmt: skip
            if trains == "yes":
                largest[side] = size
    print(f"largest trained: sexpgpu {largest.get('sexpgpu', 'none')}, "
          f"torch {largest.get('torch', 'none')}")  # fmt: skip
    if "sexpgpu" not in args.sides:
        return
    for at in [] if args.flops_sizes == ["none"] else args.flops_sizes or sizes[:1]:
        size, _, batch = at.partition("@")
        r = run_child(
            "flops60", size, argparse.Namespace(**{**vars(args), "batch": int(batch or args.batch)})
        )
        where = f"{size}, batch {batch or args.batch}"
        if "flops_ratio" in r:
            print(f"flops at 60% of the plan ({where}): {r['flops_ratio']:.3f}x, {r['line']}")
        else:
            print(f"flops at 60% of the plan ({where}): error {r.get('error', '')[-400:]}")


if __name__ == "__main__":
    main()
