"""With :dtype bf16 the losses and their sums are f32, so logged losses are not bf16-quantized."""

import numpy as np
import pytest

from sexpgpu.ir.compile import compile_run
from sexpgpu.lang import load_experiment_text

TEXT = """
(defdata d (arrays "d.npz" :fields [x y t]))
(defmodel m (x) (-> x (linear 4)))
(defrun r :model m :data d :loss LOSS :optimizer (sgd :lr 0.1) :batch 4 :steps 1 :dtype bf16)
"""


@pytest.mark.parametrize("loss", ["(mse (m x) y)", "(cross-entropy (m x) t)"])
def test_bf16_losses_are_f32(tmp_path, loss):
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "d.npz",
        x=rng.random((16, 3), np.float32),
        y=rng.random((16, 4), np.float32),
        t=rng.integers(0, 4, 16).astype(np.int32),
    )
    experiment = load_experiment_text(TEXT.replace("LOSS", loss), "l.lisp", base_dir=tmp_path)
    compiled = compile_run(experiment, experiment.run())
    assert compiled.train_graph.outputs["loss"].dtype == "f32"
    assert compiled.eval_graph.outputs["loss"].dtype == "f32"
