"""A product written into a sum buffer (`sexpgpu.devices.cuda.sum_products`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sexpgpu.devices.cuda import cublaslt, sum_products  # noqa: E402,F401  (registers the op)

gpu = pytest.mark.gpu


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    return torch.device("cuda")


@pytest.mark.parametrize("accumulate", [False, True], ids=["writes", "adds"])
def test_off_a_gpu_the_op_is_the_traced_calls(accumulate):
    a, b = torch.randn(16, 8).bfloat16(), torch.randn(8, 12).bfloat16()
    out = torch.full((16, 12), 2.0)
    torch.ops.sexpgpu.mm_into(a, b, out, accumulate)
    want = (a @ b).float() + (2.0 if accumulate else 0.0)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("accumulate", [False, True], ids=["writes", "adds"])
@pytest.mark.parametrize("shape", [(768, 16384, 768), (768, 16384, 3072), (3072, 16384, 768)])
def test_cublaslt_writes_the_f32_sums_of_bf16_operands(cuda, accumulate, shape):
    # A weight gradient's shapes at GPT-2 small's: x^T [M K], read transposed, dy [K N].
    m, k, n = shape
    x = torch.randn(k, m, device=cuda).bfloat16()
    dy = torch.randn(k, n, device=cuda).bfloat16()
    before = torch.randn(m, n, device=cuda)
    out = before.clone()
    done = cublaslt.matmul(x.t(), dy, cublaslt.Epilogue.DEFAULT, out=out, accumulate=accumulate)
    assert done is out
    want = x.t().double() @ dy.double() + (before.double() if accumulate else 0.0)
    # The f32 sums, not rounded to bf16: the values' scale is sqrt(k), and a
    # rounding to bf16 would miss it by up to 2**-9 of each value.
    torch.testing.assert_close(out.double(), want, rtol=0, atol=k**0.5 * 2**-12)


@gpu
def test_a_cuda_graph_replays_the_op(cuda):
    a = torch.randn(1024, 256, device=cuda).bfloat16()
    b = torch.randn(1024, 128, device=cuda).bfloat16()
    out = torch.zeros(256, 128, device=cuda)
    torch.ops.sexpgpu.mm_into(a.t(), b, out, True)  # warms the plan up
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        torch.ops.sexpgpu.mm_into(a.t(), b, out, True)
    once = out.clone()
    a.mul_(0.5)  # the replay reads the operands anew and adds to what the buffer holds
    graph.replay()
    want = once.double() + a.t().double() @ b.double()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-2)
