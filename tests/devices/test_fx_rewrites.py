"""Rewrites of the traced aten step (`sexpgpu.devices.cuda.fx_rewrites`)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from sexpgpu.devices.cuda.fx_rewrites import (
    bias_adds_onto_products,
    gelu_into_products,
    param_casts_to_inputs,
    products_into_sums,
)

aten = torch.ops.aten


def _traced(fn, *args):
    gm = make_fx(fn)(*args)
    return gm, fn(*args)


def _adds(gm):
    return [n for n in gm.graph.nodes if n.target is aten.add.Tensor]


@pytest.mark.parametrize("bias_first", [False, True])
@pytest.mark.parametrize("bias_shape", [(6,), (1,), ()])
def test_a_bias_after_a_folded_product_is_added_to_the_product(bias_first, bias_shape):
    a, w, bias = torch.randn(2, 8, 4), torch.randn(4, 6), torch.randn(bias_shape)

    def linear_gelu(a, w, bias):
        y = torch.matmul(a, w)  # traces as view, mm, view back
        return torch.nn.functional.gelu(bias + y if bias_first else y + bias)

    gm, want = _traced(linear_gelu, a, w, bias)
    assert bias_adds_onto_products(gm) == 1
    (add,) = _adds(gm)
    assert add.args[bias_first].target is aten.mm.default  # on the product, in its order
    torch.testing.assert_close(gm(a, w, bias), want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "other", [torch.randn(2, 8, 6), torch.randn(8, 6), torch.randn(6, dtype=torch.float64)]
)
def test_an_add_that_is_no_bias_of_the_product_stays(other):
    # A residual, a value that broadcasts over more than the last axis, another dtype.
    a, w = torch.randn(2, 8, 4), torch.randn(4, 6)
    gm, want = _traced(lambda a, w, o: torch.matmul(a, w) + o, a, w, other)
    assert bias_adds_onto_products(gm) == 0
    torch.testing.assert_close(gm(a, w, other), want)


def test_a_view_with_another_use_stays():
    a, w, bias = torch.randn(2, 8, 4), torch.randn(4, 6), torch.randn(6)

    def both(a, w, bias):
        y = torch.matmul(a, w)
        return y + bias, y * 2

    gm, _ = _traced(both, a, w, bias)
    assert bias_adds_onto_products(gm) == 0


def test_the_moved_add_keeps_the_ir_nodes_name():
    a, w, bias = torch.randn(2, 8, 4), torch.randn(4, 6), torch.randn(6)
    gm, _ = _traced(lambda a, w, bias: torch.matmul(a, w) + bias, a, w, bias)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node._rename(f"ir7__{node.name}")
    bias_adds_onto_products(gm)
    assert all(n.name.startswith("ir7__") for n in gm.graph.nodes if n.op == "call_function")


def _layer(approximate="tanh"):
    """A linear layer with gelu, the next product, and the backward's half that reads gelu."""

    def layer(x, w1, b1, w2, dy):
        h = torch.matmul(x, w1) + b1
        out = torch.matmul(torch.nn.functional.gelu(h, approximate=approximate), w2)
        dh = aten.gelu_backward(torch.matmul(dy, w2.t()), h, approximate=approximate)
        return out, dh.sum([0, 1]), torch.matmul(dh, w1.t())

    args = torch.randn(2, 8, 4), torch.randn(4, 6), torch.randn(6), torch.randn(6, 5)
    return layer, (*args, torch.randn(2, 8, 5))


