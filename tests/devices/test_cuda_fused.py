"""The fused path (`sexpgpu.devices.cuda.fused`): Inductor's kernels equal the interpreter.

In CI it compiles with Inductor's C++ backend on PyTorch's CPU device (no
CUDA graph there); the tests marked ``gpu`` compile Triton kernels and
replay a CUDA graph.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from device_seam import device_named

from sexpgpu.devices.cpu import CpuProgram
from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.compile import compile_run
from sexpgpu.ir.ops import Op
from sexpgpu.ir.recompute import cheap, recompute_graph
from sexpgpu.lang import load_experiment, load_experiment_text

torch = pytest.importorskip("torch")

from sexpgpu.devices.cuda.device import CudaDevice  # noqa: E402
from sexpgpu.devices.cuda.fused import FusedGraph  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GPU = pytest.mark.gpu

MLP = """
(defdata digits (digits) :split 0.9)
(defmodel mlp (x) (-> x (linear 32) gelu (linear 10)))
(defrun train :model mlp :data digits :loss (cross-entropy (mlp x) y)
  :optimizer (adamw :lr 1e-2) :batch 16 :steps 4 :seed 3)
"""


# Inductor's CPU backend compiles C++; the GPU one generates Triton.
NEEDS_CXX = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler for Inductor")
pytestmark = NEEDS_CXX


def _device(kind: str):
    if kind == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no GPU")
        return torch.device("cuda")
    return torch.device("cpu")


def _feeds(graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for node in graph.nodes():
        if node.op.label == "input":
            if node.dtype.name.lower().startswith("int"):
                feeds[node.name] = rng.integers(0, 10, node.shape).astype(np.int32)
            else:
                feeds[node.name] = rng.standard_normal(node.shape).astype(np.float32)
    return feeds


def _compiled(which: str):
    if which == "mlp":
        experiment = load_experiment_text(MLP, "mlp.lisp")
    else:
        experiment = load_experiment(ROOT / "examples" / "gpt.lisp", variant="smoke")
    return compile_run(experiment, experiment.run())


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("which", ["mlp", "gpt", "gpt made again"])
def test_fused_sums_equal_the_interpreter(kind: str, which: str) -> None:
    compiled = _compiled(which.split()[0])
    graph, device = compiled.train_graph, _device(kind)
    if which.endswith("made again"):  # its layernorms' outputs made in the backward, as planned
        roots = cheap(graph, into_products=False)
        assert {r.op.label for r in roots} == {"layernorm"}
        graph = recompute_graph(graph, roots)
    host = compiled.init_params(0)
    params = {k: torch.from_numpy(v).to(device) for k, v in host.items()}
    batches = [_feeds(graph, seed) for seed in (1, 2, 3)]
    fused = FusedGraph(graph, device, sums=list(graph.outputs), examples={**batches[0], **params})
    buffers = {
        name: torch.zeros(node.shape, dtype=torch.float32, device=device)
        for name, node in graph.outputs.items()
    }
    for batch in batches:  # on a GPU: a plain call, a capture, a replay
        fused({**batch, **params}, buffers)
    interpreter = CpuProgram(compiled.train_graph)
    expected = {name: 0.0 for name in graph.outputs}
    for batch in batches:
        out = interpreter({**batch, **host})
        expected = {name: expected[name] + out[name] for name in graph.outputs}
    for name, value in expected.items():
        got = buffers[name].cpu().numpy()
        scale = float(np.max(np.abs(value))) or 1.0
        assert np.max(np.abs(got - value)) <= 1e-4 * max(scale, 1e-3), name
    assert fused.captured is (kind == "cuda")
    lines = fused.report_lines()
    assert lines[0].startswith("fused: ") and any("mm" in line for line in lines)  # the products


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=GPU)])
def test_a_whole_step_returns_its_sums(kind: str) -> None:
    compiled = _compiled("mlp")
    graph, device = compiled.train_graph, _device(kind)
    host = compiled.init_params(0)
    params = {k: torch.from_numpy(v).to(device) for k, v in host.items()}
    batches = [_feeds(graph, seed) for seed in (1, 2, 3)]
    fused = FusedGraph(graph, device, sums=[], examples={**batches[0], **params})
    assert fused.zero_buffers() == {}
    assert fused.calls_cublaslt  # gelu in its products' epilogues: the plan counts the workspace
    interpreter = CpuProgram(graph)
    # On a GPU: a plain call, a capture, a replay.
    for batch in batches:
        got = fused({**batch, **params}, {})
        for name, value in interpreter({**batch, **host}).items():
            np.testing.assert_allclose(got[name].cpu().numpy(), value, rtol=1e-4, atol=1e-5)
    assert fused.captured is (kind == "cuda")


def test_a_step_without_cublaslts_products_says_so() -> None:
    """relu in f32, returned as made: the plan leaves out cuBLASLt's workspace."""
    experiment = load_experiment_text(MLP.replace(" gelu ", " relu "), "mlp.lisp")
    graph = compile_run(experiment, experiment.run()).train_graph
    params = {n.name: torch.zeros(n.shape) for n in graph.nodes() if n.op is Op.PARAM}
    fused = FusedGraph(graph, torch.device("cpu"), sums=[], examples={**_feeds(graph, 1), **params})
    assert (fused.gelu_products, fused.sum_products, fused.calls_cublaslt) == ((0, 0), 0, False)


