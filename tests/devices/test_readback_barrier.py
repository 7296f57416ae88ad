"""Inductor's kernels load what they stored only after a barrier (`readback_barrier`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sexpgpu.devices.cuda import readback_barrier  # noqa: E402
from sexpgpu.devices.cuda.compile_worker import compile_part  # noqa: E402


def test_the_salt_names_the_barrier_s_version_in_inductor_s_key():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    salt = readback_barrier.options()["post_grad_custom_post_pass"]
    assert isinstance(salt, CustomGraphPass)
    assert salt.uuid() == f"sexpgpu-readback-barrier-{readback_barrier.VERSION}"
    graph = torch.fx.Graph()
    assert salt(graph) is None and not list(graph.nodes)  # the pass changes nothing


def test_install_patches_once_and_keeps_inductor_s_loads_and_stores():
    from torch._inductor.codegen.triton import TritonKernel

    readback_barrier.install()
    load, store = TritonKernel.load, TritonKernel.store
    readback_barrier.install()
    assert (TritonKernel.load, TritonKernel.store) == (load, store)
    assert load.readback_barrier


def test_a_load_after_a_store_of_its_buffer_waits_at_a_barrier(monkeypatch):
    from torch._inductor.codegen import triton as codegen
    from torch._inductor.codegen.triton import TritonKernel

    class Lines(list):
        writeline = list.append

    calls = []
    monkeypatch.setattr(TritonKernel, "load", lambda self, name, index: calls.append(name))
    monkeypatch.setattr(TritonKernel, "store", lambda self, name, *a, **k: calls.append(name))
    monkeypatch.setattr(readback_barrier, "_real", lambda name: name)
    readback_barrier.install()
    kernel = object.__new__(TritonKernel)
    kernel.loads = Lines()
    kernel.load("in", 0)
    kernel.store("xhat", 0, "tmp")
    assert kernel.loads == []  # nothing stored yet that is read
    kernel.load("other", 0)
    assert kernel.loads == []
    kernel.load("xhat", 0)  # read back: after every thread's store
    assert kernel.loads == ["tl.debug_barrier()"]
    assert calls == ["in", "xhat", "other", "xhat"]
    assert codegen.TritonKernel is TritonKernel


@pytest.mark.gpu
def test_a_looped_layernorm_backward_reads_back_after_a_barrier_on_a_gpu():
    """The kernel that parted runs on an H200: a row stored in one loop, loaded in a later one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    code = _compiled_layernorm_backward("cuda")
    readbacks = _readbacks(code)
    assert readbacks  # the kernel shape this guards against was generated
    assert all(barrier for _, barrier in readbacks), readbacks


def test_the_layernorm_backward_compiles_and_sums_alike_on_the_cpu():
    """The GPU test's graph, compiled as the step's parts are: the same values as eager."""
    _compiled_layernorm_backward("cpu")


def _compiled_layernorm_backward(device: str) -> str:
    """Inductor's code for a layer norm's backward with its statistics recomputed (checked)."""
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, w, g):
        m = x.mean(-1, keepdim=True)
        r = torch.rsqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-5)
        xh = (x - m) * r
        a = (g * w).sum(-1, keepdim=True)
        b = (g * w * xh).sum(-1, keepdim=True)
        return (g * w * x.shape[-1] - a - xh * b) * r / x.shape[-1], xh

    # Rows enough that no reduction is split, a row too long for one pass (a looped kernel).
    x, g = (torch.randn(2048, 2048, device=device) for _ in range(2))
    w = torch.randn(2048, device=device)
    gm = make_fx(step)(x, w, g)
    inputs = [(tuple(t.shape), t.stride(), t.dtype) for t in (x, w, g)]
    # Compiled afresh (no cache), so that its code is generated here and seen.
    compiled, code = run_and_get_code(
        compile_part, gm, inputs, device, {"force_disable_caches": True}
    )
    for got, want in zip(compiled(x, w, g), step(x, w, g), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return "\n".join(code)


def _readbacks(code: str) -> list[tuple[str, bool]]:
    """Each load of a buffer its kernel stored before, and whether a barrier came between."""
    found, stored, barrier = [], set(), False
    for line in code.splitlines():
        line = line.strip()
        if line.startswith("def triton_"):
            stored, barrier = set(), False
        elif line == "tl.debug_barrier()":
            barrier = True
        elif "tl.store(" in line:
            stored.add(line.split("tl.store(")[1].split(" ")[0])
            barrier = False
        elif "tl.load(" in line:
            name = line.split("tl.load(")[1].split(" ")[0]
            if name in stored:
                found.append((name, barrier))
    return found


def test_readbacks_are_found_with_their_barriers():
    kernel = """
    def triton_red_fused_0(in_ptr0, out_ptr0):
        tmp0 = tl.load(in_ptr0 + (x0), xmask)
        tl.store(out_ptr0 + (x0), tmp0, xmask)
        tmp1 = tl.load(out_ptr0 + (x0), xmask)
        tl.debug_barrier()
        tmp2 = tl.load(out_ptr0 + (x0), xmask)
    def triton_per_fused_1(in_ptr0, out_ptr0):
        tmp3 = tl.load(out_ptr0 + (x0), xmask)
    """
    assert _readbacks(kernel) == [("out_ptr0", False), ("out_ptr0", True)]
