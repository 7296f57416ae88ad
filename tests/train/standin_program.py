"""Small NumPy graphs that follow the `StepGraphs` contract of `sexpgpu.devices.state`.

For the run-loop tests.

They stand in for `compile_run` so that the loop, optimizers and checkpoints
are tested on their own: an MLP classifier (fields ``x``, ``y``) and a bigram
language model (fields ``tokens``, ``next``), each with hand-written gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sexpgpu.devices.state import SummingGraphs, TrainState
from sexpgpu.lang import DataDef, load_experiment_text


def on_cpu(graphs) -> TrainState:
    """A stand-in's `Program`: its state in NumPy arrays, as the cpu device keeps it."""
    return TrainState(graphs)


@dataclass(frozen=True)
class ParamInfo:
    shape: tuple[int, ...]
    dtype: str = "f32"
    init: str = "normal"
    decay: bool = True
    hidden: bool = False  # what muon orthogonalizes (`sexpgpu.ir.compile.hidden_matrices`)


def defdata(name: str, source: str, **keys: Any) -> DataDef:
    """The `DataDef` the language reads from ``(defdata NAME SOURCE :key value...)``.

    `source` is the source call as written (``"(digits)"``, ``'(bytes "/tmp/t.txt")'``);
    every option the keys leave out takes the language's default.
    """
    written = " ".join(f":{key} {value}" for key, value in keys.items())
    return load_experiment_text(f"(defdata {name} {source} {written})").data[name]


def _softmax_xent(logits: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy over rows and its gradient with respect to the logits."""
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    rows = target.size
    flat = p.reshape(rows, -1)
    loss = -np.mean(np.log(flat[np.arange(rows), target.ravel()]))
    grad = flat.copy()
    grad[np.arange(rows), target.ravel()] -= 1.0
    return float(loss), (grad / rows).reshape(p.shape).astype(np.float32)


class Mlp(SummingGraphs):
    """logits = tanh(x @ w1 + b1) @ w2 + b2; cross-entropy with y."""

    has_activations = False

    def __init__(self, features: int = 64, hidden: int = 32, classes: int = 10, batch: int = 16):
        self.params = {
            "mlp/w1": ParamInfo((features, hidden), hidden=True),
            "mlp/b1": ParamInfo((hidden,), decay=False),
            "mlp/w2": ParamInfo((hidden, classes)),
            "mlp/b2": ParamInfo((classes,), decay=False),
        }
        self.inputs = {"x": ((batch, features), "float32"), "y": ((batch,), "int32")}
        self.planned_peak_bytes = 4096
        self.last_peak_bytes = 0
        self.flops_per_step = 6 * batch * (features * hidden + hidden * classes)

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        out = {}
        for k, info in self.params.items():
            if len(info.shape) == 1:
                out[k] = np.zeros(info.shape, np.float32)
            else:
                std = 1.0 / np.sqrt(info.shape[0])
                out[k] = (rng.standard_normal(info.shape) * std).astype(np.float32)
        return out

    def _forward(self, p: dict[str, np.ndarray], x: np.ndarray):
        h = np.tanh(x @ p["mlp/w1"] + p["mlp/b1"])
        return h, h @ p["mlp/w2"] + p["mlp/b2"]

    def train_step(self, p, batch):
        x, y = batch["x"], batch["y"]
        h, logits = self._forward(p, x)
        loss, dlogits = _softmax_xent(logits, y)
        dh = (dlogits @ p["mlp/w2"].T) * (1 - h * h)
        grads = {
            "mlp/w2": h.T @ dlogits,
            "mlp/b2": dlogits.sum(0),
            "mlp/w1": x.T @ dh,
            "mlp/b1": dh.sum(0),
        }
        self.last_peak_bytes = h.nbytes + logits.nbytes * 2
        return loss, {k: v.astype(np.float32) for k, v in grads.items()}

    def eval_step(self, p, batch):
        _, logits = self._forward(p, batch["x"])
        loss, _ = _softmax_xent(logits, batch["y"])
        return loss, logits


class Bigram(SummingGraphs):
    """logits = table[tokens]; cross-entropy with next."""

    has_activations = False

    def __init__(self, vocab: int = 256, batch: int = 4, seq: int = 16):
        self.params = {"bigram/table": ParamInfo((vocab, vocab))}
        self.inputs = {"tokens": ((batch, seq), "int32"), "next": ((batch, seq), "int32")}
        self.planned_peak_bytes = 1 << 20
        self.last_peak_bytes = 0
        self.flops_per_step = 0
        self.vocab = vocab

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        table = rng.standard_normal((self.vocab, self.vocab)) * 0.02
        return {"bigram/table": table.astype(np.float32)}

    def train_step(self, p, batch):
        table = p["bigram/table"]
        logits = table[batch["tokens"]]  # (B, S, V)
        loss, dlogits = _softmax_xent(logits, batch["next"])
        grad = np.zeros_like(table)
        np.add.at(grad, batch["tokens"].ravel(), dlogits.reshape(-1, self.vocab))
        self.last_peak_bytes = logits.nbytes * 2
        return loss, {"bigram/table": grad}

    def eval_step(self, p, batch):
        logits = p["bigram/table"][batch["tokens"]]
        loss, _ = _softmax_xent(logits, batch["next"])
        return loss, logits