@GPU
def test_the_compiled_step_writes_the_gradient_over_its_logits() -> None:
    """Logits most of the step: its measured peak holds one [rows vocab] buffer, not two."""
    text = MLP.replace("(linear 32) gelu (linear 10)", "(linear 16384 :bias false)")
    text = text.replace(":batch 16", ":batch 1024").replace(":seed 3", ':seed 3 :dtype "bf16"')
    experiment = load_experiment_text(text, "mlp.lisp")
    graph = compile_run(experiment, experiment.run()).train_graph
    device = _device("cuda")
    params = {
        n.name: torch.zeros(n.shape, device=device) for n in graph.nodes() if n.op is Op.PARAM
    }
    feeds = {**_feeds(graph, 1), **params}
    fused = FusedGraph(graph, device, sums=[], examples=feeds)
    # bf16 logits, 32 MiB; beside them the weight's f32 gradient and bf16 copy, 6 MiB
    logits = 1024 * 16384 * 2
    peak = fused.call_peak_bytes(feeds)
    assert peak is not None and logits <= peak < 1.5 * logits, peak  # a copy would be 2x


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=GPU)])
def test_a_whole_step_makes_its_bf16_weight_gradients_in_f32_as_a_summing_one(kind) -> None:
    """The products a step returns are made in f32 at once (``mm_f32``), bit for bit the sums'."""
    experiment = load_experiment_text(MLP.replace(":seed 3", ':seed 3 :dtype "bf16"'), "mlp.lisp")
    compiled = compile_run(experiment, experiment.run())
    graph, device = compiled.train_graph, _device(kind)
    params = {k: torch.from_numpy(v).to(device) for k, v in compiled.init_params(0).items()}
    feeds = {**_feeds(graph, 1), **params}
    whole = FusedGraph(graph, device, sums=[], examples=feeds)
    summing = FusedGraph(graph, device, sums=list(graph.outputs), examples=feeds)
    assert whole.sum_products == summing.sum_products == 2  # both linear layers' weights
    assert whole.calls_cublaslt and summing.calls_cublaslt
    buffers = summing.zero_buffers()
    summing(feeds, buffers, zeros=True)
    got = whole(feeds, {})
    for name in graph.outputs:
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], buffers[name], rtol=0, atol=0)


def _gpt_on_cpu():
    compiled = _compiled("gpt")
    graph = compiled.train_graph
    params = {k: torch.from_numpy(v) for k, v in compiled.init_params(0).items()}
    examples = {**_feeds(graph, 0), **params}
    return (
        graph,
        params,
        FusedGraph(graph, torch.device("cpu"), sums=list(graph.outputs), examples=examples),
    )


def test_every_kernel_names_the_ir_nodes_it_covers() -> None:
    _, _, fused = _gpt_on_cpu()
    assert fused.kernels
    assert all(k.nodes or k.sums for k in fused.kernels)
    labels = {n.op.label for k in fused.kernels for n in k.nodes}
    assert {"attention", "layernorm-grad", "cross-entropy"} <= labels
    assert any("gpt.lisp" in k.forms() for k in fused.kernels)


def test_fed_ids_are_checked_before_the_upload() -> None:
    graph, params, fused = _gpt_on_cpu()
    buffers = {n: torch.zeros(o.shape) for n, o in graph.outputs.items()}
    bad = _feeds(graph, 1)
    bad["tokens"][0, 0] = 10_000
    with pytest.raises(SexpgpuError) as info:
        fused({**bad, **params}, buffers)
    assert info.value.code == "E-DATA-006"
    assert all(float(b.abs().sum()) == 0 for b in buffers.values())  # nothing summed


