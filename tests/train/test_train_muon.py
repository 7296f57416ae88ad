"""`muon` through whole runs: it trains, it resumes bit for bit, and the cuda lowering agrees."""

from __future__ import annotations

import numpy as np
import pytest
from mlp_experiment import mlp_text
from run_reference import series

from sexpgpu.train import load_checkpoint, run_experiment

# The digits MLP's one hidden matrix is small: Muon's default rate (0.02) is slow there.
MUON = "(muon :lr 0.1 :adamw-lr 1e-2 :weight-decay 0.1)"


def _experiment(tmp_path, steps: int = 10, schedule: str = "(cosine :warmup 3 :floor 0.1)"):
    text = mlp_text(steps=steps).replace(
        "(adamw :lr 1e-2 :betas [0.9 0.95] :weight-decay 0.1)", MUON
    )
    path = tmp_path / "muon.lisp"
    path.write_text(text.replace("(cosine :warmup 3 :floor 0.1)", schedule))
    return path


def test_muon_trains_the_mlp(tmp_path):
    path = _experiment(tmp_path, steps=40)
    run_experiment(path, out=tmp_path / "run")
    losses = series(tmp_path / "run", "train/loss")
    first, last = (
        np.mean([losses[s] for s in (1, 2, 3)]),
        np.mean([losses[s] for s in (38, 39, 40)]),
    )
    assert last < 0.35 * first, (first, last)
    state = load_checkpoint(tmp_path / "run" / "checkpoints")
    # The hidden layer's weight keeps momentum; the head and the biases AdamW's moments.
    assert sorted(state.optimizer) == sorted(
        [
            "momentum/mlp/linear/weight",
            *(f"{m}/mlp/{k}" for m in ("exp_avg", "exp_avg_sq")
              for k in ("linear/bias", "linear.1/weight", "linear.1/bias")),
        ]
    )  # fmt: skip
    assert state.state["optimizer"]["name"] == "muon" and state.state["optimizer"]["steps"] == 40


def test_muon_resumed_from_a_checkpoint_equals_the_run_straight_through(tmp_path):
    path = _experiment(tmp_path, schedule="(constant)")
    run_experiment(path, out=tmp_path / "a", steps=10)
    run_experiment(path, out=tmp_path / "a", steps=20, resume="latest")
    run_experiment(path, out=tmp_path / "b", steps=20)
    one = load_checkpoint(tmp_path / "a" / "checkpoints")
    two = load_checkpoint(tmp_path / "b" / "checkpoints")
    assert one.step == two.step == 20
    for k in two.params:
        assert np.array_equal(one.params[k], two.params[k])
    assert sorted(one.optimizer) == sorted(two.optimizer)
    for k in two.optimizer:
        assert np.array_equal(one.optimizer[k], two.optimizer[k])
    assert series(tmp_path / "a", "train/loss") == series(tmp_path / "b", "train/loss")


def test_the_cuda_lowering_trains_muon_as_the_cpu_device(tmp_path):
    pytest.importorskip("torch")
    from device_seam import device_named

    from sexpgpu.devices.cuda.device import CudaDevice

    path = _experiment(tmp_path)
    run_experiment(path, out=tmp_path / "cpu")
    with device_named("cpu", CudaDevice("cpu")):
        run_experiment(path, out=tmp_path / "torch")
    cpu, torch_cpu = (series(tmp_path / d, "train/loss") for d in ("cpu", "torch"))
    assert sorted(cpu) == sorted(torch_cpu) == list(range(1, 11))
    np.testing.assert_allclose([torch_cpu[s] for s in cpu], [cpu[s] for s in cpu], rtol=1e-4)
