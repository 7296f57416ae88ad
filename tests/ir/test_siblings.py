"""Sibling products made one (`sexpgpu.ir.siblings`): what joins, and that it computes the same."""

import numpy as np

from sexpgpu.devices.cpu import CpuProgram
from sexpgpu.ir import builder as b
from sexpgpu.ir.autodiff import training_graph
from sexpgpu.ir.compile import matmul_flops
from sexpgpu.ir.node import Graph
from sexpgpu.ir.ops import Op
from sexpgpu.ir.siblings import merge_siblings


def _forward(dtype="f32"):
    """x times three weights (two of them siblings of a third), and x times an activation."""
    x = b.input("x", (6, 4), "f32")
    ws = [b.param(f"w{i}", (4, n), "f32") for i, n in enumerate((3, 5, 2))]
    h = b.cast(x, dtype)
    ys = [b.matmul(h, b.cast(w, dtype) if dtype != "f32" else w) for w in ws]
    other = b.matmul(h, b.transpose(h))  # activations: not joined
    total = b.add(b.sum(b.cast(other, "f32")), b.constant(0.0, "f32"))
    for y in ys:
        total = b.add(total, b.sum(b.mul(b.cast(y, "f32"), b.cast(y, "f32"))))
    return Graph.of({"loss": total}, [x, *ws])


def _run(graph, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {
        name: rng.standard_normal(n.shape).astype(np.float32) for name, n in graph.inputs.items()
    }
    feeds |= {
        name: rng.standard_normal(n.shape).astype(np.float32) for name, n in graph.params.items()
    }
    return CpuProgram(graph)(feeds)


def test_products_of_one_input_by_weights_become_one():
    graph = _forward()
    merged = merge_siblings(graph)
    products = [n for n in merged.nodes() if n.op is Op.MATMUL]
    assert len(products) == 2  # the three weights' one, and the activations' own
    wide = next(p for p in products if p.shape == (6, 10))
    assert wide.inputs[1].op is Op.CONCAT
    assert matmul_flops(merged) == matmul_flops(graph)


def test_the_joined_step_computes_the_same_loss_and_gradients():
    for dtype, tol in (("f32", 1e-5), ("bf16", 2e-2)):
        plain = training_graph(_forward(dtype))
        joined = training_graph(merge_siblings(_forward(dtype)))
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
