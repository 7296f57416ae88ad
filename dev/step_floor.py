"""A training step's floor on this device: each product and attention call alone, at its best.

    python3 dev/step_floor.py FILE.lisp [--variant V] [--reps 20]
    python3 dev/step_floor.py --bench tinyllama|124m|gpt2 --batch B [--peer-ms MS]

Compiles the run's training graph (the IR every device receives, one call
of the whole batch, its sibling products joined as the fusing device joins
them), groups its products (``matmul``) by operand shapes and
its attention calls (``attention``, ``attention-grad``) by shape, and times
each group's call alone on the device, warm, back to back: the best of
`--reps`. A product is timed in each layout cuBLAS takes without a copy (as
stored, either operand transposed, both) and the fastest counts; attention
runs through the cuda device's own fused kernels (its backend, as a run
picks it). The update is counted as AdamW's least traffic (read the
parameter, its gradient and both moments in f32, write the parameter and
the moments, and the bf16 copy the products read: 30 bytes a parameter, 4 more
where the run clips its gradients' norm) at the device's copy rate. Beside it, the
ideal: every product's and attention's FLOPs at the rate an 8192-cubed bf16
product reaches on this device (the benchmarks' MFU reference; 1024 on a CPU).

Everything else the step does (norms, activations, residuals, rotations,
the loss) is counted as its least traffic at the copy rate (`between_bytes`),
and the gaps between kernels as nothing, so the sum is a floor: no schedule
of these kernels runs faster on this device. With
`--peer-ms` (a peer's measured step) it also prints the step a ratio over
the peer allows (`--ratio`, 1.15 by default) beside the floor.

`--bench` builds the benchmarks' own files (benches/gpt2_cuda.py's GPT-2
small, benches/llama_cuda.py's shapes) at batch `--batch`, one call.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

from sexpgpu.devices.cuda.attention import sdpa_backward, sdpa_forward, select_sdpa_backend
from sexpgpu.devices.cuda.lowering import torch_dtype
from sexpgpu.ir.compile import compile_run
from sexpgpu.devices.cuda.planner import fused_base
from sexpgpu.ir.node import Graph
from sexpgpu.ir.ops import FED, LEAF, VIEW, Op
from sexpgpu.ir.recompute import _bytes, _root
from sexpgpu.lang import load_experiment

# A parameter's least traffic in AdamW's update: f32 parameter, gradient and moments read,
# parameter and moments written, and the bf16 copy the step's products read.
ADAMW_BYTES = 30
CLIP_BYTES = 4  # clipping reads every f32 gradient once more, for their norm, before the update
HEAVY = frozenset({Op.MATMUL, Op.ATTENTION, Op.ATTENTION_GRAD})  # kernels of their own, timed


def between_bytes(graph: Graph) -> int:
    """The least traffic of the work between the timed kernels, however it is fused.

    Whatever else the step does (norms, activations, residuals, rotations,
    the loss) must read at least once each buffer a timed kernel (or the
    caller) hands it, and write at least once each buffer it hands a timed
    kernel or the caller; a fusion that made every other value in registers
    would move no more. Products with epilogues are not modelled (an
    epilogue's input would not go to memory), so a step whose products take
    epilogues (GPT-2's gelu) may move less.
    """
    outputs = {id(_root(n)) for n in graph.outputs.values()}

    def copy(x) -> bool:  # a parameter's bf16 copy: the update writes it (`ADAMW_BYTES`)
        return x.op is Op.CAST and x.inputs[0].op is Op.PARAM

    def into_sum(x) -> bool:  # a weight's gradient: the product writes it into its f32 sum
        return x.op is Op.CAST and _root(x.inputs[0]).op in HEAVY and id(x) in outputs

    read, written = {}, {}
    for node in graph.nodes():
        if node.op in VIEW or node.op in LEAF or copy(node) or into_sum(node):
            continue
        for x in map(_root, node.inputs):
            stored = x.op in FED or copy(x)  # constants and positions are made in the kernels
            if node.op in HEAVY and x.op not in HEAVY and x.op not in LEAF and not stored:
                written[id(x)] = _bytes(x)
            elif node.op not in HEAVY and (x.op in HEAVY or stored):
                read[id(x)] = _bytes(x)
        if node.op not in HEAVY and id(node) in outputs:
            written[id(node)] = _bytes(node)
    return sum(read.values()) + sum(written.values())


def bench_file(bench: str, batch: int, folder: Path) -> Path:
    """One of the benchmarks' experiments at `batch` rows, as a file in `folder`."""
    from gpt2_cuda import GPT
    from llama_cuda import KEYS, LLAMA, SHAPES

    if bench == "gpt2":
        shape = {"layers": 12, "width": 768, "heads": 12, "seq": 1024, "vocab": 50304}
        template = GPT
    else:
        shape, template = dict(zip(KEYS, SHAPES[bench], strict=False)), LLAMA
    path = folder / f"{bench}.lisp"
    path.write_text(template.format(**shape, batch=batch, microbatches=1, steps=1, dtype="bf16"))
    return path


def best_ms(fn, reps: int) -> float:
    """The fastest of `reps` calls of `fn`, in milliseconds, after three to warm up."""
    cuda = torch.cuda.is_available()
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return min(times)


def _stored(shape: tuple[int, ...], transposed: bool, dtype, device) -> torch.Tensor:
    """A tensor of `shape`, stored as is or as the transpose of its last two axes."""
    if not transposed:
        return torch.randn(shape, dtype=dtype, device=device)
    flipped = (*shape[:-2], shape[-1], shape[-2])
    return torch.randn(flipped, dtype=dtype, device=device).transpose(-1, -2)


def product_ms(a: tuple, b: tuple, dtype, device, reps: int) -> tuple[float, str]:
    """A product's best time over the four layouts, and the layout (``NN``, ``TN``, ...)."""
    if len(b) == 2 and len(a) > 2:  # a weight: the rows fold into one axis, as the device runs it
        a = (math.prod(a[:-1]), a[-1])
    best = (math.inf, "")
    for ta in (False, True):
        for tb in (False, True):
            x, y = _stored(a, ta, dtype, device), _stored(b, tb, dtype, device)
            ms = best_ms(lambda x=x, y=y: torch.matmul(x, y), reps)
            best = min(best, (ms, "TN"[ta] + "TN"[tb]))
            del x, y
    return best


def attention_ms(node, dtype, device, reps: int) -> float:
    """The fused attention call's (or its gradient's) best time, on the device's backend."""
    shape, causal, scale = node.inputs[0].shape, node.attrs["causal"], node.attrs["scale"]
    backend = select_sdpa_backend(device, dtype)
    q, k, v = (torch.randn(x.shape, dtype=dtype, device=device) for x in node.inputs[:3])
    if node.op is Op.ATTENTION:
        return best_ms(lambda: sdpa_forward(q, k, v, causal, scale, backend), reps)
    g = torch.randn(shape, dtype=dtype, device=device)
    _, aux = sdpa_forward(q, k, v, causal, scale, backend)
    return best_ms(lambda: sdpa_backward(g, q, k, v, causal, scale, aux, backend), reps)


def copy_rate(device, reps: int) -> float:
    """Bytes a second one large copy moves (read plus write)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = best_ms(lambda: dst.copy_(src), reps)
    return 2 * src.numel() * 4 / (ms / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?")
    parser.add_argument("--variant")
    parser.add_argument("--bench", choices=["gpt2", "124m", "tinyllama", "smoke"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--peer-ms", type=float, help="a peer's measured step, milliseconds")
    parser.add_argument("--ratio", type=float, default=1.15)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if (args.file is None) == (args.bench is None):
        parser.error("give a FILE or --bench")
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(args.file) if args.file else bench_file(args.bench, args.batch, Path(folder))
        experiment = load_experiment(path, variant=args.variant)
        run = experiment.run(None)
        compiled = compile_run(experiment, run)
    graph, _ = fused_base(compiled.train_graph)  # as the fusing device runs one call
    nodes = graph.nodes()
    products = Counter(
        (n.inputs[0].shape, n.inputs[1].shape, n.dtype) for n in nodes if n.op is Op.MATMUL
    )
    calls = [n for n in nodes if n.op in (Op.ATTENTION, Op.ATTENTION_GRAD)]
    examples = {(n.op, n.inputs[0].shape, n.inputs[1].shape, n.dtype): n for n in calls}
    attention = Counter((n.op, n.inputs[0].shape, n.inputs[1].shape, n.dtype) for n in calls)
    print(f"{path.name}: {len(nodes)} nodes, {sum(products.values())} products, device {device}")
    rows, total, flops_total = [], 0.0, 0
    for (a, b, dtype), count in products.items():
        ms, layout = product_ms(a, b, torch_dtype(dtype), device, args.reps)
        flops = 2 * math.prod((*a[:-1], b[-1])) * a[-1]
        name = f"matmul {list(a)} by {list(b)} {dtype}"
        rows.append((count * ms, name, count, ms, flops, layout))
    for key, count in attention.items():
        op, shape, _, dtype = key
        ms = attention_ms(examples[key], torch_dtype(dtype), device, args.reps)
        flops = (4 if op is Op.ATTENTION else 8) * math.prod(shape) * shape[-2]
        name = "attention" if op is Op.ATTENTION else "attention-grad"
        rows.append((count * ms, f"{name} {list(shape)} {dtype}", count, ms, flops, ""))
    print(f"{'call':60s} {'count':>5s} {'ms each':>9s} {'TFLOP/s':>8s} {'ms in all':>10s}")
    for all_ms, name, count, ms, flops, layout in sorted(rows, reverse=True):
        total += all_ms
        flops_total += count * flops
        rate = flops / (ms / 1e3) / 1e12
        print(f"{name[:56]:56s} {layout:3s} {count:5d} {ms:9.3f} {rate:8.1f} {all_ms:10.2f}")
    params = sum(math.prod(p.shape) for p in compiled.train_graph.params.values())
    rate = copy_rate(device, args.reps)
    per_param = ADAMW_BYTES + (CLIP_BYTES if run.clip is not None else 0)
    update = params * per_param / rate * 1e3
    print(f"products and attention: {total:.2f} ms ({flops_total / total / 1e9:.1f} TFLOP/s)")
    print(
        f"the update's least traffic: {params:,} parameters x {per_param} bytes at the copy "
        f"rate {rate / 1e12:.2f} TB/s: {update:.2f} ms"
    )
    between = between_bytes(graph)
    between_ms = between / rate * 1e3
    print(
        f"the work between them, least traffic: {between / 1e9:.2f} GB at the copy rate: "
        f"{between_ms:.2f} ms"
    )
    floor = total + update + between_ms
    n = 8192 if device.type == "cuda" else 1024  # a CPU's smoke run keeps to seconds
    x = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    peak = 2 * n**3 / (best_ms(lambda: x @ x, args.reps) / 1e3)
    ideal = flops_total / peak * 1e3
    print(
        f"ideal: {flops_total / 1e12:.1f} TFLOP at the {n}-cubed rate {peak / 1e12:.1f} TFLOP/s: "
        f"{ideal:.2f} ms, with the update {ideal + update:.2f} ms"
    )
    print(f"floor: {floor:.2f} ms a step, {run.batch * _seq(compiled) / floor * 1e3:,.0f} tokens/s")
    if args.peer_ms:
        allowed = args.peer_ms / args.ratio
        print(
            f"{args.ratio}x a peer's {args.peer_ms:.2f} ms allows {allowed:.2f} ms: "
            f"{allowed - floor:.2f} ms above the floor (gaps between kernels, rates below each call's best)"
        )


def _seq(compiled) -> int:
    """Tokens a row: the second axis of the first integer input (1 where there is none)."""
    for shape, dtype in compiled.inputs.values():
        if dtype.startswith("int") and len(shape) > 1:
            return shape[1]
    return 1


if __name__ == "__main__":
    main()
