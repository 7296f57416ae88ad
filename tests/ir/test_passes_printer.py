"""Passes keep results (verified after each), the printer reads back, the verifier points."""

from __future__ import annotations

import numpy as np
import pytest

from sexpgpu.devices.cpu import run
from sexpgpu.ir import builder as b
from sexpgpu.ir.autodiff import training_graph
from sexpgpu.ir.node import Graph, Node
from sexpgpu.ir.ops import Op
from sexpgpu.ir.passes import cse, dce, fold_constants, optimize
from sexpgpu.ir.printer import format_graph, parse_graph
from sexpgpu.ir.verify import IRError, verify

RNG = np.random.default_rng(3)


def _model() -> Graph:
    x = b.input("x", (4, 6), "f32")
    t = b.input("t", (4,), "int32")
    w = b.param("net/w.0", (6, 5), "f32")
    unused = b.input("spare", (2,), "f32")
    seq = 5
    mask = b.lt(b.iota((seq, seq), 1), b.iota((seq, seq), 0))  # constant subgraph
    scale = b.div(b.constant(1.0, "f32"), b.sqrt(b.constant(4.0, "f32")))
    h1 = b.tanh(b.matmul(x, w))
    h2 = b.tanh(b.matmul(x, w))  # a common subexpression
    h = b.mul(b.add(h1, h2), scale)
    h = b.where(b.slice(mask, 0, 0, 4), h, b.constant(-1e4, "f32"))
    loss = b.sum(b.cross_entropy(h, t))
    return training_graph(Graph.of({"loss": loss}, [unused]))


def _feeds():
    return {
        "x": RNG.normal(size=(4, 6)),
        "t": np.array([0, 1, 2, 4], np.int32),
        "net/w.0": RNG.normal(size=(6, 5)),
        "spare": np.zeros(2),
    }


def _count(graph: Graph, op: Op) -> int:
    return sum(n.op is op for n in graph.nodes())


def test_passes_preserve_results_and_verify_after_each():
    graph, feeds = _model(), _feeds()
    verify(graph)
    want = run(graph, feeds)
    for step in (cse, fold_constants, dce):
        graph = step(graph)
        verify(graph)
        got = run(graph, feeds)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=step.__name__)


def test_cse_merges_and_folding_removes_constant_subgraphs():
    graph = _model()
    assert _count(graph, Op.MATMUL) >= 3 and _count(graph, Op.IOTA) == 2
    optimized = optimize(graph, check=verify)
    assert _count(optimized, Op.TANH) == 1
    assert _count(optimized, Op.IOTA) == 0 and _count(optimized, Op.SQRT) == 0
    assert len(optimized.nodes()) < len(graph.nodes())
    assert "spare" in optimized.inputs  # declared leaves stay feedable
    assert "spare" not in dce(optimized, keep_unused_leaves=False).inputs


def test_printed_graph_reads_back_to_the_same_text_and_values():
    graph = optimize(_model())
    text = format_graph(graph, spans=False)
    again = parse_graph(text)
    verify(again)
    assert format_graph(again, spans=False) == text
    feeds = _feeds()
    want, got = run(graph, feeds), run(again, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_printer_writes_attributes_and_names():
    text = format_graph(_model(), spans=False)
    assert '(param "net/w.0")' in text
    assert '(%0 f32 [4 6] (input "x"))' in text
    assert ":axes [0] :keepdims false" in text
    assert '(output "grad/net/w.0" %' in text


def test_verifier_shows_the_program_around_a_bad_node():
    x = b.input("x", (2, 3), "f32")
    good = b.exp(x)
    bad = Node(Op.NEG, good.dtype, (3, 2), (good,), {}, None)  # wrong shape
    graph = Graph.of({"y": b.sum(b.reshape(bad, (6,)))})
    with pytest.raises(IRError) as info:
        verify(graph)
    assert str(info.value) == (
        "invalid IR at line 4: the rule gives f32 [2 3], the node says f32 [3 2]\n"
        "   (graph\n"
        '     (%0 f32 [2 3] (input "x"))\n'
        "     (%1 f32 [2 3] (exp %0))\n"
        ">>   (%2 f32 [3 2] (neg %1))\n"
        "     (%3 f32 [6] (reshape %2))\n"
        "     (%4 f32 [] (sum %3 :axes [0] :keepdims false))\n"
        '     (output "y" %4))'
    )


def test_verifier_rejects_undeclared_leaves_and_unnormalized_attrs():
    x = b.input("x", (2, 3), "f32")
    other = b.input("x", (2, 3), "f32")
    graph = Graph({"x": x}, {}, {"y": b.add(x, other)})
    with pytest.raises(IRError, match="not the graph's declared one"):
        verify(graph)
    raw = Node(Op.SUM, x.dtype, (2,), (x,), {"axes": (-1,), "keepdims": False}, None)
    with pytest.raises(IRError, match="not normalized"):
        verify(Graph.of({"y": raw}))


def test_rank_zero_arithmetic_folds_and_runs_in_every_dtype():
    for dtype in ("bf16", "f32", "f64", "int32"):
        two = b.constant(2, dtype)
        y = b.mul(b.add(two, b.constant(1, dtype)), two)
        graph = Graph.of({"y": b.add(b.input("x", (), dtype), y)})
        folded = fold_constants(graph)
        verify(folded)
        assert _count(folded, Op.MUL) == 0
        for g in (graph, folded):
            got = run(g, {"x": np.array(1)})["y"]
            assert isinstance(got, np.ndarray) and got.shape == () and float(got) == 7.0


def test_printed_spans_are_comments_that_read_back():
    from sexpgpu.errors import Source, Span

    span = Span(Source("m.lisp", "(tanh x)\n"), 1, 1, 1, 9)
    x = b.input("x", (2,), "f32", span=span)
    graph = Graph.of({"y": b.tanh(x, span=span)})
    text = format_graph(graph)
    assert "(%1 f32 [2] (tanh %0))  ; m.lisp:1:1" in text
    assert format_graph(parse_graph(text), spans=False) == format_graph(graph, spans=False)
