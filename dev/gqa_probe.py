"""Grouped-query attention's two costs at TinyLlama's shape, each alone on the GPU.

    python3 dev/gqa_probe.py

1. The key/value gradients summed over their group (``[B H S D] -> [B K S D]``):
   as ``reshape`` then ``sum`` (a reduction over a short outer axis) and as adds
   of slices in f32 rounded once (what the cuda lowering writes since,
   `SHORT_SUM`), each under torch.compile, in both storages of the gradient.
2. cuDNN's and flash attention, forward and backward, with the key/value heads
   repeated before the call (as the IR's `attention` does) and as they are
   (``enable_gqa=True``).
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

B, H, K, S, D = 8, 32, 4, 2048, 64
G = H // K


def grouped(x, heads_outer: bool):
    """`x` as [B K G S D] (heads outer) or [B S K G D], and the group's axis."""
    if heads_outer:
        return x.reshape(B, K, G, S, D), 2
    return x.transpose(1, 2).reshape(B, S, K, G, D), 3


def reduction(x, heads_outer=True):
    y, axis = grouped(x, heads_outer)
    return y.sum(axis)


def adds(x, heads_outer=True):
    y, axis = grouped(x, heads_outer)
    total = y.select(axis, 0).float()
    for i in range(1, G):
        total = total + y.select(axis, i).float()
    return total.to(x.dtype)


def main() -> None:
    print(torch.cuda.get_device_name())
    outer = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    inner = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    for storage, x, heads_outer in [("[B H S D]", outer, True), ("[B S H D]", inner, False)]:
        for name, fn in [("reduction", reduction), ("adds", adds)]:
            compiled = torch.compile(lambda x, fn=fn, h=heads_outer: fn(x, h))
            got = compiled(x)
            torch.testing.assert_close(got.float(), reduction(x, heads_outer).float(), atol=0.05, rtol=0.02)
            ms = do_bench(lambda c=compiled, x=x: c(x))
            moved = (x.numel() + got.numel()) * 2
            print(f"group sum {storage}, {name}: {ms * 1e3:.1f} us, {moved / ms / 1e9:.2f} TB/s")
    print(f"a copy of the gradient: {do_bench(lambda: outer.clone()) * 1e3:.1f} us")

    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, K, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    g = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    for backend in [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]:
        for native in [True, False]:

            def forward(native=native):
                if native:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                wide = (t.repeat_interleave(G, 1) for t in (k, v))
                return F.scaled_dot_product_attention(q, *wide, is_causal=True)

            def both(forward=forward):
                torch.autograd.grad(forward(), (q, k, v), g)

            how = "as they are" if native else "repeated"
            try:
                with sdpa_kernel([backend]):
                    both()
                    print(f"{backend.name}, heads {how}: forward {do_bench(forward) * 1e3:.0f} us, "
                          f"with the backward {do_bench(both) * 1e3:.0f} us")
            except RuntimeError as error:
                print(f"{backend.name}, heads {how}: refused ({str(error).splitlines()[0][:160]})")


if __name__ == "__main__":
    main()
