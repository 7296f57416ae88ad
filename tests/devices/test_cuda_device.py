"""The cuda device end to end: runs on its lowering equal runs on the interpreter.

In CI the lowering runs on PyTorch's CPU device (``CudaDevice("cpu")``, an
internal switch); the tests marked ``gpu`` run the same on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from device_seam import device_named

from sexpgpu.devices.cuda.device import CudaDevice
from sexpgpu.runtime.oom import FailureInjector
from sexpgpu.train import load_checkpoint, prepare_run
from sexpgpu.train.metrics import read_metrics, read_series

ROOT = Path(__file__).resolve().parents[2]
GPU = pytest.mark.gpu

MLP = """
(defdata digits (digits) :split 0.9)
(defmodel mlp (x) (-> x (linear 32) gelu (linear 10)))
(defrun train
  :model mlp :data digits :loss (cross-entropy (mlp x) y)
  :optimizer (adamw :lr 1e-2 :betas [0.9 0.95] :weight-decay 0.1)
  :schedule (cosine :warmup 3 :floor 0.1) :clip 0.5
  :batch 16 :microbatches 2 :steps 8 :seed 3 :dtype DTYPE
  :eval (every 4 :batches 2)
  :checkpoint (every 4 "checkpoints")
  :diagnostics ((grad-norm :every 2) (activation-rms :every 4)))
