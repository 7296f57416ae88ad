"""Parameter path names, data field shapes and initializers of traced runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.dtypes import DType
from sexpgpu.ir.trace import trace_run
from sexpgpu.ir.trace_init import Init, draw, param_rng
from sexpgpu.lang import load_experiment, load_experiment_text

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def traced(body: str, head: str = "", loss: str = "(mean (m x))", data: str = "(digits)"):
    text = f"""(defparams (width 4))
(defdata d {data})
{head}
(defmodel m (x) {body})
(defrun r :model m :data d :loss {loss} :optimizer (sgd :lr 0.1) :batch 2 :steps 1)
"""
    experiment = load_experiment_text(text, "names.lisp")
    return trace_run(experiment, experiment.run())


def names(body: str, head: str = "", loss: str = "(mean (m x))") -> list[str]:
    return list(traced(body, head, loss).params)


def test_gpt_example_names() -> None:
    experiment = load_experiment(EXAMPLES / "gpt.lisp", variant="smoke")
    trace = trace_run(experiment, experiment.run())
    block = [
        "layernorm/weight",
        "layernorm/bias",
        *(f"attention/{kind}{p}" for p in "qkvo" for kind in "wb"),
        "layernorm.1/weight",
        "layernorm.1/bias",
        "linear/weight",
        "linear/bias",
        "linear.1/weight",
        "linear.1/bias",
    ]
    want = ["gpt/wte", "gpt/embed/weight"]
    want += [f"gpt/block.{i}/{name}" for i in range(2) for name in block]
    want += ["gpt/layernorm/weight", "gpt/layernorm/bias"]
    assert list(trace.params) == want
    assert trace.params["gpt/block.1/attention/wq"].shape == (128, 128)
    assert trace.params["gpt/block.0/linear/weight"].shape == (128, 512)
    assert trace.params["gpt/wte"].init == Init("normal", (0.02,))
    assert trace.inputs["tokens"].shape == (8, 64)


def test_defn_calls_get_fresh_numbered_parameters() -> None:
    got = names("(+ (f x) (f x))", head="(defn f (x) (linear x 3))")
    assert got == [
        "m/f/linear/weight",
        "m/f/linear/bias",
        "m/f.1/linear/weight",
        "m/f.1/linear/bias",
    ]


def test_repeat_numbers_every_application_and_shares_the_counter() -> None:
    got = names("(-> x f (repeat 2 f))", head="(defn f (x) (linear x 4 :bias false))")
    assert got == ["m/f/linear/weight", "m/f.1/linear/weight", "m/f.2/linear/weight"]
    got = names("(repeat x 2 (linear 64))")
    assert got == ["m/linear.0/weight", "m/linear.0/bias", "m/linear.1/weight", "m/linear.1/bias"]


def test_let_names_a_parameter_it_binds() -> None:
    body = "(let [w (param [64] :init ones) w (param [64])] (+ x w (param [64]) (param [64])))"
    assert names(body) == ["m/w", "m/w.1", "m/param", "m/param.1"]


def test_defn_scoping_is_lexical() -> None:
    with pytest.raises(SexpgpuError) as info:
        traced("(let [secret 2] (f x))", head="(defn f (x) (* x secret))")
    assert info.value.code == "E-TRACE-002"


def test_calling_the_model_twice_reuses_its_parameters() -> None:
    trace = traced("(linear x 3)", loss="(+ (mean (m x)) (mean (m x)))")
    assert list(trace.params) == ["m/linear/weight", "m/linear/bias"]


def test_field_shapes_per_source(tmp_path: Path) -> None:
    assert {k: (v.shape, v.dtype) for k, v in traced("x").inputs.items()} == {
        "x": ((2, 64), DType.F32),
        "y": ((2,), DType.INT32),
    }
    text = """(defdata d (bytes "c.txt") :seq 5)
(defmodel m (tokens) (cast tokens :dtype f32))
(defrun r :model m :data d :loss (mean (m next)) :optimizer (sgd :lr 0.1) :batch 2 :steps 1)"""
    experiment = load_experiment_text(text, "bytes.lisp")
    inputs = trace_run(experiment, experiment.run()).inputs
    assert {k: (v.shape, v.dtype) for k, v in inputs.items()} == {
        "tokens": ((2, 5), DType.INT32),
        "next": ((2, 5), DType.INT32),
    }
    np.savez(tmp_path / "a.npz", x=np.zeros((10, 3, 4), np.float64), y=np.zeros(10, np.int64))
    text = f"""(defdata d (arrays "{tmp_path / "a.npz"}" :fields [x y]))
(defmodel m (x) x)
(defrun r :model m :data d :loss (mean (m x)) :optimizer (sgd :lr 0.1) :batch 3 :steps 1)"""
    experiment = load_experiment_text(text, "arrays.lisp")
    inputs = trace_run(experiment, experiment.run()).inputs
    assert {k: (v.shape, v.dtype) for k, v in inputs.items()} == {
        "x": ((3, 3, 4), DType.F32),
        "y": ((3,), DType.INT32),
    }


def test_missing_npz_is_a_data_error(tmp_path: Path) -> None:
    text = f"""(defdata d (arrays "{tmp_path / "none.npz"}" :fields [x]))
(defmodel m (x) x)
(defrun r :model m :data d :loss (mean (m x)) :optimizer (sgd :lr 0.1) :batch 3 :steps 1)"""
    experiment = load_experiment_text(text, "arrays.lisp")
    with pytest.raises(SexpgpuError) as info:
        trace_run(experiment, experiment.run())
    assert info.value.code == "E-DATA-001"


def test_bf16_runs_cast_parameters_and_float_inputs() -> None:
    text = (EXAMPLES / "mlp.lisp").read_text().replace(":seed 0", ":seed 0 :dtype bf16")
    experiment = load_experiment_text(text, "mlp.lisp")
    trace = trace_run(experiment, experiment.run())
    assert trace.dtype == DType.BF16
    assert trace.loss.dtype == DType.F32 and trace.loss.shape == ()
    assert all(node.dtype == DType.F32 for node in trace.param_nodes.values())


@pytest.mark.parametrize(
    ("init", "check"),
    [
        (Init("zeros"), lambda a: np.all(a == 0)),
        (Init("ones"), lambda a: np.all(a == 1)),
        (Init("normal", (0.5,)), lambda a: abs(a.std() - 0.5) < 0.02 and abs(a.mean()) < 0.02),
        (Init("uniform", (-2.0, 3.0)), lambda a: a.min() >= -2 and a.max() < 3 and a.max() > 2.9),
        (
            Init("xavier"),
            lambda a: (
                np.abs(a).max() <= np.sqrt(6 / 300) and np.abs(a).max() > 0.95 * np.sqrt(6 / 300)
            ),
        ),
    ],
)
def test_initializers(init: Init, check) -> None:
    a = draw(init, (100, 200), param_rng(0, "w"))
    assert a.dtype == np.float32 and a.shape == (100, 200)
    assert check(a)


def test_parameter_streams_depend_on_seed_and_name_only() -> None:
    draw_ = lambda seed, name: draw(Init("normal", (1.0,)), (4,), param_rng(seed, name))  # noqa: E731
    assert np.array_equal(draw_(1, "m/w"), draw_(1, "m/w"))
    assert not np.array_equal(draw_(1, "m/w"), draw_(2, "m/w"))
    assert not np.array_equal(draw_(1, "m/w"), draw_(1, "m/v"))
    assert str(Init("normal", (0.02,))) == "(normal 0.02)" and str(Init("xavier")) == "xavier"
