"""Every fused op's decomposition equals the fused op on the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
from ir_opcheck import _graph, ops_built
from test_ops import CASES

from sexpgpu.devices.cpu import run
from sexpgpu.errors import Source, Span
from sexpgpu.ir import builder as b
from sexpgpu.ir.decompose import DECOMPOSE, decompose
from sexpgpu.ir.node import Graph
from sexpgpu.ir.ops import FUSED, Op
from sexpgpu.ir.verify import verify

# The op checks that build a fused op, and the (rtol, atol) per dtype.
FUSED_CASES = [case for case in CASES if ops_built(case.values[0], case.values[2]) & FUSED]
TOL = {"f64": (1e-10, 1e-12), "f32": (1e-5, 1e-6), "bf16": (2e-2, 2e-2)}


def _feeds(graph: Graph, args, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {f"x{i}": a.sample(rng) for i, a in enumerate(args)}
    if "w" in graph.inputs:
        feeds["w"] = rng.normal(size=graph.inputs["w"].shape)
    return feeds


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f64"])
@pytest.mark.parametrize(("build", "torch_fn", "args", "differentiable"), FUSED_CASES)
def test_decomposition_equals_the_fused_op(build, torch_fn, args, differentiable, dtype) -> None:
    # With the gradient where the case has one: the fused VJPs are decomposed too.
    graph, _ = _graph(build, args, dtype, with_grad=differentiable)
    plain = decompose(graph, keep=lambda op: False)
    verify(plain)
    assert not {n.op for n in plain.nodes()} & FUSED
    feeds = _feeds(graph, args)
    want, got = run(graph, feeds), run(plain, feeds)
    rtol, atol = TOL[dtype]
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=name)


def test_every_fused_op_has_a_decomposition() -> None:
    assert set(DECOMPOSE) == FUSED
    covered = set().union(*(ops_built(c.values[0], c.values[2]) for c in FUSED_CASES))
    assert covered >= FUSED


def test_kept_ops_stay_and_spans_carry_over() -> None:
    span = Span(Source("model.lisp", "(attention)\n"), 1, 1, 1, 12)
    q = b.input("q", (2, 4, 3), "bf16")
    y = b.attention(q, q, q, causal=True, scale=0.5, span=span)
    z = b.gelu(y, span=span)
    graph = Graph.of({"z": z})
    only_gelu = decompose(graph, keep=lambda op: op is Op.ATTENTION)
    ops = {n.op for n in only_gelu.nodes()}
    assert Op.ATTENTION in ops and Op.GELU not in ops
    assert only_gelu.nodes()[1] is y  # untouched nodes are reused
    assert all(n.span is span for n in only_gelu.nodes() if n.op is not Op.INPUT)
    assert decompose(graph, keep=lambda op: True).outputs["z"] is z
