"""Time the cross-entropy kernel (`sexpgpu.devices.cuda.xent`) over its settings, on a GPU.

    python3 dev/xent_sweep.py [--rows 16384] [--vocab 50304]

GPT-2 small's head at batch 16: bf16 logits ``[16384 50304]``, a mean's
weights. For each BLOCK and warps it prints the kernel's time; the peer is the
arithmetic the executor ran before, loss and gradient as two functions
compiled by Inductor (its log-sum-exp reduction, then the gradient's pass).
The TB/s count one read and one write of the logits, the least traffic.
"""

import argparse

import torch
from triton.testing import do_bench

from sexpgpu.devices.cuda import xent

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=16384)
parser.add_argument("--vocab", type=int, default=50304)
args = parser.parse_args()
rows, vocab = args.rows, args.vocab
logits = (torch.randn(rows, vocab, device="cuda") * 3).to(torch.bfloat16)
ids = torch.randint(0, vocab, (rows,), device="cuda", dtype=torch.int32)
g = torch.full((1,), 1 / rows, device="cuda").expand(rows)
loss = torch.empty(rows, device="cuda")
grad = torch.empty_like(logits)
moved = 2 * logits.numel() * logits.element_size()


def forward(x, t):
    flat = x.float()
    lse = torch.logsumexp(flat, dim=-1)
    return lse - flat.gather(1, t.long()[:, None])[:, 0], lse


def backward(x, t, w, lse):
    p = (x.float() - lse[:, None]).exp()
    p = p - (torch.arange(x.shape[1], device=x.device) == t.long()[:, None]).float()
    return (p * w[:, None]).to(x.dtype)


fwd, bwd = torch.compile(forward), torch.compile(backward)


def peer():
    _, lse = fwd(logits, ids)
    return bwd(logits, ids, g, lse)


want = xent._in_torch(logits, ids, g, torch.bfloat16)
ms = do_bench(peer, warmup=25, rep=200)
print(f"peer (Inductor, loss then gradient): {ms:.3f} ms")
times = []
for block in (1024, 2048, 4096, 8192, 16384):
    for warps in (4, 8, 16):
        xent.BLOCK, xent.WARPS = block, warps
        xent.launch(logits, ids, g, loss, grad)
        torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(grad.float(), want[1].float(), rtol=8e-3, atol=1e-6)
        t = do_bench(lambda: xent.launch(logits, ids, g, loss, grad), warmup=25, rep=100)
        times.append((t, block, warps))
        print(f"BLOCK {block:5d} warps {warps:2d}: {t:.3f} ms, {moved / t / 1e9:.2f} TB/s")
for t, block, warps in sorted(times)[:3]:
    print(f"best: BLOCK {block} warps {warps}: {t:.3f} ms ({ms / t:.2f}x the peer)")