def test_a_fused_run_equals_the_interpreter(tmp_path: Path) -> None:
    from sexpgpu.train import prepare_run
    from sexpgpu.train.metrics import read_series

    text = MLP.replace(":steps 4", ":steps 6 :microbatches 2 :clip 0.5")
    path = tmp_path / "mlp.lisp"
    path.write_text(text)
    runs = {}
    for name, device in [("cpu", None), ("fused", CudaDevice("cpu", fuse=True))]:
        with device_named("cpu", device):
            trainer = prepare_run(path, out=tmp_path / name)
        trainer.run()
        values = read_series(tmp_path / name, "train/loss")
        runs[name] = [values[s] for s in sorted(values)]
    np.testing.assert_allclose(runs["fused"], runs["cpu"], rtol=1e-5)
    notes = (tmp_path / "fused" / "metrics.jsonl").read_text()
    assert "fused: " in notes and "kernel x" in notes


def test_a_stacked_fused_run_equals_the_interpreter(tmp_path: Path, monkeypatch) -> None:
    from sexpgpu.train import prepare_run
    from sexpgpu.train.metrics import read_series

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "mlp.lisp"
    path.write_text(MLP.replace(":steps 4", ":steps 4 :microbatches 4"))
    runs = {}
    for name, device in [("cpu", None), ("fused", CudaDevice("cpu", fuse=True))]:
        with device_named("cpu", device):
            prepare_run(path, out=tmp_path / name).run()
        values = read_series(tmp_path / name, "train/loss")
        runs[name] = [values[s] for s in sorted(values)]
    np.testing.assert_allclose(runs["fused"], runs["cpu"], rtol=1e-5)
    notes = (tmp_path / "fused" / "metrics.jsonl").read_text()
    # Launches dominate so small a model: the cost model sees 4 per call win clearly.
    assert "stacking 4: the cost model's pick" in notes


def test_a_refused_capture_runs_the_step_without_a_cuda_graph(monkeypatch) -> None:
    compiled = _compiled("mlp")
    graph = compiled.train_graph
    params = {k: torch.from_numpy(v) for k, v in compiled.init_params(0).items()}
    feeds = _feeds(graph, 0)
    fused = FusedGraph(
        graph, torch.device("cpu"), sums=list(graph.outputs), examples={**feeds, **params}
    )

    def refuse() -> None:
        raise RuntimeError("capture refused by the driver")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    fused.capture = True  # as on a GPU: the second call tries to capture
    buffers = {n: torch.zeros(o.shape) for n, o in graph.outputs.items()}
    for _ in range(3):
        fused({**feeds, **params}, buffers)
    once = {n: torch.zeros(o.shape) for n, o in graph.outputs.items()}
    fused({**feeds, **params}, once)
    for name in graph.outputs:
        torch.testing.assert_close(buffers[name], 3 * once[name], rtol=1e-5, atol=1e-6)
    assert not fused.captured and not fused.capture
    assert fused.report_lines()[0].endswith(
        "no CUDA graph RuntimeError: capture refused by the driver"
    )


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("whole", [False, True], ids=["adds", "returns"])
def test_a_step_compiled_in_parts_by_workers_sums_as_the_interpreter(
    kind, whole, monkeypatch, tmp_path
):
    """Four parts, each compiled by a worker into the shared cache, then loaded here.

    (Cut in three, one layernorm kernel of the GPU's parts fails in Triton
    3.x's compiler, "PassManager::run failed", and the step compiles whole.)
    """
    from sexpgpu.devices.cuda import parallel_compile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(parallel_compile, "MIN_PART_NODES", 50)
    compiled = _compiled("gpt")
    graph, device = compiled.train_graph, _device(kind)
    host = compiled.init_params(0)
    params = {k: torch.from_numpy(v).to(device) for k, v in host.items()}
    batches = [_feeds(graph, seed) for seed in (1, 2)]
    pool = parallel_compile.CompilePool(4)
    try:
        fused = FusedGraph(
            graph,
            device,
            sums=[] if whole else list(graph.outputs),
            examples={**batches[0], **params},
            pool=pool,
        )
    finally:
        pool.close()
    assert fused.parts == 4
    assert "in 4 parts, 4 of them by compile workers" in fused.report_lines()[0]
    assert all(k.nodes or k.sums for k in fused.kernels)
    buffers = {name: torch.full_like(b, 7.0) for name, b in fused.zero_buffers().items()}
    strides = {name: b.stride() for name, b in buffers.items()}
    for i, batch in enumerate(batches):  # on a GPU: a plain call, then a capture
        returned = fused({**batch, **params}, buffers, zeros=i == 0)
    assert {name: b.stride() for name, b in buffers.items()} == strides
    interpreter = CpuProgram(graph)
    outs = [interpreter({**batch, **host}) for batch in batches]
    for name in graph.outputs:
        if whole:  # the last call's own
            value, got = outs[1][name], returned[name].cpu().numpy()
        else:  # both calls' added to what the buffers held
            value, got = outs[0][name] + outs[1][name] + 7.0, buffers[name].cpu().numpy()
        scale = float(np.max(np.abs(value))) or 1.0
        assert np.max(np.abs(got - value)) <= 1e-4 * max(scale, 1e-3), name


