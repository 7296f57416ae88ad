"""Sibling products made one (`sexpgpu.ir.siblings`): what joins, and that it computes the same."""

import numpy as np
import pytest

from sexpgpu.devices.cpu import CpuProgram
from sexpgpu.ir import builder as b
from sexpgpu.ir.autodiff import training_graph
from sexpgpu.ir.compile import matmul_flops
from sexpgpu.ir.node import Graph
from sexpgpu.ir.ops import Op
from sexpgpu.ir.siblings import merge_siblings


def _forward(dtype="f32"):
    """x times four weights, the last read again by the backward (as attention's values);
    and x times an activation."""
    x = b.input("x", (6, 4), "f32")
    ws = [b.param(f"w{i}", (4, n), "f32") for i, n in enumerate((3, 5, 2, 3))]
    h = b.cast(x, dtype)
    ys = [b.matmul(h, b.cast(w, dtype) if dtype != "f32" else w) for w in ws]
    other = b.matmul(h, b.transpose(h))  # activations: not joined
    total = b.sum(b.cast(other, "f32"))
    for y in ys[:3]:  # their gradients read the exps, not the products
        total = b.add(total, b.sum(b.cast(b.exp(b.mul(y, b.constant(0.1, dtype))), "f32")))
    # the last is a product's operand, whose backward reads it as it is
    return Graph.of(
        {"loss": b.add(total, b.sum(b.cast(b.matmul(b.transpose(ys[3]), ys[0]), "f32")))}, [x, *ws]
    )


def _run(graph, seed=0):
    rng = np.random.default_rng(seed)
    leaves = {**graph.inputs, **graph.params}  # by name: a rewrite may list them in another order
    feeds = {k: rng.standard_normal(leaves[k].shape).astype(np.float32) for k in sorted(leaves)}
    return CpuProgram(graph)(feeds)


def _wide(graph):
    return sorted(
        n.shape[-1] for n in graph.nodes() if n.op is Op.MATMUL and n.inputs[1].op is Op.CONCAT
    )


def test_products_of_one_input_by_weights_become_one():
    graph = _forward()
    merged = merge_siblings(graph)  # no backward: all four join
    assert _wide(merged) == [13]
    assert matmul_flops(merged) == matmul_flops(graph)


def test_in_a_training_graph_what_the_backward_reads_joins_only_its_like():
    train = training_graph(_forward())
    merged = merge_siblings(train, "loss")
    # The backward reads the first and last products: they join, and the other two apart.
    assert _wide(merged) == [6, 7]
    assert matmul_flops(merged) == matmul_flops(train)


@pytest.mark.parametrize(("dtype", "tol"), [("f32", 1e-5), ("bf16", 2e-2)])
def test_the_joined_step_computes_the_same_loss_and_gradients(dtype, tol):
    plain = training_graph(_forward(dtype))
    joined = merge_siblings(plain, "loss")
    assert _wide(joined)
    a, c = _run(plain), _run(joined)
    assert set(a) == set(c)
    for name in a:
        np.testing.assert_allclose(c[name], a[name], rtol=tol, atol=tol, err_msg=name)


def test_a_graph_without_siblings_is_left_alone():
    x = b.input("x", (2, 3), "f32")
    w = b.param("w", (3, 4), "f32")
    graph = Graph.of({"loss": b.sum(b.matmul(x, w))}, [x, w])
    merged = merge_siblings(graph)
    assert [n.op for n in merged.nodes()] == [n.op for n in graph.nodes()]
