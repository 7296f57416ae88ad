"""Cross-entropy with its gradient in one op (`sexpgpu.devices.cuda.cross_entropy`).

The Triton kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, on
CPU tensors, set by tests/conftest.py without a GPU) and compiled on a GPU
where there is one, against the torch ops; the
executor's pairing is checked on a GPT training graph: the forward and the
gradient run as one op only where the cotangent can come first, and the
graph gives the interpreter's loss and gradients either way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sexpgpu.devices.cpu import run
from sexpgpu.devices.cuda import cross_entropy as ce
from sexpgpu.devices.cuda.executor import TorchGraph
from sexpgpu.ir import builder as b
from sexpgpu.ir.autodiff import training_graph
from sexpgpu.ir.node import Graph
from sexpgpu.ir.ops import Op
from sexpgpu.lang import load_experiment_text

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
from cpu_interpreter import GPT  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def interpreted():
    """Triton's interpreter, as tests/conftest.py sets it up without a GPU."""
    pytest.importorskip("triton")
    if HAS_CUDA:
        pytest.skip("with a GPU the kernel runs compiled (test_the_op_on_cuda_equals_torch)")


def _rows(rows: int, cols: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(rows * cols)
    logits = (torch.randn(rows, cols, generator=gen) * 4).to(dtype)
    ids = torch.randint(0, cols, (rows,), generator=gen, dtype=torch.int32)
    g = torch.rand(rows, generator=gen) - 0.5
    return logits.to(device), ids.to(device), g.to(device)


def _check(got, want, grad_dtype: torch.dtype) -> None:
    (loss, grad), (want_loss, want_grad) = got, want
    assert loss.dtype == torch.float32 and grad.dtype == grad_dtype
    torch.testing.assert_close(loss.cpu(), want_loss.cpu(), rtol=1e-5, atol=1e-5)
    tol = 1e-5 if grad_dtype == torch.float32 else 1e-2  # bf16: one step at 1
    torch.testing.assert_close(grad.float().cpu(), want_grad.float().cpu(), rtol=tol, atol=tol)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy evaluates where()'s other side
@pytest.mark.parametrize(
    ("rows", "cols", "dtype"),
    [
        (5, 300, torch.bfloat16),  # one block, padded
        (3, 9000, torch.float32),  # three blocks, the last partial
        (4, 4096, torch.float32),  # exactly one block
    ],
)
def test_kernel_under_the_interpreter_equals_torch(interpreted, rows, cols, dtype) -> None:
    logits, ids, g = _rows(rows, cols, dtype)
    want = ce.rows_in_torch(logits, ids, g, dtype)
    _check(ce.rows_in_triton(logits, ids, g, dtype), want, dtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_kernel_takes_minus_infinity_logits(interpreted) -> None:
    """Masked logits (-inf) add nothing, as in torch.logsumexp; a row may be mostly masked."""
    logits, ids, g = _rows(3, 700, torch.float32)
    logits[0, :650] = float("-inf")
    logits[1, 5] = float("-inf")
    ids[0] = 660
    got = ce.rows_in_triton(logits, ids, g, torch.float32)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    _check(got, ce.rows_in_torch(logits, ids, g, torch.float32), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_op_on_cuda_equals_torch(dtype) -> None:
    logits, ids, g = _rows(300, 50304, dtype, "cuda")
    got = ce.cross_entropy_rows(logits, ids, g, dtype)
    _check(got, ce.rows_in_torch(logits, ids, g, dtype), dtype)


def _gpt_graph() -> Graph:
    shape = {"layers": 1, "width": 32, "heads": 2, "seq": 16, "vocab": 96}
    text = GPT.format(**shape, batch=2, microbatches=1, steps=1, dtype="f32")
    from sexpgpu.ir.compile import compile_run

    experiment = load_experiment_text(text, "gpt.lisp")
    return compile_run(experiment, experiment.run()).train_graph


def _feeds(graph: Graph) -> dict:
    rng = np.random.default_rng(0)
    feeds = {}
    for node in graph.nodes():
        if node.op is Op.INPUT:
            feeds[node.name] = rng.integers(0, 96, node.shape).astype(np.int32)
        elif node.op is Op.PARAM:
            feeds[node.name] = (rng.standard_normal(node.shape) * 0.1).astype(np.float32)
    return feeds


def test_gpt_graph_runs_the_loss_and_its_gradient_as_one_op() -> None:
    graph = _gpt_graph()
    torch_graph = TorchGraph(graph, torch.device("cpu"))
    [(forward, gradient)] = torch_graph._joint.items()
    assert torch_graph.order[forward].op is Op.CROSS_ENTROPY
    assert torch_graph.order[gradient].op is Op.CROSS_ENTROPY_GRAD
    # The cotangent (a mean's, from constants) was moved before the forward.
    assert torch_graph.steps[gradient].args[2] < forward
    feeds = _feeds(graph)
    got = torch_graph(feeds)
    want = run(graph, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name].numpy(), value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_cotangent_from_the_loss_keeps_the_two_apart() -> None:
    """sum(ce^2): the gradient's cotangent needs the loss, so it cannot come first."""
    logits = b.param("logits", (4, 10), "f32")
    ids = b.input("ids", (4,), "int32")
    rows = b.cross_entropy(logits, ids)
    loss = b.sum(b.mul(rows, rows))
    graph = training_graph(Graph.of({"loss": loss}))
    torch_graph = TorchGraph(graph, torch.device("cpu"))
    assert not torch_graph._joint
    feeds = {"logits": np.random.default_rng(1).standard_normal((4, 10)).astype(np.float32)}
    feeds["ids"] = np.array([0, 3, 9, 4], np.int32)
    got, want = torch_graph(feeds), run(graph, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name].numpy(), value, rtol=1e-5, atol=1e-6, err_msg=name)
