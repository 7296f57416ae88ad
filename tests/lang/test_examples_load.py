from pathlib import Path

import pytest

from sexpgpu.lang import load_experiment

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["gpt.lisp", "mlp.lisp"])
def test_examples_load(name):
    experiment = load_experiment(EXAMPLES / name)
    assert experiment.run().name == "train"


def test_gpt_smoke_variant():
    experiment = load_experiment(EXAMPLES / "gpt.lisp", variant="smoke")
    assert experiment.params["layers"] == 2
    run = experiment.run()
    assert (run.batch, run.microbatches, run.dtype) == (8, 1, "f32")
    assert experiment.data["text"].options["seq"] == 64
