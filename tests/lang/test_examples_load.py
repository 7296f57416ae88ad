from pathlib import Path

import pytest

from sexpgpu.lang import load_experiment

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["gpt.lisp", "llama.lisp", "mlp.lisp"])
def test_examples_load(name):
    experiment = load_experiment(EXAMPLES / name)
    assert experiment.run().name == "train"


def test_gpt_smoke_variant():
    experiment = load_experiment(EXAMPLES / "gpt.lisp", variant="smoke")
    assert experiment.params["layers"] == 2
    run = experiment.run()
    assert (run.batch, run.microbatches, run.dtype) == (8, 1, "f32")
    assert experiment.data["text"].options["seq"] == 64


def test_llama_smoke_variant_trains_on_the_cpu(tmp_path):
    from sexpgpu.train import run_experiment

    summary = run_experiment(
        EXAMPLES / "llama.lisp", variant="smoke", steps=3, out=tmp_path / "run", device="cpu"
    )
    assert summary.step == 3 and summary.loss is not None and summary.loss < 6.0
    names = set(summary.params)
    assert "llama/block.1/attention/wk" in names and "llama/linear/weight" in names  # the head
    assert not any("/attention/b" in n or n.endswith("/bias") for n in names)  # no biases
    assert summary.params["llama/block.0/attention/wk"].shape == (128, 64)  # 2 of 4 heads
