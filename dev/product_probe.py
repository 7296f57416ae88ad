"""GPT-2 small's products at batch 16: PyTorch's ``mm`` against cuBLASLt as sexpgpu calls it.

    python3 dev/product_probe.py [--rows 16384] [--lt-workspace BYTES]

For each product of a training step (forward, the inputs' gradients, the
weights' gradients; bf16, the operands laid out as the traced step has
them), `triton.testing.do_bench` of: ``torch.mm`` (then, for a weight
gradient, its cast into an f32 buffer, as the step did before
`products_into_sums`); `cublaslt.matmul` without an epilogue (its
reduction schemes limited as `sexpgpu.devices.cuda.cublaslt` sets them);
and ``sexpgpu::mm_into`` writing f32. Also how many memsets one call of
each launches (torch.profiler), since a CUDA graph replays each as a node
of its own. `--lt-workspace` sets the workspace sexpgpu's cuBLASLt calls
offer (PyTorch's own is set by ``CUBLAS_WORKSPACE_CONFIG`` and
``CUBLASLT_WORKSPACE_SIZE``).
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from sexpgpu.devices.cuda import cublaslt, sum_products  # noqa: F401  (registers the op)

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=16384)
parser.add_argument("--lt-workspace", type=int, default=cublaslt.WORKSPACE)
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


print(f"{'product':28s} {'torch.mm':>14s} {'cuBLASLt':>14s} {'mm_into f32':>14s}  TFLOP/s (mm)")
for name, (a, b, weight) in cases.items():
    probe(name, a, b, weight)