def _targets(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def test_gelu_and_its_gradient_go_into_the_products():
    layer, args = _layer()
    gm, want = _traced(layer, *args)
    bias_adds_onto_products(gm)
    assert gelu_into_products(gm) == (1, 1)
    targets = _targets(gm)
    ops = torch.ops.sexpgpu
    assert {ops.linear_gelu.default, ops.gelu_grad_mm.default} <= targets
    assert not {aten.gelu.default, aten.gelu_backward.default} & targets  # inside the ops now
    for got, expected in zip(gm(*args), want, strict=True):
        torch.testing.assert_close(got, expected)


def test_a_stacked_layers_gelu_under_two_views_goes_into_the_products():
    # A stacked graph views each product as [k*m p] -> [k m p] -> [s k/s m p].
    x, w1, b1, w2 = torch.randn(4, 8, 4), torch.randn(4, 6), torch.randn(6), torch.randn(6, 5)
    dy = torch.randn(4, 8, 5)

    def layer(x, w1, b1, w2, dy):
        h = (torch.matmul(x, w1) + b1).view(2, 2, 8, 6)
        out = torch.matmul(torch.nn.functional.gelu(h, approximate="tanh"), w2)
        dh = aten.gelu_backward(torch.matmul(dy, w2.t()).view(2, 2, 8, 6), h, approximate="tanh")
        return out, dh.sum([0, 1, 2])

    gm, want = _traced(layer, x, w1, b1, w2, dy)
    bias_adds_onto_products(gm)
    assert gelu_into_products(gm) == (1, 1)
    assert not {aten.gelu.default, aten.gelu_backward.default} & _targets(gm)
    for got, expected in zip(gm(x, w1, b1, w2, dy), want, strict=True):
        torch.testing.assert_close(got, expected)


def test_the_backward_may_stay_apart():
    layer, args = _layer()
    gm, _ = _traced(layer, *args)
    bias_adds_onto_products(gm)
    assert gelu_into_products(gm, backward=False) == (1, 0)
    assert aten.gelu_backward.default in _targets(gm)


def test_the_exact_gelu_stays():
    layer, args = _layer(approximate="none")  # cuBLASLt's epilogue is the tanh form only
    gm, _ = _traced(layer, *args)
    bias_adds_onto_products(gm)
    assert gelu_into_products(gm) == (0, 0)


def test_the_new_calls_keep_the_ir_nodes_names():
    layer, args = _layer()
    gm, _ = _traced(layer, *args)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node._rename(f"ir7__{node.name}")
    bias_adds_onto_products(gm)
    gelu_into_products(gm)
    assert all(n.name.startswith("ir7__") for n in gm.graph.nodes if n.op == "call_function")


def test_a_parameters_bf16_casts_read_one_new_input():
    x, w, b, g = torch.randn(8, 4), torch.randn(4, 6), torch.randn(6), torch.randn(6)

    def step(x, w, b, g):
        # w: cast twice (forward and backward read it); b: cast once and read in f32;
        # g: cast to f64, no copy of it; x is no parameter.
        low = x.to(torch.bfloat16)
        y = low @ w.to(torch.bfloat16) + b.to(torch.bfloat16)
        back = y @ w.to(torch.bfloat16).t()
        return back.float() + b.sum(), g.to(torch.float64)

    gm, want = _traced(step, x, w, b, g)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert param_casts_to_inputs(gm, placeholders[1:]) == [0, 1]  # w and b, not g
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert names[4:] == [f"{placeholders[1].name}_bf16", f"{placeholders[2].name}_bf16"]
    casts = [n.args[0] for n in gm.graph.nodes if n.target is aten._to_copy.default]
    assert [c for c in casts if c.op == "placeholder"] == [placeholders[0], placeholders[3]]
    got = gm(x, w, b, g, w.to(torch.bfloat16), b.to(torch.bfloat16))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _into_calls(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.sexpgpu.mm_into.default]


@pytest.mark.parametrize("adds", [False, True], ids=["writes", "adds"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_product_written_into_a_buffer_is_made_there(adds, dtype):
    x, dy = torch.randn(32, 8).to(dtype), torch.randn(32, 6).to(dtype)

    def step(buffer, x, dy):
        grad = (x.t() @ dy).float()  # a weight's gradient, cast for its f32 sum
        buffer.add_(grad) if adds else buffer.copy_(grad)
        return (dy.sum(),)

    gm = make_fx(step)(torch.zeros(8, 6), x, dy)
    assert products_into_sums(gm) == 1
    (into,) = _into_calls(gm)
    assert into.args[3] is adds and into.name.startswith("mm")  # the product's name
    assert not [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.copy_.default)]
    want, got = torch.full((8, 6), 3.0), torch.full((8, 6), 3.0)
    step(want, x, dy)
    gm(got, x, dy)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # off a GPU: the traced calls


def test_products_read_elsewhere_or_written_elsewhere_stay():
    x, dy = torch.randn(32, 8), torch.randn(32, 6)

    def step(a, b, c, x, dy):
        p = x.t() @ dy
        a.copy_(p)  # the product has a second reader
        b.copy_((x.t() @ dy) * 2)  # the write is of something else
        c.copy_((dy.t() @ x).t())  # in another layout than the buffer's
        return (p.sum(),)

    gm = make_fx(step)(torch.zeros(8, 6), torch.zeros(8, 6), torch.zeros(8, 6), x, dy)
    assert products_into_sums(gm) == 0
