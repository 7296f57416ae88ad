"""Cross-entropy and its gradient over GPT-2's logits on a GPU: sexpgpu's kernel, Inductor's.

    python3 dev/cross_entropy_bench.py [--rows 16384] [--vocab 50304]

Times (``triton.testing.do_bench``) the loss and gradient of bf16 ``[rows
vocab]`` logits: Inductor's kernel for the lowering's torch ops (what the
fused step ran before), sexpgpu's Triton kernel in each of its autotuner's
configurations, and the op as it runs (the autotuner's pick). The bandwidth
is against the least traffic: the logits read once and the gradient written once.
"""

import argparse

import torch
from triton.testing import do_bench

from sexpgpu.devices.cuda import cross_entropy as ce

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=16384)
parser.add_argument("--vocab", type=int, default=50304)
args = parser.parse_args()
logits = torch.randn(args.rows, args.vocab, device="cuda").to(torch.bfloat16)
ids = torch.randint(0, args.vocab, (args.rows,), device="cuda", dtype=torch.int32)
g = torch.full((args.rows,), 1.0 / args.rows, device="cuda")
least = 2 * logits.numel() * logits.element_size()


def report(name: str, fn) -> None:
    ms = do_bench(fn, warmup=25, rep=200)
    print(f"{name:40s} {ms:7.3f} ms  {least / ms / 1e6:7.0f} GB/s", flush=True)


inductor = torch.compile(lambda x, i, g: ce.rows_in_torch(x, i, g, torch.bfloat16))
report("Inductor (the lowering's torch ops)", lambda: inductor(logits, ids, g))
want = ce.rows_in_torch(logits, ids, g, torch.bfloat16)
kernel = ce._kernel().fn  # the jitted kernel under the autotuner
sms = torch.cuda.get_device_properties(0).multi_processor_count
losses = torch.empty(args.rows, device="cuda")
grads = torch.empty_like(logits)
for block, warps, per_sm in ce._CONFIGS:
    grid = (min(args.rows, per_sm * sms),)
    launch = (logits, ids, g, losses, grads, args.rows, args.vocab, args.vocab)

    def run(grid=grid, launch=launch, block=block, warps=warps, per_sm=per_sm):
        kernel[grid](*launch, BLOCK=block, PER_SM=per_sm, num_warps=warps)

    report(f"sexpgpu block {block} warps {warps} per SM {per_sm}", run)
report("sexpgpu, the autotuner's pick", lambda: ce.cross_entropy_rows(logits, ids, g, logits.dtype))
got = ce.cross_entropy_rows(logits, ids, g, torch.bfloat16)
print(
    "largest differences from torch: loss",
    float((got[0] - want[0]).abs().max()),
    "gradient",
    float((got[1].float() - want[1].float()).abs().max()),
)
