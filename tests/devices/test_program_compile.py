"""compile_run and the cpu kernels: parameters, inputs, FLOPs, and the interpreter's step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sexpgpu.devices.cpu_device import CpuGraphs
from sexpgpu.ir.compile import compile_run
from sexpgpu.lang import load_experiment_text

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MLP = (EXAMPLES / "mlp.lisp").read_text()


def mlp_program(dtype: str = "f32", batch: int = 64):
    text = MLP.replace(":seed 0", f":seed 0 :dtype {dtype}").replace(
        "(batch 64)", f"(batch {batch})"
    )
    experiment = load_experiment_text(text, "mlp.lisp")
    return compile_run(experiment, experiment.run())


def mlp_kernels(dtype: str = "f32", batch: int = 64) -> CpuGraphs:
    return CpuGraphs(mlp_program(dtype, batch))


def digits_batch(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.random((batch, 64), dtype=np.float32),
        "y": rng.integers(0, 10, batch).astype(np.int32),
    }


def test_params_inputs_and_decay() -> None:
    program = mlp_program()
    assert {name: (info.shape, info.decay) for name, info in program.params.items()} == {
        "mlp/linear/weight": ((64, 128), True),
        "mlp/linear/bias": ((128,), False),
        "mlp/linear.1/weight": ((128, 10), True),
        "mlp/linear.1/bias": ((10,), False),
    }
    assert all(info.dtype == "f32" for info in program.params.values())
    assert program.inputs == {"x": ((64, 64), "f32"), "y": ((64,), "int32")}
    assert program.param_count == 64 * 128 + 128 + 128 * 10 + 10


def test_init_params_is_deterministic_float32() -> None:
    program = mlp_program()
    a, b, c = program.init_params(3), program.init_params(3), program.init_params(4)
    for name, info in program.params.items():
        assert a[name].dtype == np.float32 and a[name].shape == info.shape
        assert np.array_equal(a[name], b[name])
    assert not np.array_equal(a["mlp/linear/weight"], c["mlp/linear/weight"])
    assert not a["mlp/linear/bias"].any()


def test_flops_count_forward_and_backward_products() -> None:
    program = mlp_program()
    forward = 2 * 64 * (64 * 128 + 128 * 10)
    # backward: both weight gradients, and the hidden layer's input gradient
    # (the data needs none)
    assert program.flops_per_step == 2 * forward + 2 * 64 * 10 * 128


def test_train_step_gives_the_loss_and_float32_gradients() -> None:
    program = mlp_kernels()
    params = program.init_params(0)
    loss, grads = program.train_step(params, digits_batch(64))
    assert isinstance(loss, float) and 1.5 < loss < 3.5
    assert set(grads) == set(program.params)
    for name, g in grads.items():
        assert g.dtype == np.float32 and g.shape == program.params[name].shape
    assert program.planned_peak_bytes >= 4 * program.compiled.param_count
    assert 0 < program.last_peak_bytes <= 2 * program.planned_peak_bytes


def test_gradient_matches_finite_differences() -> None:
    program = mlp_kernels(batch=4)
    params = program.init_params(1)
    batch = digits_batch(4, seed=2)
    _, grads = program.train_step(params, batch)
    rng = np.random.default_rng(0)
    # a unit direction with a sizeable slope: the gradient's, perturbed
    direction = {k: grads[k] + 0.1 * rng.normal(size=v.shape) for k, v in params.items()}
    norm = np.sqrt(sum(float((d * d).sum()) for d in direction.values()))
    direction = {k: (d / norm).astype(np.float32) for k, d in direction.items()}
    eps = 1e-2

    def loss_at(t: float) -> float:
        moved = {k: (v + t * direction[k]).astype(np.float32) for k, v in params.items()}
        return program.eval_step(moved, batch)[0]

    numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    analytic = sum(float((grads[k] * direction[k]).sum()) for k in params)
    assert numeric == pytest.approx(analytic, rel=2e-2)


def test_eval_step_gives_the_models_output() -> None:
    program = mlp_kernels(batch=8)
    params = program.init_params(0)
    batch = digits_batch(8)
    loss, logits = program.eval_step(params, batch)
    assert logits.shape == (8, 10) and logits.dtype == np.float32
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    assert loss == pytest.approx(-logp[np.arange(8), batch["y"]].mean(), rel=1e-5)
    assert loss == pytest.approx(program.train_step(params, batch)[0], rel=1e-6)


def test_bf16_run_is_close_to_f32_with_f32_gradients() -> None:
    f32, bf16 = mlp_kernels("f32"), mlp_kernels("bf16")
    params, batch = f32.init_params(0), digits_batch(64)
    loss32, grads32 = f32.train_step(params, batch)
    loss16, grads16 = bf16.train_step(params, batch)
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    for name, g in grads16.items():
        assert g.dtype == np.float32
        scale = np.abs(grads32[name]).max()
        assert np.abs(g - grads32[name]).max() <= 0.05 * scale + 1e-6


def test_sgd_on_the_program_lowers_the_loss() -> None:
    program = mlp_kernels(batch=32)
    params = program.init_params(0)
    batch = digits_batch(32)
    first, _ = program.train_step(params, batch)
    for _ in range(30):
        loss, grads = program.train_step(params, batch)
        params = {k: v - np.float32(0.5) * grads[k] for k, v in params.items()}
    assert loss < 0.5 * first


def test_gpt_flops_follow_the_model_flops_formula() -> None:
    text = (EXAMPLES / "gpt.lisp").read_text()
    text += "(defvariant tiny (layers 2) (width 32) (heads 4) (seq 16) (vocab 64) (batch 3))"
    text = text.replace('(dtype "bf16")', '(dtype "f32")')
    experiment = load_experiment_text(text, "gpt.lisp", variant="tiny")
    program = compile_run(experiment, experiment.run())
    rows, layers, w, s, v = 3 * 16, 2, 32, 16, 64
    dense = layers * (4 * w * w + 2 * w * 4 * w) + w * v  # multiply-adds per row
    attention = layers * s * w  # q k^T and w v, multiply-adds per row (each counted once)
    # forward 2 FLOPs per multiply-add; backward twice the forward
    assert program.flops_per_step == 3 * 2 * rows * dense + 3 * 2 * 2 * rows * attention


def test_activation_rms_of_every_call() -> None:
    program = mlp_kernels(batch=8)
    params, batch = program.init_params(0), digits_batch(8)
    rms = program.activation_rms(params, batch)
    hidden = batch["x"] @ params["mlp/linear/weight"] + params["mlp/linear/bias"]
    logits = np.maximum(hidden, 0) @ params["mlp/linear.1/weight"] + params["mlp/linear.1/bias"]
    want = {
        "mlp/linear": np.sqrt(np.mean(hidden**2)),
        "mlp/linear.1": np.sqrt(np.mean(logits**2)),
        "mlp": np.sqrt(np.mean(logits**2)),
    }
    assert rms.keys() == want.keys()
    for name, value in want.items():
        assert rms[name] == pytest.approx(value, rel=1e-5)
