"""The cuda lowering (`TorchGraph`) against the interpreter, op by op and for whole models.

Every case of the op checks (`tests/ir/test_ops.py`) runs as a one-op graph
with its gradient (the IR's ``sum(op(x) * w)`` differentiated by
`sexpgpu.ir.autodiff`), on PyTorch's CPU device here and on CUDA where there
is a GPU (``-m gpu``), and must give the interpreter's outputs: f32 to 1e-5
on the CPU and 1e-4 relative on CUDA, bf16 to 2e-2. The examples' training
graphs (loss and every gradient) are compared the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ir"))

from ir_opcheck import _graph
from test_ops import CASES

from sexpgpu.devices.cpu import run
from sexpgpu.devices.cuda import executor, lowering
from sexpgpu.devices.cuda.attention import BACKENDS, sdpa_backward, sdpa_forward
from sexpgpu.devices.cuda.executor import TorchGraph, select_sdpa_backend
from sexpgpu.devices.cuda.lowering import LOWERING_EXEMPT, LOWERINGS, ids_checked_by_caller
from sexpgpu.errors import SexpgpuError
from sexpgpu.ir import builder as b
from sexpgpu.ir.autodiff import training_graph
from sexpgpu.ir.counter_rng import KEY_FIELD, microbatch_key
from sexpgpu.ir.node import Graph
from sexpgpu.ir.ops import Op
from sexpgpu.ir.passes import optimize
from sexpgpu.ir.stack import stack_microbatches
from sexpgpu.ir.trace import trace_run
from sexpgpu.ir.trace_init import draw, param_rng
from sexpgpu.ir.verify import verify
from sexpgpu.lang import load_experiment_text

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")],
)
DEVICES = ["cpu", CUDA]
# (rtol, atol) per (device, dtype).
TOL = {
    ("cpu", "f64"): (1e-10, 1e-12),
    ("cpu", "f32"): (1e-5, 1e-5),
    ("cpu", "bf16"): (2e-2, 2e-2),
    ("cuda", "f64"): (1e-10, 1e-12),
    ("cuda", "f32"): (1e-4, 1e-5),
    # The GPU's fused kernels sum bf16 terms in another order than the interpreter:
    # a few elements near 0.5 land a couple of bf16 steps (1/128 there) apart.
    ("cuda", "bf16"): (2e-2, 5e-2),
}


def _host(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.float() if value.dtype == torch.bfloat16 else value
        return value.numpy()
    return np.asarray(value)


def _compare(graph: Graph, feeds, device: str, dtype: str, **kwargs) -> TorchGraph:
    want = run(graph, feeds)
    program = TorchGraph(graph, torch.device(device), **kwargs)
    got = program(feeds)
    rtol, atol = TOL[device, dtype]
    assert set(got) == set(want)
    for name, value in want.items():
        host = _host(got[name])
        assert host.dtype == value.dtype and host.shape == value.shape, name
        np.testing.assert_allclose(host, value, rtol=rtol, atol=atol, err_msg=f"{name} {dtype}")
    return program


def _op_feeds(graph: Graph, args, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {f"x{i}": a.sample(rng) for i, a in enumerate(args)}
    if "w" in graph.inputs:
        feeds["w"] = rng.normal(size=graph.inputs["w"].shape)
    return feeds


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f64"])
@pytest.mark.parametrize(("build", "torch_fn", "args", "differentiable"), CASES)
def test_op_and_its_gradient_equal_the_interpreter(
    build, torch_fn, args, differentiable, dtype, device
) -> None:
    with_grad = differentiable and any(a.is_float for a in args)
    graph, _ = _graph(build, args, dtype, with_grad=with_grad)
    _compare(graph, _op_feeds(graph, args, seed=3), device, dtype)


def test_every_op_has_a_lowering() -> None:
    assert set(Op) == set(LOWERINGS) | LOWERING_EXEMPT
    assert not set(LOWERINGS) & LOWERING_EXEMPT


def _attention_graph(dtype: str, shape=(2, 3, 8, 16), causal=True, kv=None) -> Graph:
    # kv: the key/value heads (grouped-query attention), default the query heads
    shapes = _attention_shapes(shape, kv)
    q, k, v, w = (b.input(n, shapes[n], dtype) for n in "qkvw")
    y = b.attention(q, k, v, causal=causal, scale=0.3)
    loss = b.sum(b.mul(y, w))
    grads = b.attention_grad(q, k, v, w, causal=causal, scale=0.3)  # pairs with y
    parts = {n: b.slice(grads, 1, lo, hi) for n, (lo, hi) in _grad_parts(shape, kv).items()}
    return Graph.of({"y": y, "loss": loss, "grads": grads, **parts}, [q, k, v, w])


def _attention_shapes(shape, kv=None) -> dict[str, tuple[int, ...]]:
    grouped = (shape[0], shape[1] if kv is None else kv, *shape[2:])
    return {"q": shape, "k": grouped, "v": grouped, "w": shape}


def _grad_parts(shape, kv=None) -> dict[str, tuple[int, int]]:
    heads = shape[1]
    kv = heads if kv is None else kv
    return {"dq": (0, heads), "dk": (heads, heads + kv), "dv": (heads + kv, heads + 2 * kv)}


def _attention_feeds(shape=(2, 3, 8, 16), seed=0, kv=None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(size=s) for n, s in _attention_shapes(shape, kv).items()}


@pytest.mark.parametrize("kv", [None, 1])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_attention_gradient_takes_the_forward_stash(dtype: str, device: str, kv) -> None:
    program = _compare(_attention_graph(dtype, kv=kv), _attention_feeds(kv=kv), device, dtype)
    info = program.report()
    assert info["stashed"] == 1
    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert info["attention"] == select_sdpa_backend(torch.device(device), torch_dtype)
    assert info["ops"]["attention-grad"]["count"] == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_cross_entropy_gradient_takes_the_forward_log_sum_exp(dtype: str, device: str) -> None:
    logits = b.input("logits", (2, 5, 11), dtype)
    ids = b.input("ids", (2, 5), "int32")
    g = b.input("g", (2, 5), "f32")
    loss = b.cross_entropy(logits, ids)
    grad = b.cross_entropy_grad(logits, ids, g)  # pairs with loss
    graph = Graph.of({"loss": loss, "grad": grad}, [logits, ids, g])
    rng = np.random.default_rng(0)
    feeds = {
        "logits": rng.normal(size=(2, 5, 11)) * 3,
        "ids": rng.integers(0, 11, (2, 5)).astype(np.int32),
        "g": rng.normal(size=(2, 5)),
    }
    program = _compare(graph, feeds, device, dtype)
    assert program.report()["stashed"] == 1
    assert program.report()["with_grad"] == 1  # its weights are fed: one kernel makes both
    alone = Graph.of({"grad": grad}, [logits, ids, g])  # no forward: its own log-sum-exp
    assert _compare(alone, feeds, device, dtype).report()["stashed"] == 0


def _mean_loss_graph(dtype: str, weights_from_loss: bool) -> Graph:
    """A mean cross-entropy and its gradient, its weights made after it (as autodiff does)."""
    logits = b.input("logits", (3, 4, 37), dtype)
    ids = b.input("ids", (3, 4), "int32")
    loss = b.sum(b.cross_entropy(logits, ids), axes=(0, 1))
    seed = b.constant(1 / 12, "f32")
    if weights_from_loss:  # weights that need the forward: it cannot make the gradient
        seed = b.mul(seed, b.exp(b.neg(loss)))
    weights = b.broadcast_to(b.reshape(seed, (1, 1)), (3, 4))
    grad = b.cross_entropy_grad(logits, ids, weights)
    return Graph.of({"loss": loss, "grad": grad}, [logits, ids])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("weights_from_loss", [False, True], ids=["constant", "from-loss"])
def test_cross_entropy_is_made_with_its_gradient_where_the_weights_can_come_first(
    dtype: str, device: str, weights_from_loss: bool
) -> None:
    graph = _mean_loss_graph(dtype, weights_from_loss)
    forward = next(n for n in graph.nodes() if n.op is Op.CROSS_ENTROPY)
    weights = graph.outputs["grad"].inputs[2]
    assert graph.nodes().index(weights) > graph.nodes().index(forward)  # as written
    rng = np.random.default_rng(1)
    feeds = {
        "logits": rng.normal(size=(3, 4, 37)) * 4,
        "ids": rng.integers(0, 37, (3, 4)).astype(np.int32),
    }
    program = _compare(graph, feeds, device, dtype)
    assert program.report()["with_grad"] == (0 if weights_from_loss else 1)
    order = [id(n) for n in program.order]
    moved = order.index(id(weights)) < order.index(id(forward))
    assert moved is not weights_from_loss
    call = program.report()["ops"]["cross-entropy"]["call"]
    assert ("xent_with_grad" in call) is not weights_from_loss


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("read_after", [False, True], ids=["logits-dead", "logits-read"])
def test_the_gradient_is_written_over_logits_nothing_reads_after(
    dtype: str, device: str, read_after: bool, monkeypatch
) -> None:
    x, w = b.input("x", (3, 4, 2), dtype), b.param("w", (2, 37), dtype)
    logits = b.matmul(x, w)  # a buffer of the call's own
    ids = b.input("ids", (3, 4), "int32")
    loss = b.sum(b.cross_entropy(logits, ids), axes=(0, 1))
    weights = b.broadcast_to(b.reshape(b.constant(1 / 12, "f32"), (1, 1)), (3, 4))
    grad = b.cross_entropy_grad(logits, ids, weights)
    outputs = {"loss": loss, "grad": grad}
    if read_after:  # read after the loss: the gradient needs a buffer of its own
        outputs["twice"] = b.add(grad, logits)
    graph = Graph.of(outputs, [x, w, ids])
    rng = np.random.default_rng(2)
    feeds = {
        "x": rng.normal(size=(3, 4, 2)),
        "w": rng.normal(size=(2, 37)),
        "ids": rng.integers(0, 37, (3, 4)).astype(np.int32),
    }
    program = _compare(graph, feeds, device, dtype)
    assert program.report()["with_grad"] == 1
    assert program.report()["over"] == (0 if read_after else 1)
    call = program.report()["ops"]["cross-entropy"]["call"]
    assert ("the gradient over the logits for 1" in call) is not read_after
    # The schedule counts the logits and their gradient as one buffer where it overwrites.
    monkeypatch.setattr(executor, "_FRESH", frozenset())  # never written over
    apart = TorchGraph(graph, torch.device(device))
    saved = apart.planned_peak_bytes - program.planned_peak_bytes
    if read_after:
        assert saved == 0
    else:  # the peak moves to the product, which holds the fed operands beside the logits
        item = 4 if dtype == "f32" else 2
        assert 3 * 4 * 37 * item - (x.size + w.size) * item <= saved < 3 * 4 * 37 * item


def test_a_cross_entropy_alone_holds_no_f32_rows_where_the_kernel_runs() -> None:
    logits = b.input("logits", (3, 4, 37), "bf16")
    loss = b.sum(b.cross_entropy(logits, b.input("ids", (3, 4), "int32")), axes=(0, 1))
    graph = Graph.of({"loss": loss}, [logits])
    torch_calls = TorchGraph(graph, torch.device("cpu"), kernels=False).planned_peak_bytes
    kernel = TorchGraph(graph, torch.device("cpu"), kernels=True).planned_peak_bytes
    assert torch_calls - kernel == 2 * 4 * logits.size  # an f32 copy and the shifted rows


@pytest.mark.parametrize("kv", [None, 1])
@pytest.mark.parametrize("backend", ["flash-cpu", "math"])
def test_cpu_attention_backends(backend: str, kv) -> None:
    # grouped heads: as they are to flash-cpu, repeated to math
    program = _compare(
        _attention_graph("f32", causal=False, kv=kv),
        _attention_feeds(kv=kv),
        "cpu",
        "f32",
        attention_backend=backend,
    )
    assert set(program.attention_backends().values()) == {backend}


def test_a_refusing_backend_falls_to_the_next_and_says_why() -> None:
    # On the CPU the CUDA kernels refuse: cudnn goes to flash, which goes to math.
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    out, aux = sdpa_forward(q, k, v, True, 0.5, "cudnn")
    assert aux.backend == "math"
    assert aux.fallback.startswith("cudnn refused") and "; flash refused" in aux.fallback
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(out, expected)


def test_grouped_heads_fall_to_math_repeated() -> None:
    # 4 query heads over 2 key/value heads: math repeats them, and sums their gradients back
    q, g = torch.randn(1, 4, 8, 4), torch.randn(1, 4, 8, 4)
    k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    out, aux = sdpa_forward(q, k, v, True, 0.5, "cudnn")
    assert aux.backend == "math"
    grads = sdpa_backward(g, q, k, v, True, 0.5, aux, "cudnn")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    F = torch.nn.functional
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, torch.autograd.grad(expected, leaves, g), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_out_of_memory_in_a_backend_is_no_refusal(monkeypatch, stage: str) -> None:
    # The next backend would hold more (math: the whole score matrix); the run's own
    # handling of a full device (caches released, the batch split) gets the error.
    from sexpgpu.devices.cuda import attention

    def full(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB.")

    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    table = attention._FORWARD if stage == "forward" else attention._BACKWARD
    monkeypatch.setitem(table, "flash-cpu", full)
    with pytest.raises(torch.OutOfMemoryError):
        if stage == "forward":
            sdpa_forward(q, k, v, True, 0.5, "flash-cpu")
        else:
            out, aux = attention.sdpa_forward(q, k, v, True, 0.5, "math")
            aux = attention.AttentionAux("flash-cpu", out, (torch.zeros(1, 2, 8),), None)
            attention.sdpa_backward(torch.ones_like(q), q, k, v, True, 0.5, aux, "flash-cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "flash-cpu"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_cuda_attention_backends(backend: str, dtype: str) -> None:
    if backend in ("flash", "cudnn") and dtype == "f32":
        pytest.skip(f"{backend} attention takes bf16/f16 only")
    for kv in (None, 2):  # grouped heads: as they are (GROUPED) or repeated
        program = _compare(
            _attention_graph(dtype, (2, 4, 128, 64), kv=kv),
            _attention_feeds((2, 4, 128, 64), kv=kv),
            "cuda",
            dtype,
            attention_backend=backend,
        )
        ran = program.attention_backends()
        assert all(value == backend for value in ran.values()), (kv, ran)


def test_report_names_kernels_and_the_peak() -> None:
    x = b.input("x", (4, 8), "bf16")
    w = b.param("w", (8, 3), "bf16")
    y = b.gelu(b.matmul(x, w))
    graph = Graph.of({"y": y})
    program = TorchGraph(graph, torch.device("cpu"))
    info = program.report()
    assert info["ops"]["matmul"] == {"call": "torch.matmul (cuBLAS on CUDA)", "count": 1}
    assert info["ops"]["gelu"]["count"] == 1 and info["attention"] is None
    # 2 bytes each: x and w die at the product, which dies at gelu; the peak is at the product.
    assert program.planned_peak_bytes == 2 * (32 + 24 + 12)
    assert program.peak_node is y.inputs[0]
    assert any("matmul x1" in line for line in program.report_lines())
    out = program({"x": np.ones((4, 8)), "w": np.ones((8, 3))})
    assert out["y"].dtype == torch.bfloat16


def test_feeds_are_checked_and_ids_out_of_range_are_data_errors() -> None:
    table = b.input("t", (4, 2), "f32")
    ids = b.input("i", (3,), "int32")
    program = TorchGraph(Graph.of({"y": b.take(table, ids)}), torch.device("cpu"))
    with pytest.raises(ValueError, match="no feed"):
        program({"t": np.zeros((4, 2))})
    with pytest.raises(ValueError, match="shape"):
        program({"t": np.zeros((4, 3)), "i": np.zeros(3, np.int32)})
    with pytest.raises(SexpgpuError, match="the data holds id 4"):
        program({"t": np.zeros((4, 2)), "i": np.array([0, 4, 1], np.int32)})


# ---------------------------------------------------------------- whole models


def _training(example: str, variant: str | None, edits=()) -> tuple[Graph, object]:
    text = (EXAMPLES / example).read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    experiment = load_experiment_text(text, example, variant=variant)
    trace = trace_run(experiment, experiment.run())
    leaves = [*trace.inputs.values(), *trace.param_nodes.values()]
    forward = Graph.of({"loss": trace.loss}, leaves)
    return optimize(training_graph(forward), check=verify), trace


def _model_feeds(trace, seed: int) -> dict[str, np.ndarray]:
    feeds = {name: draw(s.init, s.shape, param_rng(seed, name)) for name, s in trace.params.items()}
    rng = np.random.default_rng(seed)
    for name, node in trace.inputs.items():
        if node.dtype == "int32":
            feeds[name] = rng.integers(0, 10, node.shape).astype(np.int32)
        else:
            feeds[name] = rng.random(node.shape, dtype=np.float32)
    return feeds


def _compare_model(graph: Graph, feeds, device: str, dtype: str) -> None:
    want = run(graph, feeds)
    got = TorchGraph(graph, torch.device(device))(feeds)
    assert set(got) == set(want)
    for name, value in want.items():
        host = _host(got[name]).astype(np.float64)
        if dtype == "f32":  # near zero: relative to the tensor's largest element,
            # with a floor for gradients that are zero but for rounding (a key bias's)
            rtol, floor = (1e-5, 1e-8) if device == "cpu" else (1e-4, 1e-7)
            atol = max(rtol * float(np.abs(value).max(initial=0.0)), floor)
            np.testing.assert_allclose(host, value, rtol=rtol, atol=atol, err_msg=name)
        else:  # bf16: the whole tensor to 2e-2 of its size (single elements may flip);
            # the floor is for gradients that are zero but for rounding (a key bias's)
            bound = 2e-2 * float(np.linalg.norm(value)) + 1e-4 * np.sqrt(value.size)
            assert float(np.linalg.norm(host - value)) <= bound, name


MLP_BF16 = ((":seed 0", ":seed 0 :dtype bf16"),)
GPT_BF16 = (('(lr 1e-3) (dtype "f32")', '(lr 1e-3) (dtype "bf16")'),)
GPT_SMALL = (("(batch 8) (microbatches 8)", "(batch 2) (microbatches 8)"),)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "edits"), [("f32", ()), ("bf16", MLP_BF16)])
def test_mlp_training_step_equals_the_interpreter(dtype, edits, device) -> None:
    graph, trace = _training("mlp.lisp", None, edits)
    _compare_model(graph, _model_feeds(trace, 0), device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "edits"), [("f32", ()), ("bf16", GPT_BF16)])
def test_gpt_smoke_training_step_equals_the_interpreter(dtype, edits, device) -> None:
    graph, trace = _training("gpt.lisp", "smoke", GPT_SMALL + edits)
    program_nodes = {n.op for n in graph.nodes()}
    assert {Op.ATTENTION, Op.ATTENTION_GRAD, Op.LAYERNORM_GRAD, Op.CROSS_ENTROPY} <= program_nodes
    _compare_model(graph, _model_feeds(trace, 1), device, dtype)


LLAMA_SMALL = (("(batch 8) (microbatches 8)", "(batch 2) (microbatches 8)"),)
LLAMA_DROPOUT = (("(dropout 0.0)", "(dropout 0.2)"),)


LLAMA_BF16 = (('(lr 1e-3) (dtype "f32")', '(lr 1e-3) (dtype "bf16")'),)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
def test_llama_smoke_training_step_equals_the_interpreter(dropout, dtype, device) -> None:
    """Rotary tables, grouped key/value heads, SwiGLU, and dropout's masks drawn by the lowering."""
    edits = (
        LLAMA_SMALL + (LLAMA_DROPOUT if dropout else ()) + (LLAMA_BF16 if dtype == "bf16" else ())
    )
    graph, trace = _training("llama.lisp", "smoke", edits)
    ops = {n.op for n in graph.nodes()}
    assert {Op.ATTENTION, Op.ATTENTION_GRAD} <= ops and (Op.UNIFORM in ops) is dropout
    feeds = _model_feeds(trace, 2)
    if dropout:
        feeds[KEY_FIELD] = microbatch_key(1337, 5)
    _compare_model(graph, feeds, device, dtype)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_attention_gradients_reach_the_products_unstacked(microbatches: int) -> None:
    """The VJP slices dq, dk and dv out of attention-grad's stack (microbatches stacked, through
    a transpose first): traced, no stack is made, and the values equal the interpreter's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graph, trace = _training("gpt.lisp", "smoke", GPT_SMALL)
    feeds = _model_feeds(trace, 1)
    if microbatches > 1:
        graph = stack_microbatches(graph, microbatches)
        for name in trace.inputs:
            feeds[name] = np.stack([feeds[name]] * microbatches)
    program = _compare(graph, feeds, "cpu", "f32")
    names = sorted(feeds)
    with ids_checked_by_caller():
        gm = make_fx(lambda *xs: program(dict(zip(names, xs, strict=True))))(
            *(torch.from_numpy(np.asarray(feeds[n])) for n in names)
        )
    made = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.stack.default not in made and torch.ops.aten.cat.default not in made
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default in made


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_loss_is_reduced_in_f32_on_both_devices(device: str) -> None:
    graph, trace = _training("mlp.lisp", None, MLP_BF16)
    losses = [n for n in graph.nodes() if n.op is Op.CROSS_ENTROPY]
    assert [n.inputs[0].dtype for n in losses] == ["bf16"] and losses[0].dtype == "f32"
    assert graph.outputs["loss"].dtype == "f32"
    feeds = _model_feeds(trace, 0)
    want = run(graph, feeds)["loss"]
    got = _host(TorchGraph(graph, torch.device(device))(feeds)["loss"])
    for loss in (want, got):
        bits = np.asarray(loss, np.float32).view(np.uint32)
        assert bits & 0xFFFF, f"loss {loss} is a bf16 value"
    np.testing.assert_allclose(got, want, rtol=1e-5)


# (shape, axes, keepdims): a few terms along outer axes (written as adds), and sums
# that stay torch.sum (many terms, or along the last axis).
SUMS = [
    ((2, 4, 8, 3, 5), (2,), False),  # grouped key/value heads' gradients
    ((3, 5, 4), (0,), True),
    ((3, 5, 4), (0, 1), False),  # 15 terms over two axes
    ((17, 4), (0,), False),  # too many terms: torch.sum
    ((4, 6), (1,), True),  # the last axis: torch.sum
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f64"])
@pytest.mark.parametrize(("shape", "axes", "keep"), SUMS)
def test_a_sum_of_a_few_outer_terms_equals_the_interpreter(shape, axes, keep, dtype, device):
    x = b.input("x", shape, dtype)
    y = b.sum(b.mul(x, x), axes=axes, keepdims=keep)
    graph = Graph.of({"y": y}, [x])
    feeds = {"x": np.random.default_rng(5).normal(size=shape)}
    _compare(graph, feeds, device, dtype)
    terms = int(np.prod([shape[a] for a in axes]))
    adds = 1 < terms <= lowering.SHORT_SUM and len(shape) - 1 not in axes
    lowered = lowering.LOWERINGS[Op.SUM]
    with pytest.MonkeyPatch.context() as patch:
        seen = []
        patch.setattr(lowering, "_sum_by_adds", lambda *a: seen.append(a) or 0)
        lowered(y, torch.zeros(shape, dtype=torch.float32))
    assert bool(seen) is adds
