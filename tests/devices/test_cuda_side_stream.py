"""The weight gradients' products on a side stream (`sexpgpu.devices.cuda.side_stream`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from sexpgpu.devices.cuda.side_stream import SIDE_PRODUCT, join, side_mm, to_side_stream  # noqa: E402


def _step(x, w, v):
    """A chain, and a product of the chain's value that only the outputs read, written last."""
    y = torch.tanh(x @ w)
    dy = y * 2
    z = torch.sin(dy @ v).sum()
    gw = (x.t() @ dy).to(torch.float32)
    return z, gw


def _inputs(device="cpu"):
    g = torch.Generator().manual_seed(0)
    shapes = [(32, 16), (16, 24), (24, 8)]
    return [torch.randn(s, generator=g).to(torch.bfloat16).to(device) for s in shapes]


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_a_product_only_the_outputs_read_moves_to_the_side_right_after_its_operands():
    inputs = _inputs()
    gm = make_fx(_step)(*inputs)
    moved, kept = to_side_stream(gm)
    assert moved == 1
    calls = _calls(gm)
    side = next(n for n in calls if n.target is SIDE_PRODUCT)
    chain = [n for n in calls if n.target is torch.ops.aten.mm.default]
    # The chain's first product stays; the one of dy comes after the side product now.
    assert [n.args[0].name for n in chain][-1] == side.args[1].name
    assert calls.index(side) < calls.index(chain[-1])
    assert side.args[2] is torch.float32
    # The cast went into the call; its operands are kept as outputs after the step's own.
    assert not [n for n in calls if n.target is torch.ops.aten._to_copy.default]
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert kept == 2 and list(outputs[2:]) == list(side.args[:2])
    got = gm(*inputs)[: len(outputs) - kept]
    want = _step(*inputs)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_product_the_step_reads_stays_where_it_is():
    def step(x, w):
        h = x @ w
        return (h * h).sum(), h.t() @ x

    x, w = _inputs()[:2]
    gm = make_fx(step)(x, w)
    assert to_side_stream(gm) == (1, 2)  # the last product only: the first feeds the step
    products = [n for n in _calls(gm) if n.target is torch.ops.aten.mm.default]
    assert [[a.name for a in p.args] for p in products] == [["x_1", "w_1"]]


@pytest.mark.gpu
def test_on_a_gpu_the_side_stream_computes_what_the_main_stream_would():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    device = torch.device("cuda")
    a = torch.randn(4096, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 2048, device=device, dtype=torch.bfloat16)
    want = torch.mm(a, b).float()
    outs = [side_mm(a.t().contiguous().t(), b, torch.float32) for _ in range(3)]
    del a  # the caller frees an operand: the held one stays until the join
    join(device)
    for out in outs:
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    # Captured in a CUDA graph: the side stream forks from the capture and joins it.
    a = torch.randn(4096, 8192, device=device, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = side_mm(a, b, torch.float32)
        join(device)
        out = out * 1.0  # read after the join
    a.normal_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.mm(a, b).float(), rtol=0, atol=0)