def test_a_part_no_worker_compiled_is_compiled_here(monkeypatch):
    from sexpgpu.devices.cuda import parallel_compile

    monkeypatch.setattr(parallel_compile, "MIN_PART_NODES", 50)
    compiled = _compiled("mlp")
    graph = compiled.train_graph
    params = {k: torch.from_numpy(v) for k, v in compiled.init_params(0).items()}
    examples = {**_feeds(graph, 1), **params}
    pool = parallel_compile.CompilePool(2)
    pool.start()
    for proc in pool._procs:  # workers that die before they are ready
        proc.kill()
    try:
        fused = FusedGraph(
            graph, torch.device("cpu"), sums=list(graph.outputs), examples=examples, pool=pool
        )
    finally:
        pool.close()
    whole = FusedGraph(graph, torch.device("cpu"), sums=list(graph.outputs), examples=examples)
    a, b = fused.zero_buffers(), whole.zero_buffers()
    fused(examples, a)
    whole(examples, b)
    for name in graph.outputs:
        np.testing.assert_allclose(a[name].numpy(), b[name].numpy(), rtol=1e-5, atol=1e-6)


def _in_parts(monkeypatch, tmp_path):
    """The mlp's training graph and parameters, with parts small enough to split it in two."""
    from sexpgpu.devices.cuda import parallel_compile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(parallel_compile, "MIN_PART_NODES", 10)
    compiled = _compiled("mlp")
    params = {k: torch.from_numpy(v) for k, v in compiled.init_params(0).items()}
    return compiled.train_graph, params


def test_one_pool_compiles_the_parts_of_graph_after_graph(monkeypatch, tmp_path):
    from sexpgpu.devices.cuda import parallel_compile

    graph, params = _in_parts(monkeypatch, tmp_path)
    pool = parallel_compile.CompilePool(2)
    try:
        for seed in (1, 2):  # the second graph differs: it returns its sums
            examples = {**_feeds(graph, seed), **params}
            fused = FusedGraph(
                graph,
                torch.device("cpu"),
                sums=[] if seed == 2 else list(graph.outputs),
                examples=examples,
                pool=pool,
            )
            assert "in 2 parts, 2 of them by compile workers" in fused.report_lines()[0]
    finally:
        pool.close()


def test_a_step_in_parts_loads_from_the_cache_by_its_keys_and_sums_alike(monkeypatch, tmp_path):
    from sexpgpu.devices.cuda import fused as fused_module
    from sexpgpu.devices.cuda import parallel_compile
    from sexpgpu.devices.cuda.compile_cache import StepCache

    graph, params = _in_parts(monkeypatch, tmp_path)
    examples = {**_feeds(graph, 1), **params}
    cache, sums = StepCache(tmp_path / "cache"), list(graph.outputs)
    pool = parallel_compile.CompilePool(2)
    try:
        cold = FusedGraph(graph, "cpu", sums=sums, examples=examples, pool=pool, cache=cache)
    finally:
        pool.close()

    def compiled_here(*args, **kwargs):
        raise AssertionError("a part was compiled, not loaded by its key")

    monkeypatch.setattr(fused_module, "compile_part", compiled_here)
    warm = FusedGraph(graph, "cpu", sums=sums, examples=examples, cache=cache)
    assert cold.parts == warm.parts == 2 and warm.cached
    assert [k.name for k in warm.kernels] == [k.name for k in cold.kernels]
    a, b = cold.zero_buffers(), warm.zero_buffers()
    for seed in (1, 2):
        batch = {**_feeds(graph, seed), **params}
        cold(batch, a, zeros=seed == 1)
        warm(batch, b, zeros=seed == 1)
    for name in sums:
        np.testing.assert_array_equal(a[name].numpy(), b[name].numpy())


