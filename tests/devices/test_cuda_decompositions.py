"""The trace's decompositions (`sexpgpu.devices.cuda.decompositions`) against aten's ops."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from sexpgpu.devices.cuda.decompositions import (  # noqa: E402
    TRACE_DECOMPOSITIONS,
    gelu,
    gelu_backward,
)

aten = torch.ops.aten


def _x(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4096, generator=g, dtype=torch.float64) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_tanh_gelu_and_its_gradient_equal_atens(dtype):
    x, g = _x(dtype), _x(dtype, seed=1)
    # float64: the identity itself; float32 and bf16: their rounding (of values up to ~10).
    tol = {torch.float64: 1e-13, torch.float32: 2e-6, torch.bfloat16: 8e-3}[dtype]
    for ours, theirs in [
        (gelu(x, "tanh"), aten.gelu(x, approximate="tanh")),
        (gelu_backward(g, x, "tanh"), aten.gelu_backward(g, x, approximate="tanh")),
    ]:
        assert ours.dtype == theirs.dtype == dtype
        scale = float(theirs.abs().max())
        assert float((ours.double() - theirs.double()).abs().max()) <= tol * scale


def _traced_targets(approximate):
    def step(x, g):
        return aten.gelu(x, approximate=approximate), aten.gelu_backward(
            g, x, approximate=approximate
        )

    x = _x(torch.bfloat16)
    graph = make_fx(step, decomposition_table=TRACE_DECOMPOSITIONS)(x, x).graph
    return {n.target for n in graph.nodes if n.op == "call_function"}


def test_the_traced_tanh_gelus_are_a_sigmoid_and_no_tanh():
    targets = _traced_targets("tanh")
    assert aten.sigmoid.default in targets and aten.tanh.default not in targets
    assert not targets & set(TRACE_DECOMPOSITIONS)


def test_the_exact_gelu_is_traced_as_atens_own():
    targets = _traced_targets("none")
    assert {aten.gelu.default, aten.gelu_backward.default} <= targets


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler for Inductor")
def test_the_fused_step_compiles_the_written_out_gelu():
    """Inductor names its kernels after the ops they fuse: a sigmoid now, no gelu."""
    from sexpgpu.devices.cuda.fused import FusedGraph
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment_text

    text = """
(defdata digits (digits) :split 0.9)
(defmodel mlp (x) (-> x (linear 32) gelu (linear 10)))
(defrun train :model mlp :data digits :loss (cross-entropy (mlp x) y)
  :optimizer (adamw :lr 1e-2) :batch 16 :steps 4 :seed 3)
"""
    ex = load_experiment_text(text, "mlp.lisp")
    compiled = compile_run(ex, ex.run())
    graph = compiled.train_graph
    params = {k: torch.from_numpy(v) for k, v in compiled.init_params(0).items()}
    feeds = {
        n.name: torch.zeros(n.shape, dtype=torch.int32 if "int" in n.dtype.name.lower() else None)
        for n in graph.nodes()
        if n.op.label == "input"
    }
    feeds = {k: v.numpy() for k, v in feeds.items()}
    fused = FusedGraph(
        graph, torch.device("cpu"), sums=list(graph.outputs), examples={**feeds, **params}
    )
    names = " ".join(k.name for k in fused.kernels)
    assert "sigmoid" in names and "gelu" not in names and "tanh" not in names
