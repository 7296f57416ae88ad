"""A linear layer's gelu in its products (`sexpgpu.devices.cuda.gelu_products`).

cuBLASLt's epilogues (`sexpgpu.devices.cuda.cublaslt`) against the same
arithmetic in torch calls, on a GPU (``-m gpu``); on the CPU the ops are
those calls (the fused path's tests there, and
`tests/devices/test_fx_rewrites.py`), and the layouts handed to cuBLASLt
are checked here.
"""

from __future__ import annotations

import pytest
import torch

from sexpgpu.devices.cuda import cublaslt, gelu_products  # noqa: F401  (registers the ops)


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")(test))


# bf16: the epilogue rounds once where the calls round the product first.
# f32: the products' sums in another order.
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
SHAPES = [(256, 64, 192), (1000, 96, 384), (64, 40, 100)]


def each_case(test):
    """`test` on the GPU for each dtype, weight layout and shape."""
    for name, values, ids in (
        ("shape", SHAPES, str),
        ("transposed", [False, True], ["w", "w^T"]),
        ("dtype", [torch.float32, torch.bfloat16], str),
    ):
        test = pytest.mark.parametrize(name, values, ids=ids)(test)
    return gpu(test)


def _operands(m, k, n, dtype, transposed):
    gen = torch.Generator("cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = torch.randn(n, k, device="cuda", generator=gen).to(dtype) / k**0.5
    w = w.t() if transposed else w.t().contiguous()
    b = torch.randn(n, device="cuda", generator=gen).to(dtype)
    return x, w, b


@each_case
def test_linear_gelu_equals_the_calls(dtype, transposed, shape):
    x, w, b = _operands(*shape, dtype, transposed)
    g, h = torch.ops.sexpgpu.linear_gelu(x, w, b)
    h_want = torch.addmm(b.float(), x.float(), w.float())
    g_want = torch.nn.functional.gelu(h_want, approximate="tanh")
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(h.float(), h_want, rtol=rtol, atol=atol)
    torch.testing.assert_close(g.float(), g_want, rtol=rtol, atol=atol)


@each_case
def test_gelu_grad_mm_equals_the_calls(dtype, transposed, shape):
    dy, w, _ = _operands(*shape, dtype, transposed)
    h = torch.randn(shape[0], shape[2], device="cuda").to(dtype)
    dh = torch.ops.sexpgpu.gelu_grad_mm(dy, w, h)
    dh_want = torch.ops.aten.gelu_backward(dy.float() @ w.float(), h.float(), approximate="tanh")
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(dh.float(), dh_want, rtol=rtol, atol=atol)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cublaslt_runs_the_epilogues_at_gpt2s_shapes(dtype):
    # Where it would not, the ops fall back to the calls and the speed is lost silently.
    x, w, b = _operands(2048, 768, 3072, dtype, False)
    h = torch.empty(2048, 3072, dtype=dtype, device="cuda")
    assert cublaslt.matmul(x, w, cublaslt.Epilogue.GELU_AUX_BIAS, bias=b, aux=h) is not None
    dy, w2, _ = _operands(2048, 768, 3072, dtype, True)
    assert cublaslt.matmul(dy, w2, cublaslt.Epilogue.DGELU, aux=h) is not None


@gpu
def test_a_cuda_graph_replays_the_epilogues():
    x, w, b = _operands(512, 128, 256, torch.bfloat16, False)

    def both():
        g, h = torch.ops.sexpgpu.linear_gelu(x, w, b)
        return g, h, torch.ops.sexpgpu.gelu_grad_mm(x, w, h)

    before = both()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = both()
    x.mul_(0.5)  # the replay reads the operands anew
    graph.replay()
    for got, want in zip(captured, both(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(captured[0], before[0])


def test_row_major_operands_as_cublaslts_column_major_layouts():
    w = torch.empty(768, 3072)
    assert cublaslt._operand(w) == (0, 3072, 768, 3072)  # rows contiguous: as it is
    assert cublaslt._operand(w.t()) == (1, 3072, 768, 3072)  # its transpose: transposed
    assert cublaslt._operand(w[:, :1024]) == (0, 1024, 768, 3072)  # rows apart: the ld
    assert cublaslt._operand(torch.empty(4, 6, 2)[:, :, 0]) is None  # neither: computed apart


def test_the_ops_off_a_gpu_are_the_calls():
    x, w, b = torch.randn(16, 8), torch.randn(8, 12), torch.randn(12)
    g, h = torch.ops.sexpgpu.linear_gelu(x, w, b)
    torch.testing.assert_close(h, torch.addmm(b, x, w), rtol=0, atol=0)
    torch.testing.assert_close(g, torch.nn.functional.gelu(h, approximate="tanh"), rtol=0, atol=0)
    dy, w2 = torch.randn(16, 5), torch.randn(5, 12)
    want = torch.ops.aten.gelu_backward(dy @ w2, h, approximate="tanh")
    got = torch.ops.sexpgpu.gelu_grad_mm(dy, w2, h)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not cublaslt.available(torch.device("cpu"))