"""


def _losses(run_dir: Path, name: str = "train/loss") -> list[float]:
    values = read_series(run_dir, name)
    return [values[step] for step in sorted(values)]


def _notes(run_dir: Path) -> list[str]:
    records = read_metrics(run_dir / "metrics.jsonl")
    return [r["value"] for r in records if r["name"] == "annotation"]


def _file(tmp_path: Path, dtype: str = "f32") -> Path:
    path = tmp_path / "mlp.lisp"
    path.write_text(MLP.replace("DTYPE", dtype))
    return path


def _backend(kind: str) -> CudaDevice | None:
    if kind == "cpu":
        return None  # the interpreter
    if kind == "cuda":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("no GPU")
        return CudaDevice("cuda")
    return CudaDevice("cpu")


def _run(path: Path, out: Path, kind: str, **kw):
    with device_named("cpu", _backend(kind)):
        trainer = prepare_run(path, out=out, **kw)
        return trainer, trainer.run()


@pytest.mark.parametrize("kind", ["torch-cpu", pytest.param("cuda", marks=GPU)])
def test_mlp_run_equals_the_interpreter(tmp_path: Path, kind: str) -> None:
    path = _file(tmp_path)
    _, ref = _run(path, tmp_path / "cpu", "cpu")
    trainer, ours = _run(path, tmp_path / kind, kind)
    tol = 1e-5 if kind != "cuda" else 1e-4
    np.testing.assert_allclose(_losses(tmp_path / kind), _losses(tmp_path / "cpu"), rtol=tol)
    for name in ("eval/loss", "eval/accuracy", "train/grad_norm", "diag/grad-norm"):
        np.testing.assert_allclose(
            _losses(tmp_path / kind, name), _losses(tmp_path / "cpu", name), rtol=tol, atol=1e-6
        )
    for key, value in ref.params.items():
        np.testing.assert_allclose(ours.params[key], value, rtol=10 * tol, atol=10 * tol)
    assert ours.loss < _losses(tmp_path / kind)[0]  # it learns
    notes = _notes(tmp_path / kind)
    assert any(n.startswith("memory: plan") for n in notes)
    assert any(n.startswith("pattern: cross-entropy") for n in notes)
    assert any(n.startswith("lowering: matmul") for n in notes)
    assert ours.memory is not None and ours.memory.startswith("memory: peak")
    assert len(_losses(tmp_path / kind, "runtime/peak_bytes")) == 8
    assert trainer.report[0].startswith("device: cuda")


@pytest.mark.parametrize("kind", ["torch-cpu", pytest.param("cuda", marks=GPU)])
def test_bf16_run_is_close_to_the_interpreter(tmp_path: Path, kind: str) -> None:
    path = _file(tmp_path, "bf16")
    _run(path, tmp_path / "cpu", "cpu")
    _run(path, tmp_path / kind, kind)
    np.testing.assert_allclose(_losses(tmp_path / kind), _losses(tmp_path / "cpu"), rtol=2e-2)


CROSSINGS = [
    ("cpu", "torch-cpu"),
    ("torch-cpu", "cpu"),
    pytest.param("cpu", "cuda", marks=GPU),
    pytest.param("cuda", "cpu", marks=GPU),
]


@pytest.mark.parametrize(("first", "second"), CROSSINGS)
def test_checkpoints_cross_devices(tmp_path: Path, first: str, second: str) -> None:
    """Train 4 steps on one device, resume to 8 on the other: as 8 steps on one."""
    path = _file(tmp_path)
    _run(path, tmp_path / "whole", "cpu")
    _run(path, tmp_path / "split", first, steps=4)
    state = load_checkpoint(str(tmp_path / "split" / "checkpoints")).state
    assert state["device"] in ("cpu", "cuda")
    _run(path, tmp_path / "split", second, resume="latest")
    whole, split = _losses(tmp_path / "whole"), _losses(tmp_path / "split")
    np.testing.assert_allclose(split, whole, rtol=1e-4)


def _fail_allocations(
    monkeypatch, graphs, *, calls=(), rows_over=None, seam="train_step"
) -> FailureInjector:
    """Simulated allocation failures at the seam every training (or eval) call goes through."""
    inject = FailureInjector(calls, larger_than=rows_over)
    step = getattr(graphs, seam)

    def failing(self, params, batch):
        inject.check(len(batch["x"]))
        return step(self, params, batch)

    monkeypatch.setattr(graphs, seam, failing)
    return inject


def _graphs(kind: str):
    """The class of the graphs a run on `kind` calls (the interpreter's, or the lowering's)."""
    from sexpgpu.devices.cpu_device import CpuGraphs
    from sexpgpu.devices.cuda.step_graphs import TorchGraphs

    return CpuGraphs if kind == "cpu" else TorchGraphs


def test_an_allocation_failure_is_retried_and_annotated(tmp_path: Path, monkeypatch) -> None:
    from sexpgpu.devices.cuda.step_graphs import TorchGraphs

    path = _file(tmp_path)
    _run(path, tmp_path / "clean", "torch-cpu")
    inject = _fail_allocations(monkeypatch, TorchGraphs, calls=[3])
    _run(path, tmp_path / "run", "torch-cpu")
    assert inject.failures == 1
    notes = _notes(tmp_path / "run")
    assert any(n.startswith("memory: allocation failed in training step") for n in notes)
    assert _losses(tmp_path / "run") == _losses(tmp_path / "clean")  # the retry changes nothing


@pytest.mark.parametrize("kind", ["cpu", "torch-cpu"])
def test_a_failing_microbatch_is_split_in_halves_for_the_run(
    tmp_path: Path, monkeypatch, kind: str
) -> None:
    path = _file(tmp_path)
    _run(path, tmp_path / "clean", kind)
    inject = _fail_allocations(monkeypatch, _graphs(kind), rows_over=8)  # 16 rows never fit
    _run(path, tmp_path / "run", kind)
    assert inject.failures == 2  # the first call and its retry: the split is kept after
    notes = _notes(tmp_path / "run")
    assert (
        "memory: allocation failed in training step again; computing each microbatch in "
        "2 pieces from now on"
    ) in notes
    np.testing.assert_allclose(_losses(tmp_path / "run"), _losses(tmp_path / "clean"), rtol=1e-5)


@pytest.mark.parametrize("kind", ["cpu", "torch-cpu"])
def test_an_evaluation_that_does_not_fit_frees_the_captures_then_splits(
    tmp_path: Path, monkeypatch, kind: str
) -> None:
    # An evaluation runs beside what the step keeps between calls (a CUDA graph's
    # memory): that is freed first, then the eval batch is split, as a microbatch is.
    path = _file(tmp_path)
    _run(path, tmp_path / "clean", kind)
    # A whole eval batch (16 rows) never fits.
    inject = _fail_allocations(monkeypatch, _graphs(kind), rows_over=8, seam="eval_step")
    released = []
    monkeypatch.setattr(_graphs(kind), "release", lambda self: released.append(self))
    _run(path, tmp_path / "run", kind)
    assert inject.failures == 2 and released  # the first call and its retry, after a release
    assert (
        "memory: allocation failed in evaluation again; computing each microbatch in 2 "
        "pieces from now on" in _notes(tmp_path / "run")
    )
    for name in ("eval/loss", "eval/accuracy", "train/loss"):
        np.testing.assert_allclose(
            _losses(tmp_path / "run", name), _losses(tmp_path / "clean", name), rtol=1e-6
        )


def test_evaluations_and_diagnostics_run_in_what_the_step_keeps(
    tmp_path: Path, monkeypatch
) -> None:
    # On a GPU, `beside` draws on the captured step's memory (tests/devices/test_cuda_replay.py).
    import contextlib

    from sexpgpu.devices.cuda.step_graphs import TorchGraphs

    inside, seen = [], []

    @contextlib.contextmanager
    def beside(self):
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    def spy(name):
        call = getattr(TorchGraphs, name)
        monkeypatch.setattr(
            TorchGraphs,
            name,
            lambda self, *a: (seen.append((name, bool(inside))), call(self, *a))[1],
        )

    monkeypatch.setattr(TorchGraphs, "beside", beside)
    spy("eval_step")
    spy("activation_rms")
    _run(_file(tmp_path), tmp_path / "run", "torch-cpu")
    assert ("eval_step", True) in seen and ("activation_rms", True) in seen
    assert all(within for _, within in seen)


def test_nothing_fits_is_e_mem_002_naming_plan_asked_and_free(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from sexpgpu.cli import main
    from sexpgpu.devices.cpu_device import CpuGraphs

    path = _file(tmp_path)
    _fail_allocations(monkeypatch, CpuGraphs, rows_over=0)  # not even one row fits
    code = main(["run", str(path), "--out", str(tmp_path / "run"), "--steps", "2"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert (
        "error[E-MEM-002]: allocation failed in training step after releasing the caches, " in err
    )
    assert "a retry and splitting each microbatch into 16 pieces: asked an unknown amount, " in err
    assert "free; the plan was " in err and "(parameters" in err
    assert "use a smaller :batch or more :microbatches" in err
    assert "internal error" not in err


def test_e_mem_002_reads_what_pytorch_says_was_asked_and_free() -> None:
    from sexpgpu.runtime.memory import MemoryBudget, MemoryPlan
    from sexpgpu.runtime.oom import allocation_error

    torch = pytest.importorskip("torch")
    plan = MemoryPlan(MemoryBudget(_cuda0(), 451 * 2**30, "SEXPGPU_MEMORY"), {"activations": 2**30})
    error = torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
        "139.80 GiB of which 3.12 GiB is free."
    )
    got = allocation_error("training step", error, plan, 1)
    assert got.code == "E-MEM-002"
    assert "asked 20.00 GiB, 3.12 GiB free; the plan was 1.0 GiB of 451.0 GiB" in got.message
    assert "not being possible (the graph does not allow it)" in got.message
    assert got.hint.startswith("SEXPGPU_MEMORY=451.0 GiB plans for more than the device holds")


def _cuda0():
    from sexpgpu.runtime.devices import parse_device

    return parse_device("cuda:0")


def test_explain_prints_the_cuda_plan_for_a_named_card(tmp_path: Path, capsys, monkeypatch) -> None:
    from sexpgpu.cli import main
    from sexpgpu.runtime import devices

    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 0)
    monkeypatch.setenv("SEXPGPU_MEMORY", "40GiB")
    assert main(["explain", str(ROOT / "examples/gpt.lisp"), "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "; device: cuda lowering on no GPU visible" in out
    assert "; pattern: attention x12 from" in out
    assert "; memory: plan " in out and "of 40.0 GiB" in out
    assert "; memory: the live set peaks at" in out
    # examples/gpt.lisp runs 8 microbatches: the stacking the run would choose, before a GPU.
    assert "; stacking 8: the cost model's pick" in out
    assert "; fused: the training graph is compiled on the GPU when a run loads it" in out
    monkeypatch.delenv("SEXPGPU_MEMORY")
    assert main(["explain", str(ROOT / "examples/gpt.lisp"), "--device", "cuda"]) == 1
    assert "error[E-DP-001]: no GPU is visible" in capsys.readouterr().err


def test_a_fused_op_without_a_kernel_runs_decomposed(monkeypatch) -> None:
    import torch

    from sexpgpu.devices.cpu import run
    from sexpgpu.devices.cuda import executor
    from sexpgpu.ir import builder as b
    from sexpgpu.ir.node import Graph
    from sexpgpu.ir.ops import Op

    x = b.input("x", (4, 8), "f32")
    graph = Graph.of({"y": b.layernorm(b.gelu(x), 1e-5)})
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    lowerings = {op: fn for op, fn in executor.LOWERINGS.items() if op is not Op.GELU}
    monkeypatch.setattr(executor, "LOWERINGS", lowerings)
    program = executor.TorchGraph(graph, torch.device("cpu"))
    assert Op.GELU not in {n.op for n in program.order}
    got = program(feeds)["y"].numpy()
    np.testing.assert_allclose(got, run(graph, feeds)["y"], rtol=1e-5, atol=1e-6)
