"""The language's GPT, Llama and MLP (the examples' models) equal the same models in PyTorch.

sexpgpu's initial parameters are copied into `torch.nn` twins by path name
(tests/ir/torch_reference.py); the loss and every parameter's gradient must
agree to 1e-5 relative in float32, and so must a few plain SGD steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from sexpgpu.devices.cpu_device import CpuGraphs
from sexpgpu.ir.compile import compile_run
from sexpgpu.lang import load_experiment_text

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent / "ir"))
from torch_reference import TorchGPT, TorchLlama, TorchMLP, load_named, named_grads  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RTOL = 1e-5

GPT_VARIANT = """
(defvariant tiny (layers 2) (width 32) (heads 4) (seq 16) (vocab 64) (batch 3) (dtype "f32"))
"""
MLP_VARIANT = "\n(defvariant tiny (hidden 16) (batch 5))\n"
LLAMA_VARIANT = """
(defvariant tiny (layers 2) (width 32) (heads 4) (kv-heads 2) (ffn 48) (seq 16) (vocab 64)
  (batch 3) (dtype "f32"))
"""


def _program(example: str, variant_text: str):
    text = (EXAMPLES / example).read_text() + variant_text
    experiment = load_experiment_text(text, example, variant="tiny")
    return CpuGraphs(compile_run(experiment, experiment.run()))


def _close(name: str, got: np.ndarray, want: np.ndarray, floor: float = 0.0) -> None:
    """Max error within RTOL of the reference's largest magnitude (at least `floor`)."""
    scale = max(float(np.max(np.abs(want))), floor, 1e-30)
    err = float(np.max(np.abs(got.astype(np.float64) - want)))
    assert err <= RTOL * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


def _compare(program, model, batch, to_torch, steps: int = 3, lr: float = 0.1) -> None:
    params = program.init_params(seed=7)
    for _ in range(steps):
        loss, grads = program.train_step(params, batch)
        load_named(model, params)
        model.zero_grad()
        ref = model.loss(*to_torch(batch))
        ref.backward()
        assert abs(loss - ref.item()) <= RTOL * abs(ref.item()), (loss, ref.item())
        ref_grads = named_grads(model)
        assert set(grads) == set(ref_grads)
        # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift
        # shared by a query's scores): both sides give rounding noise, so errors are
        # measured against a thousandth of the largest gradient at the least.
        floor = 1e-3 * max(float(np.max(np.abs(g))) for g in ref_grads.values())
        for name in grads:
            _close(name, grads[name], ref_grads[name], floor)
        params = {k: (v - lr * grads[k]).astype(np.float32) for k, v in params.items()}


def test_gpt_loss_and_gradients_equal_torch() -> None:
    program = _program("gpt.lisp", GPT_VARIANT)
    assert program.compiled.inputs == {"tokens": ((3, 16), "int32"), "next": ((3, 16), "int32")}
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 64, (3, 17)).astype(np.int32)
    batch = {"tokens": tokens[:, :-1], "next": tokens[:, 1:]}
    model = TorchGPT(layers=2, width=32, heads=4, seq=16, vocab=64)

    def to_torch(batch):
        return torch.from_numpy(batch["tokens"]).long(), torch.from_numpy(batch["next"]).long()

    _compare(program, model, batch, to_torch)


def _tokens(seed: int, batch: int = 3, seq: int = 16) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, 64, (batch, seq + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "next": tokens[:, 1:]}


def _token_pair(batch):
    return torch.from_numpy(batch["tokens"]).long(), torch.from_numpy(batch["next"]).long()


def test_llama_loss_and_gradients_equal_torch() -> None:
    program = _program("llama.lisp", LLAMA_VARIANT)
    ops = {node.op.label for node in program.compiled.train_graph.nodes()}
    assert {"attention", "attention-grad"} <= ops
    model = TorchLlama(layers=2, width=32, heads=4, kv_heads=2, ffn=48, seq=16, vocab=64)
    _compare(program, model, _tokens(6), _token_pair)


def test_mlp_loss_and_gradients_equal_torch() -> None:
    program = _program("mlp.lisp", MLP_VARIANT)
    assert program.compiled.inputs == {"x": ((5, 64), "f32"), "y": ((5,), "int32")}
    rng = np.random.default_rng(4)
    batch = {"x": rng.random((5, 64), dtype=np.float32), "y": rng.integers(0, 10, 5, np.int32)}
    model = TorchMLP(64, 16, 10)

    def to_torch(batch):
        return torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"]).long()

    _compare(program, model, batch, to_torch)


def test_gpt_eval_step_gives_logits_of_torch() -> None:
    program = _program("gpt.lisp", GPT_VARIANT)
    params = program.init_params(seed=1)
    rng = np.random.default_rng(5)
    batch = {"tokens": rng.integers(0, 64, (3, 16), np.int32)}
    batch["next"] = batch["tokens"]
    loss, logits = program.eval_step(params, batch)
    model = TorchGPT(layers=2, width=32, heads=4, seq=16, vocab=64)
    load_named(model, params)
    ids = torch.from_numpy(batch["tokens"]).long()
    with torch.no_grad():
        ref = model(ids).double().numpy()
        ref_loss = model.loss(ids, ids).item()
    assert abs(loss - ref_loss) <= RTOL * ref_loss
    assert logits.shape == (3, 16, 64) and logits.dtype == np.float32
    _close("logits", logits, ref)
