"""Where a cuda training step of GPT-2 small (or a Llama) spends its time (torch.profiler).

    python3 dev/gpt_profile.py [--model gpt|llama124m|tinyllama] [--batch 16] [--microbatches 1]
                               [--side sexpgpu|reduce-overhead|default|eager]
                               [--inductor KEY=VALUE ...] [--gelu-apart [backward]]
                               [--casts] [--sums-apart] [--run-loop]
                               [--lt-workspace BYTES]

Prints the step's wall time, the GPU time by kind (matmul, attention, fused
Triton kernels, other), what is left of the wall time (launch gaps, host),
and the kernels that took longest. `--side` profiles the peer of
benches/gpt2_cuda.py (the same model in PyTorch) instead. `--model llama124m`
(or `tinyllama`) profiles benches/llama_cuda.py's 124M Llama (or its TinyLlama
shape) and its peer instead of GPT-2 small. `--inductor` sets
Inductor options (``combo_kernels=True``) for both sides' compiles, to try
them. `--gelu-apart` keeps gelu and its gradient out of the products
(no `gelu_into_products` rewrite), to measure what it gives;
`--gelu-apart backward` only the gradient. `--casts` keeps the step's
casts of the parameters (no `param_casts_to_inputs`: no copies written by
the update). `--sums-apart` keeps the weight gradients' products apart
from their buffers (no `products_into_sums`: a cast and a write each).
`--lt-workspace` sets the workspace of sexpgpu's own cuBLASLt calls.
`--run-loop` profiles steps 6 to 9 of the run loop itself (`prepare_run`,
as benches/gpt2_cuda.py's sexpgpu side: loader, records, the loss read a
step behind) instead of the step called back to back. `--batch` is
one microbatch's rows; with `--microbatches` above 1
sexpgpu's device picks the stacking (the peers run all the rows as one
batch). For sexpgpu it also times the step's parts back to back: the fused
call (the CUDA graph's replay) alone and the update alone, so the host's
share of a step shows as what the whole step takes beyond their sum.
"""

import argparse
import ast
import sys
import time
from collections import Counter, defaultdict
from itertools import pairwise

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benches")
from gpt2_cuda import GPT, torch_step
from llama_cuda import KEYS, LLAMA, SHAPES, llama_step

import sexpgpu.devices.cuda.fused as fused_step
from sexpgpu.devices.cuda import cublaslt
from sexpgpu.devices.cuda.device import CudaDevice
from sexpgpu.devices.cuda.fx_rewrites import gelu_into_products
from sexpgpu.ir.compile import compile_run
from sexpgpu.lang import load_experiment_text
from sexpgpu.runtime.devices import Device

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=16, help="rows of one microbatch")
parser.add_argument(
    "--microbatches", type=int, default=1, help="a step's (stacking may run them in one call)"
)
parser.add_argument("--side", default="sexpgpu")
parser.add_argument("--model", default="gpt", choices=["gpt", "llama124m", "tinyllama"])
parser.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE")
parser.add_argument("--gelu-apart", nargs="?", const="all", choices=["all", "backward"])
parser.add_argument("--casts", action="store_true")
parser.add_argument("--sums-apart", action="store_true")
parser.add_argument("--run-loop", action="store_true")
parser.add_argument("--lt-workspace", type=int)
args = parser.parse_args()
# The options that change the step patch the modules that build it.
if args.lt_workspace is not None:
    cublaslt.WORKSPACE = args.lt_workspace
if args.casts:
    fused_step.param_casts_to_inputs = lambda gm, params: []
if args.sums_apart:
    fused_step.products_into_sums = lambda gm: 0
if args.gelu_apart:

    def apart(gm, backward=True):
        return (0, 0) if args.gelu_apart == "all" else gelu_into_products(gm, backward=False)

    fused_step.gelu_into_products = apart
for setting in args.inductor:
    key, value = setting.split("=", 1)
    target = torch._inductor.config
    *path, last = key.split(".")
    for part in path:
        target = getattr(target, part)
    setattr(target, last, ast.literal_eval(value))  # True, 2, "name"


