"""A training step's products: PyTorch's ``mm`` against cuBLASLt as sexpgpu calls it.

    python3 dev/product_probe.py [--rows 16384] [--lt-workspace BYTES]
    python3 dev/product_probe.py --layouts [--width 4096 --ffn 10944 --kv 1024]
    python3 dev/product_probe.py --workspaces 1048576 33554432 [--rows 32768]

For each product of a GPT-2 small training step (forward, the inputs'
gradients, the weights' gradients; bf16, the operands laid out as the traced
step has them), `triton.testing.do_bench` of: ``torch.mm`` (then, for a
weight gradient, its cast into an f32 buffer, as the step did before
`products_into_sums`); `cublaslt.matmul` without an epilogue (its
reduction schemes limited as `sexpgpu.devices.cuda.cublaslt` sets them);
and ``sexpgpu::mm_into`` writing f32. Also how many memsets one call of
each launches (torch.profiler), since a CUDA graph replays each as a node
of its own. `--lt-workspace` sets the workspace sexpgpu's cuBLASLt calls
offer (PyTorch's own is set by ``CUBLAS_WORKSPACE_CONFIG`` and
``CUBLASLT_WORKSPACE_SIZE``).

`--workspaces` instead times the weights' gradients written in f32 by
``mm_into`` (the 124M Llama's and GPT-2 small's shapes) with each cuBLASLt
workspace size in turn, in one process, beside PyTorch's bf16 product and
its cast: whether more workspace lets cuBLASLt split their long sums.

`--layouts` instead times a Llama block's products (width, SwiGLU width,
key/value width) in both layouts: sexpgpu's (a weight stored ``[in out]``:
``x W``, ``dy W^T``, ``x^T dy`` written in f32 by ``mm_into``) and a
``torch.nn.Linear``'s (``[out in]``: ``x W^T``, ``dy W``, ``dy^T x`` in
bf16, then cast into an f32 buffer), with each one's TFLOP/s: whether
the same product runs slower in one layout.
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from sexpgpu.devices.cuda import cublaslt, sum_products  # noqa: F401  (registers the op)

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=16384)
parser.add_argument("--lt-workspace", type=int, default=cublaslt.WORKSPACE)
parser.add_argument("--layouts", action="store_true", help="a Llama block's, in both layouts")
parser.add_argument("--width", type=int, default=4096)
parser.add_argument("--ffn", type=int, default=10944)
parser.add_argument("--kv", type=int, default=1024)
parser.add_argument("--workspaces", type=int, nargs="+", metavar="BYTES")
args = parser.parse_args()
cublaslt.WORKSPACE = args.lt_workspace
r, w, v = args.rows, 768, 50304
bf = torch.bfloat16


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=bf)


# name -> (a, b, weight gradient?): a [M K] and b [K N] in the traced step's layouts.
cases = {
    "forward x W (attention)": (rand(r, w), rand(w, w), False),
    "forward h W2 (mlp out)": (rand(r, 4 * w), rand(4 * w, w), False),
    "forward x wte^T (logits)": (rand(r, w), rand(v, w).t(), False),
    "dX dy W^T (attention)": (rand(r, w), rand(w, w).t(), False),
    "dX dy W2^T (mlp out)": (rand(r, w), rand(4 * w, w).t(), False),
    "dX dlogits wte": (rand(r, v), rand(v, w), False),
    "dW x^T dy (attention)": (rand(r, w).t(), rand(r, w), True),
    "dW x^T dy (mlp in)": (rand(r, w).t(), rand(r, 4 * w), True),
    "dW h^T dy (mlp out)": (rand(r, 4 * w).t(), rand(r, w), True),
}


def memsets(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in p.events() if e.name.startswith("Memset"))


def probe(name: str, a: torch.Tensor, b: torch.Tensor, weight: bool) -> None:
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    out = torch.zeros(a.shape[0], b.shape[1], device="cuda")

    def torch_mm():
        p = torch.mm(a, b)
        if weight:
            out.copy_(p)

    def lt():
        assert cublaslt.matmul(a, b, cublaslt.Epilogue.DEFAULT) is not None

    def into():
        torch.ops.sexpgpu.mm_into(a, b, out, False)

    row = []
    for fn in (torch_mm, lt, into):
        ms = do_bench(fn, warmup=25, rep=100)
        row.append(f"{ms * 1e3:7.1f}us m{memsets(fn)}")
    rate = flops / do_bench(lambda: torch.mm(a, b), warmup=25, rep=100) / 1e9
    print(f"{name:28s} {row[0]:>14s} {row[1]:>14s} {row[2]:>14s}  {rate:6.0f}")


def layouts() -> None:
    """Each product of a Llama block in sexpgpu's layout and in nn.Linear's, TFLOP/s each."""
    d, f = args.width, args.ffn
    print(f"{'product':22s} {'sexpgpu us':>11s} {'TF/s':>5s} {'Linear us':>11s} {'TF/s':>5s}")
    for name, (i, o) in {
        "q, o": (d, d),
        "k, v": (d, args.kv),
        "gate, up": (d, f),
        "down": (f, d),
    }.items():
        x, dy = rand(r, i), rand(r, o)
        ours, theirs = rand(i, o), rand(o, i)  # [in out] and Linear's [out in]
        grad = torch.zeros(i, o, device="cuda")
        grad_t = torch.zeros(o, i, device="cuda")
        flops = 2 * r * i * o
        pairs = {
            "forward": (lambda: torch.mm(x, ours), lambda: torch.mm(x, theirs.t())),
            "input gradient": (lambda: torch.mm(dy, ours.t()), lambda: torch.mm(dy, theirs)),
            "weight gradient": (
                lambda: torch.ops.sexpgpu.mm_into(x.t(), dy, grad, False),
                lambda: grad_t.copy_(torch.mm(dy.t(), x)),
            ),
        }
        for kind, (a, b) in pairs.items():
            ta, tb = do_bench(a, warmup=25, rep=100), do_bench(b, warmup=25, rep=100)
            print(f"{name + ' ' + kind:22s} {ta * 1e3:11.1f} {flops / ta / 1e9:5.0f} "
                  f"{tb * 1e3:11.1f} {flops / tb / 1e9:5.0f}")  # fmt: skip


def workspaces() -> None:
    """The weights' gradients by `mm_into` under each workspace size, microseconds."""
    shapes = [(768, 768), (768, 256), (768, 2048), (2048, 768), (768, 3072), (3072, 768)]
    inputs = {(i, o): (rand(r, i), rand(r, o)) for i, o in shapes}
    times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    for size in args.workspaces:
        cublaslt.WORKSPACE = size  # a fresh plan and workspace for each size
        cublaslt._plan.cache_clear()
        cublaslt._workspace.cache_clear()
        for (i, o), (x, dy) in inputs.items():
            grad = torch.zeros(i, o, device="cuda")
            fn = lambda x=x, dy=dy, grad=grad: torch.ops.sexpgpu.mm_into(x.t(), dy, grad, True)  # noqa: E731
            times[(i, o)].append(do_bench(fn, warmup=25, rep=100) * 1e3)
    sizes = "".join(f" {s >> 20:>5d} MiB" for s in args.workspaces)
    print(f"{'x^T dy, rows ' + str(r):22s}{sizes}  torch bf16 + cast")
    for (i, o), (x, dy) in inputs.items():
        grad = torch.zeros(i, o, device="cuda")
        peer = do_bench(
            lambda x=x, dy=dy, grad=grad: grad.add_(torch.mm(x.t(), dy)), warmup=25, rep=100
        )
        cells = "".join(f" {us:7.1f}us" for us in times[(i, o)])
        print(f"{f'{i} x {o}':22s}{cells}  {peer * 1e3:7.1f}us")


if args.workspaces:
    workspaces()
elif args.layouts:
    layouts()
else:
    print(f"{'product':28s} {'torch.mm':>14s} {'cuBLASLt':>14s} {'mm_into f32':>14s}  TFLOP/s (mm)")
    for name, (a, b, weight) in cases.items():
        probe(name, a, b, weight)