def test_the_pool_leaves_jobs_past_its_workers_and_its_time_to_the_caller(monkeypatch):
    from sexpgpu.devices.cuda import parallel_compile

    monkeypatch.setattr(parallel_compile, "JOB_TIMEOUT", 0.2)  # less than a worker's imports
    pool = parallel_compile.CompilePool(1)
    try:
        ended = list(pool.compile([{}, {}]))
    finally:
        pool.close()
    assert ended == [(1, "no worker"), (0, "no answer in 0 s")]


def test_a_transposed_sum_reaches_its_buffer_in_the_buffers_layout():
    """The split's sums: a value whose layout differs from its buffer's is made contiguous
    inside the graph (where the copy fuses into its producer), and the buffer keeps its
    strides."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from sexpgpu.devices.cuda.parallel_compile import _sums_in_layout

    def step(buffer, x, w):
        buffer.copy_((x.t() @ w).t())  # a [4 3] gradient, transposed
        return ((x * 2).sum(),)

    x, w = torch.randn(5, 3), torch.randn(5, 4)
    gm = make_fx(step)(torch.zeros(4, 3), x, w)
    (copy,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    copy._rename(f"sums__{copy.name}")
    assert _sums_in_layout(gm) == [copy]
    value = copy.args[1]
    assert value.target is torch.ops.aten.clone.default and value.name.startswith("sums__")
    assert value.meta["val"].is_contiguous()
    buffer = torch.zeros(4, 3)
    gm(buffer, x, w)
    assert buffer.stride() == (3, 1)
    torch.testing.assert_close(buffer, (x.t() @ w).t())


def test_the_split_cuts_only_between_ir_nodes(monkeypatch):
    """Equal counts of calls per part would cut inside a node's calls; each cut moves on."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from sexpgpu.devices.cuda import parallel_compile

    monkeypatch.setattr(parallel_compile, "MIN_PART_NODES", 2)

    def step(x):
        for _ in range(5):  # five "IR nodes" of three calls each
            x = torch.tanh(x * 2 + 1)
        return (x,)

    gm = make_fx(step)(torch.randn(3))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    for i, node in enumerate(calls):
        node._rename(f"ir{i // 3}__{node.name}")
    parent = parallel_compile.split(gm, 2)  # an equal count would cut after call 7 of 15
    made_by = [
        {n.name.split("__")[0] for n in part.graph.nodes if n.op == "call_function"}
        for part in parent.children()
    ]
    assert made_by == [{"ir0", "ir1", "ir2"}, {"ir3", "ir4"}]
    x = torch.randn(3)
    torch.testing.assert_close(parent(x)[0], step(x)[0])


def test_a_stacked_fused_run_with_dropout_draws_the_interpreters_masks(tmp_path, monkeypatch):
    """Inductor's kernels hash the same keys and positions as the interpreter, stacked or not."""
    from sexpgpu.train import prepare_run
    from sexpgpu.train.metrics import read_series

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "mlp.lisp"
    text = MLP.replace("gelu (linear 10)", "gelu (dropout :p 0.5) (linear 10)")
    path.write_text(text.replace(":steps 4", ":steps 4 :microbatches 4"))
    runs = {}
    for name, backend in [("cpu", None), ("fused", CudaDevice("cpu", fuse=True))]:
        with device_named("cpu", backend):
            prepare_run(path, out=tmp_path / name).run()
        values = read_series(tmp_path / name, "train/loss")
        runs[name] = [values[s] for s in sorted(values)]
    np.testing.assert_allclose(runs["fused"], runs["cpu"], rtol=1e-5)
    plain = tmp_path / "plain.lisp"
    plain.write_text(MLP.replace(":steps 4", ":steps 4 :microbatches 4"))
    prepare_run(plain, out=tmp_path / "plain").run()
    values = read_series(tmp_path / "plain", "train/loss")
    assert abs(values[1] - runs["cpu"][0]) > 1e-4  # the masks are on
    assert "stacking 4" in (tmp_path / "fused" / "metrics.jsonl").read_text()


def test_a_call_without_an_inner_boxed_function_takes_its_list_as_arguments():
    # `boxed` finds AOTAutograd's boxed function where PyTorch has it (the memory
    # test of a split step says when it does not); anything else is called plainly.
    from sexpgpu.devices.cuda.parallel_compile import boxed

    assert boxed(lambda a, b: a - b)([5, 2]) == 3