def analyse(p, wall: float) -> None:
    """GPU time by kind, the GPU's idle gaps and what memsets come before, over `p`'s events."""
    kinds = defaultdict(float)
    for e in p.key_averages():
        # Self time: an aten op's own is 0, its kernels carry theirs.
        gpu = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) / 1e3
        if gpu <= 0:
            continue
        name = e.key.lower()
        if "flash" in name or "fmha" in name or "attention" in name:
            kinds["attention"] += gpu
        elif any(k in name for k in ("gemm", "cutlass", "sm90", "nvjet", "cublas")):
            kinds["matmul"] += gpu
        elif name.startswith("triton"):
            kinds["fused (Triton)"] += gpu
        else:
            kinds["other: " + e.key[:50]] += gpu
    total = sum(kinds.values())
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{kind:60s} {ms:8.2f} ms")
    print(f"GPU busy {total:.1f} ms of {wall:.1f} ms wall: gaps and host {wall - total:.1f} ms")
    # Where the GPU waits: the gaps between its kernels over the profiled step, the longest first.
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in p.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    gaps, end, before = [], None, ""
    for start, stop, name in spans:
        if end is not None and start > end:
            gaps.append((start - end, before, name))
        if end is None or stop > end:
            end, before = stop, name
    idle = sum(g for g, _, _ in gaps)
    # What each memset (and each copy on the device) comes before: who asked for it.
    after_memset: defaultdict = defaultdict(int)
    for (_, _, name), (_, _, following) in pairwise(spans):
        if name.startswith(("Memset", "Memcpy")):
            after_memset[f"{name[:20]} before {following[:60]}"] += 1
    for what, count in sorted(after_memset.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  x{count} {what}")
    print(f"GPU idle between kernels {idle / 1e3:.2f} ms in {len(gaps)} gaps; longest:")
    for gap, before, after in sorted(gaps, reverse=True)[:8]:
        print(f"  {gap:8.1f} us after {before[:50]} before {after[:50]}")


def memsets_by_op(p) -> None:
    """Which ops' calls launch memsets (a plain call, not a replay, so the host's ops show)."""
    found: Counter = Counter()
    for e in p.events():
        if not any(k.name.startswith("Memset") for k in getattr(e, "kernels", [])):
            continue
        op = e
        while op is not None and not op.name.startswith(("aten::", "sexpgpu::")):
            op = op.cpu_parent
        op = op or e
        found[f"{op.name} {op.input_shapes}"[:150]] += 1
    print(f"memsets in a plain call: {sum(found.values())}, by the op that launched them:")
    for what, count in found.most_common(12):
        print(f"  x{count} {what}")


if args.model == "gpt":
    shape = {"layers": 12, "width": 768, "heads": 12, "seq": 1024, "vocab": 50304}
    template = GPT
else:  # one of benches/llama_cuda.py's shapes
    shape = dict(zip(KEYS, SHAPES[args.model.removeprefix("llama")], strict=False))
    template = LLAMA
rng = np.random.default_rng(0)
micro = args.microbatches
t = rng.integers(0, 256, (args.batch * micro, shape["seq"] + 1)).astype(np.int32)
rows = args.batch * micro


class Ctx:
    size = 1
    rank = 0


def profile_run_loop(first: int = 6, last: int = 9) -> None:
    """Steps `first` to `last` of a run as the product runs it, under the profiler."""
    import tempfile
    from pathlib import Path

    from sexpgpu.train import prepare_run

    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    clock_at: dict[str, float] = {}

    def on_step(report) -> None:  # after the step's numbers are read (the next step is queued)
        if report.step == first - 1:
            profiler.start()
            clock_at["start"] = time.perf_counter()
        elif report.step == last:
            torch.cuda.synchronize()
            clock_at["stop"] = time.perf_counter()
            profiler.stop()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt.lisp"
        path.write_text(
            template.format(
                **shape, batch=args.batch, microbatches=micro, steps=last + 2, dtype="bf16"
            )
        )
        prepare_run(path, out=Path(tmp) / "run", device="cuda", on_step=on_step).run()
    steps = last - first + 1
    wall = (clock_at["stop"] - clock_at["start"]) * 1e3
    print(f"run loop, steps {first} to {last}: {wall / steps:.2f} ms a step")
    analyse(profiler, wall)
    host = sorted(
        (e for e in profiler.key_averages() if e.self_cpu_time_total > 0),
        key=lambda e: -e.self_cpu_time_total,
    )
    print("the host's time by call (self), per step:")
    for e in host[:15]:
        ms = e.self_cpu_time_total / 1e3 / steps
        print(f"  {e.key[:60]:60s} {ms:8.2f} ms x{e.count // steps}")


if args.run_loop:
    profile_run_loop()
    sys.exit(0)

if args.side == "sexpgpu":
    text = template.format(**shape, batch=args.batch, microbatches=micro, steps=10, dtype="bf16")
    ex = load_experiment_text(text, f"{args.model}.lisp")
    compiled = compile_run(ex, ex.run())
    device = CudaDevice("cuda")
    memory_plan = device.plan(compiled, optimizer="adamw", ranks=1, memory=None, microbatches=micro)
    prog = device.load(memory_plan, Device("cuda", 0))
    prog.start(ex.run().optimizer, seed=1, state=None)
    parts = [t[i * args.batch : (i + 1) * args.batch] for i in range(micro)]
    batches = [{"tokens": p[:, :-1], "next": p[:, 1:]} for p in parts]

    def step():
        for batch in batches:
            prog.accumulate(batch)
        prog.reduce(Ctx(), micro)
        prog.update(1e-4, 1.0)

else:
    if args.model == "gpt":
        peer = torch_step(argparse.Namespace(**shape), args.side)
    else:
        peer = llama_step(argparse.Namespace(**shape, device="cuda"), args.side)
    tokens = torch.from_numpy(t.astype(np.int64)).to("cuda")

    def step():
        peer(tokens).item()


def clock(fn, reps: int = 10) -> float:
    """Milliseconds per call of `fn`, back to back (the host waits only at the end)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


wall = clock(step)
print(f"step {wall:.1f} ms, {rows * shape['seq'] / wall * 1e3:,.0f} tokens/s")
peak = torch.cuda.max_memory_allocated() / 2**30
planned = f" (plan {memory_plan.memory.total / 2**30:.2f} GiB)" if args.side == "sexpgpu" else ""
print(f"peak {peak:.2f} GiB{planned}")
if args.side == "sexpgpu":
    fused = prog.graphs.fused
    sums = prog.graphs._zeroed()
    buffers = {"loss": sums.loss, **{"grad/" + k: g for k, g in sums.grads.items()}}
    degree = prog.graphs.degree  # microbatches of one call, stacked on a new leading axis
    stacked = (
        batches[0]
        if degree == 1
        else {name: np.stack([b[name] for b in batches[:degree]]) for name in batches[0]}
    )
    print(f"stacking {degree}")
    call = clock(lambda: fused({**stacked, **prog.values}, buffers, zeros=True)) * micro / degree
    for batch in batches:
        prog.accumulate(batch)
    grads = list(prog._sums.grads.values())

    def update_only():
        norm = prog.xp.norm(grads)
        prog.optimizer.advance(1e-4)
        prog.optimizer.queue(prog.values, prog._sums.grads, prog.xp.clip_scale(norm, 1.0))

    update = clock(update_only)
    prog._sums = None  # the profiled step below starts from zeroed sums again
    print(
        f"parts back to back: fused call {call:.2f} ms, update {update:.2f} ms; "
        f"the step's host share {wall - call - update:.2f} ms"
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as q:
        fused._compiled(*fused._flat({**stacked, **prog.values}, buffers))
        torch.cuda.synchronize()
    memsets_by_op(q)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    step()
    torch.cuda.synchronize()
analyse(p, wall)
rows = p.key_averages()
print(rows.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=80))
if args.side == "sexpgpu":  # which IR nodes each kernel above covers
    print("\n".join(prog.graphs.fused.report_lines()))
