"""A linear layer's gelu inside its products (cuBLASLt's epilogues) against the kernels apart.

    python3 dev/gelu_epilogue_probe.py [--rows 16384]

GPT-2 small's MLP at batch 16 (bf16 ``[16384 768] @ [768 3072]``), on one
GPU, `triton.testing.do_bench`: the forward (the product with its bias, then
gelu; against ``sexpgpu::linear_gelu``) and the gradient's half that reads
gelu (the product ``dy w2^T``, gelu's derivative; against
``sexpgpu::gelu_grad_mm``; apart, Inductor also sums the bias's gradient in
the same pass, which the op leaves to a sum of its own). "apart" runs the same calls PyTorch
would, each compiled by Inductor where it is elementwise.
"""

import argparse

import torch
from triton.testing import do_bench

from sexpgpu.devices.cuda import gelu_products  # noqa: F401  (registers the ops)

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=16384)
args = parser.parse_args()
m, k, n = args.rows, 768, 3072
bf = torch.bfloat16
x = torch.randn(m, k, device="cuda", dtype=bf)
w = torch.randn(k, n, device="cuda", dtype=bf) / k**0.5
b = torch.randn(n, device="cuda", dtype=bf)
dy = torch.randn(m, k, device="cuda", dtype=bf)
w2 = torch.randn(n, k, device="cuda", dtype=bf) / n**0.5  # the next layer's [3072 768]
h = torch.addmm(b, x, w)

gelu = torch.compile(lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
grad_and_sum = torch.compile(
    lambda g, h: (d := torch.ops.aten.gelu_backward(g, h, approximate="tanh"), d.sum(0))
)
cases = {
    "forward: addmm alone": lambda: torch.addmm(b, x, w),
    "forward: addmm, then gelu (Inductor)": lambda: gelu(torch.addmm(b, x, w)),
    "forward: linear_gelu (cuBLASLt GELU_AUX_BIAS)": lambda: torch.ops.sexpgpu.linear_gelu(x, w, b),
    "backward: mm alone": lambda: dy @ w2.t(),
    "backward: mm, then gelu grad and bias sum (Inductor)": lambda: grad_and_sum(dy @ w2.t(), h),
    "backward: gelu_grad_mm (cuBLASLt DGELU)": lambda: torch.ops.sexpgpu.gelu_grad_mm(
        dy, w2.t(), h
    ),
}
for name, fn in cases.items():
    fn()
    print(f"{name:58s} {do_bench(fn, warmup=50, rep=300):7.3f} ms")
