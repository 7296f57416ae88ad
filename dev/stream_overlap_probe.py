"""Whether a second stream for the weight gradients' products shortens GPT-2's backward. GPU only.

The MLP half of GPT-2 small's backward (12 layers, batch 16 x 1024, bf16),
captured as a CUDA graph: serially, then with the weight-gradient products
and the bias sums on a side stream, beside the data gradients' chain; the
products there without any bias sums; each family alone; then Inductor's gelu
and layernorm backward kernels and a copy, against the fewest bytes they move.

    python3 dev/stream_overlap_probe.py

On an H200 (2026-12-01): serially 8.09 and 8.31 ms, both families on the side
stream 8.21 ms, the products there without the bias sums 7.35 ms against
7.55 ms for the two families alone back to back (benches/README.md).
"""

import torch
import triton.testing

N, D, H, L = 16384, 768, 3072, 12
dev = "cuda"
bf = torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)


def rnd(*shape):
    return torch.randn(*shape, device=dev, dtype=bf, generator=g) * 0.1


@torch.compile
def gelu_bwd(dh, pre):
    x = pre.float()
    c = 0.7978845608028654
    t = torch.tanh(c * (x + 0.044715 * x * x * x))
    d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    return (dh.float() * d).to(bf)


@torch.compile
def ln_bwd(x, dy, w, res):
    xf = x.float()
    mu = xf.mean(-1, keepdim=True)
    var = xf.var(-1, keepdim=True, unbiased=False)
    r = torch.rsqrt(var + 1e-5)
    xh = (xf - mu) * r
    g_ = dy.float() * w.float()
    dx = r * (g_ - g_.mean(-1, keepdim=True) - xh * (g_ * xh).mean(-1, keepdim=True))
    return (dx + res.float()).to(bf), (dy.float() * xh).sum(0), dy.float().sum(0)


layers = []
for _ in range(L):
    layers.append(
        dict(
            dy=rnd(N, D),
            W2=rnd(D, H),
            h=rnd(N, H),
            pre=rnd(N, H),
            W1=rnd(H, D),
            x2=rnd(N, D),
            w=rnd(D),
            dW2=torch.empty(D, H, device=dev, dtype=bf),
            dW1=torch.empty(H, D, device=dev, dtype=bf),
            db2=torch.empty(D, device=dev, dtype=torch.float32),
            db1=torch.empty(H, device=dev, dtype=torch.float32),
        )
    )
side = torch.cuda.Stream()
keep = []


def weight_gradient(grad, x, dw, db, where: str) -> None:
    """``dw = grad^T x`` and ``db = sum(grad)``: "main" both serially, "side" both on the
    side stream, "side, no bias" the product on the side stream and no bias sum."""
    if where == "main":
        torch.mm(grad.t(), x, out=dw)
        torch.sum(grad, 0, dtype=torch.float32, out=db)
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    side.wait_event(event)
    with torch.cuda.stream(side):
        torch.mm(grad.t(), x, out=dw)
        if where == "side":
            torch.sum(grad, 0, dtype=torch.float32, out=db)


def backward(where: str):
    keep.clear()
    for p in layers:
        dy = p["dy"]
        weight_gradient(dy, p["h"], p["dW2"], p["db2"], where)
        dh = dy @ p["W2"]
        dpre = gelu_bwd(dh, p["pre"])
        weight_gradient(dpre, p["x2"], p["dW1"], p["db1"], where)
        dx1 = dpre @ p["W1"]
        keep.append((dh, dpre, ln_bwd(p["x2"], dx1, p["w"], dy)))
    if where != "main":
        torch.cuda.current_stream().wait_stream(side)


def parts():
    """Each family alone, serial: the floor of an overlap is the larger of the two streams."""

    def chain():
        for p in layers:
            dh = p["dy"] @ p["W2"]
            dpre = gelu_bwd(dh, p["pre"])
            ln_bwd(p["x2"], dpre @ p["W1"], p["w"], p["dy"])

    def weights():
        for p in layers:
            torch.mm(p["dy"].t(), p["h"], out=p["dW2"])
            torch.mm(p["pre"].t(), p["x2"], out=p["dW1"])

    return chain, weights


def graphed(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=50, rep=400, return_mode="median")


results = {}
for name, fn in [
    ("serial", lambda: backward("main")),
    ("dW + bias sums on a side stream", lambda: backward("side")),
    ("dW on a side stream, no bias sums", lambda: backward("side, no bias")),
    ("serial again", lambda: backward("main")),
    ("chain alone", parts()[0]),
    ("dW products alone", parts()[1]),
]:
    results[name] = graphed(fn)
    print(f"{name:40s} {results[name]:8.3f} ms", flush=True)
# The overlapped graph must compute what the serial one does.
backward("main")
torch.cuda.synchronize()
ref = [p["dW1"].clone() for p in layers] + [p["db1"].clone() for p in layers]
backward("side")
torch.cuda.synchronize()
got = [p["dW1"] for p in layers] + [p["db1"] for p in layers]
print(
    "max difference overlapped vs serial",
    max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, got, strict=True)),
)

# Inductor's kernels alone, against the fewest bytes they must move (bf16 in and out).
p = layers[0]
dh = p["dy"] @ p["W2"]
t = triton.testing.do_bench(
    lambda: gelu_bwd(dh, p["pre"]), warmup=25, rep=200, return_mode="median"
)
print(f"gelu backward alone {t * 1e3:.1f} us, {3 * N * H * 2 / t / 1e9:.2f} TB/s")
t = triton.testing.do_bench(
    lambda: ln_bwd(p["x2"], p["dy"], p["w"], p["dy"]), warmup=25, rep=200, return_mode="median"
)
print(f"layernorm backward alone {t * 1e3:.1f} us, {4 * N * D * 2 / t / 1e9:.2f} TB/s")
big = torch.empty(2**30 // 2, device=dev, dtype=bf)
other = torch.empty_like(big)
t = triton.testing.do_bench(lambda: other.copy_(big), warmup=25, rep=200, return_mode="median")
print(f"copy {2 * 2**30 / t / 1e9:.2f} TB/s")
