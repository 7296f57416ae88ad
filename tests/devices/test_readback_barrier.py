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
    """The kernel that parted runs on an H200: a row stored in one loop, loaded in the next."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch._inductor.utils import run_and_get_code

    def step(x, w, g):
        m = x.mean(-1, keepdim=True)
        r = torch.rsqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-5)
        xh = (x - m) * r
        a = (g * w).sum(-1, keepdim=True)
        b = (g * w * xh).sum(-1, keepdim=True)
        return (g * w * x.shape[-1] - a - xh * b) * r / x.shape[-1], xh

    from torch.fx.experimental.proxy_tensor import make_fx

    x, g = (torch.randn(256, 8192, device="cuda") for _ in range(2))
    w = torch.randn(8192, device="cuda")
    gm = make_fx(step)(x, w, g)
    inputs = [(tuple(t.shape), t.stride(), t.dtype) for t in (x, w, g)]
    # Compiled afresh (no cache), so that its code is generated here and seen.
    compiled, code = run_and_get_code(
        compile_part, gm, inputs, "cuda", {"force_disable_caches": True}
    )
    got, want = compiled([x, w, g]), step(x, w, g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    source = "\n".join(code)
    assert "for r0_offset" in source  # a looped reduction
    assert "tl.debug_barrier()" in source
