"""Whether a step compiled ahead of time by Inductor (AOTInductor) loads without Inductor's Python.

    python3 dev/aoti_probe.py build DIR [CACHE]   # export and compile a step into DIR
    python3 dev/aoti_probe.py load DIR [CACHE]    # a fresh process: load it, run it (capture it)

Without CACHE the step is a small one with what sexpgpu's fused step has: a
bf16 product, gelu, a custom op, attention (SDPA), a sum written into an
input in place. With CACHE (a compile cache's folder, e.g.
``$XDG_CACHE_HOME/sexpgpu``) it is the first training step kept there, as a
run traced it (one graph; a step compiled in parts is refused), fed
random values of its inputs' shapes. `load` prints the seconds to load and
call it, whether Dynamo, Inductor or Triton were imported before and after,
the largest difference from running the graph op by op, and on a GPU
whether a CUDA graph of the loaded call replays to the same values.
"""

import sys
import time

began = time.perf_counter()

import torch  # noqa: E402

imported = time.perf_counter()

# Defined through `torch.library.Library`: an op of `torch.library.custom_op` imports
# Dynamo at its first call (its kernel is wrapped to keep Dynamo out of it).
_LIBRARY = torch.library.Library("probe", "DEF")
_LIBRARY.define("twice(Tensor x) -> Tensor")
_LIBRARY.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
_LIBRARY.impl("twice", lambda x: torch.empty_like(x), "Meta")


class Small(torch.nn.Module):
    def forward(self, x, w, q, k, v, total):
        h = torch.ops.probe.twice(torch.nn.functional.gelu(x @ w))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        loss = h.float().square().mean() + a.float().square().mean()
        total.add_(loss)
        return (loss, h)


class Cached(torch.nn.Module):
    def __init__(self, gm):
        super().__init__()
        self.gm = gm

    def forward(self, *args):
        return self.gm(*args)


def step(cache: str | None, device: str) -> tuple[torch.nn.Module, list]:
    """The module to compile and its inputs: the small step, or the cache's first step."""
    g = torch.Generator(device="cpu").manual_seed(0)
    if cache is None:
        make = lambda *s: torch.randn(*s, generator=g).to(device, torch.bfloat16)  # noqa: E731
        qkv = [make(4, 8, 256, 64) for _ in range(3)]
        return Small(), [make(512, 256), make(256, 256), *qkv, torch.zeros((), device=device)]
    from pathlib import Path

    # The custom ops a traced step may call, as the compile workers import them.
    import sexpgpu.devices.cuda.gelu_products
    import sexpgpu.devices.cuda.scatter_rows
    import sexpgpu.devices.cuda.sum_products
    import sexpgpu.devices.cuda.xent  # noqa: F401
    from sexpgpu.devices.cuda.compile_cache import StepCache
    from sexpgpu.devices.cuda.compile_worker import unpack_graph

    store = StepCache(Path(cache))
    entry = store.load(sorted((store.root / "steps").glob("*.step"))[0].stem)
    if entry["parent"] is not None:
        raise SystemExit("the cached step was compiled in parts; this probe takes one graph")
    ((packed, metadata),) = entry["graphs"]
    inputs = []
    for shape, stride, dtype in metadata:
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        t.copy_(torch.randn(shape, generator=g) * 0.02 if dtype.is_floating_point else 0)
        inputs.append(t)
    return Cached(unpack_graph(packed)), inputs


def main() -> None:
    what, folder = sys.argv[1], sys.argv[2]
    cache = sys.argv[3] if len(sys.argv) > 3 else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = f"{folder}/step.pt2"
    module, args = step(cache, device)
    if what == "build":
        start = time.perf_counter()
        ep = torch.export.export(module, tuple(args), strict=False)
        exported = time.perf_counter()
        torch._inductor.aoti_compile_and_package(ep, package_path=path)
        print(
            f"export {exported - start:.1f} s, AOTInductor {time.perf_counter() - exported:.1f} s"
        )
        return
    imports = lambda: ", ".join(  # noqa: E731
        f"{name} {name in sys.modules}" for name in ("torch._dynamo", "torch._inductor", "triton")
    )
    print(f"import torch {imported - began:.2f} s; imported before the load: {imports()}")
    start = time.perf_counter()
    loader = torch._C._aoti.AOTIModelPackageLoader(
        path, "model", True, 1, 0 if device == "cuda" else -1
    )
    loaded = time.perf_counter()
    want_args = [a.clone() for a in args]
    out = loader.run(args)
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter()
    print(f"load {loaded - start:.3f} s, first call {first - loaded:.3f} s; after: {imports()}")
    want = module(*want_args)
    want = list(want) if isinstance(want, list | tuple) else [want]
    differ = lambda xs, ys: max(  # noqa: E731
        (float((x.float() - y.float()).abs().max()) for x, y in zip(xs, ys, strict=True)
         if x.is_floating_point()), default=0.0,
    )  # fmt: skip
    written = differ(args, want_args)
    print(f"outputs: largest difference {differ(out, want):.3g}; inputs written: {written:.3g}")
    if device != "cuda":
        return
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            loader.run(args)  # a warm-up on the capture's stream
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                captured = loader.run(args)
        graph.replay()
        torch.cuda.synchronize()
        print(f"CUDA graph replayed: outputs' largest difference {differ(captured, want):.3g}")
    except Exception as error:
        print("capture failed:", type(error).__name__, error)


if __name__ == "__main__":
    main()
