"""Dropout's masks: one function of the seed, the microbatch and the position, wherever it runs.

The same run gives the same masks at every rank count, at every stacking
degree, after a resume, and on the cuda lowering (here on PyTorch's CPU
device, tests/devices/test_cuda_lowering.py); evaluation never drops.
"""

import numpy as np
import pytest
from run_reference import series

from sexpgpu.devices.cpu import run
from sexpgpu.ir.compile import compile_run
from sexpgpu.ir.counter_rng import KEY_FIELD, microbatch_key
from sexpgpu.ir.ops import Op
from sexpgpu.ir.stack import stack_microbatches
from sexpgpu.lang import load_experiment_text
from sexpgpu.train import load_checkpoint, run_experiment
from sexpgpu.train.data import make_loader

TEXT = """
(defparams (p 0.5) (steps 6) (microbatches 4))
(defdata digits (digits) :split 0.9)
(defmodel mlp (x) (-> x (linear 32) tanh (dropout :p p) (linear 10) (dropout :p 0.25)))
(defrun train
  :model mlp
  :data digits
  :loss (cross-entropy (mlp x) y)
  :optimizer (adamw :lr 1e-2 :betas [0.9 0.95] :weight-decay 0.1)
  :schedule (constant)
  :batch 8
  :microbatches microbatches
  :steps steps
  :seed 3
  :eval (every 3 :batches 2)
  :checkpoint (every 3 "checkpoints"))
"""


def _write(tmp_path, text=TEXT, name="drop.lisp"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _compiled(text=TEXT):
    experiment = load_experiment_text(text, "drop.lisp")
    return compile_run(experiment, experiment.run())


def test_training_draws_masks_and_evaluation_is_the_identity():
    compiled = _compiled()
    assert KEY_FIELD in compiled.train_graph.inputs
    assert sum(n.op is Op.UNIFORM for n in compiled.train_graph.nodes()) == 2
    assert KEY_FIELD not in compiled.eval_graph.inputs
    assert not any(n.op is Op.UNIFORM for n in compiled.eval_graph.nodes())
    assert not any(n.op is Op.UNIFORM for n in compiled.activation_graph.nodes())
    plain = _compiled(TEXT.replace("(p 0.5)", "(p 0.0)").replace(":p 0.25", ":p 0.0"))
    assert KEY_FIELD not in plain.train_graph.inputs  # p = 0 draws nothing
    # The evaluation graphs agree: dropout does not reach them.
    params = compiled.init_params(seed=1)
    loader = make_loader(compiled_data(), batch=8, seed=3)
    (batch,) = loader.eval_batches(1)
    feeds = params | batch
    assert run(compiled.eval_graph, feeds)["loss"] == run(plain.eval_graph, feeds)["loss"]


def compiled_data():
    experiment = load_experiment_text(TEXT, "drop.lisp")
    return experiment.data[experiment.run().data]


def _train_outputs(compiled, batch, key):
    feeds = compiled.init_params(seed=1) | batch | {KEY_FIELD: key}
    return run(compiled.train_graph, feeds)


def test_masks_follow_the_key_and_a_key_gives_one_mask():
    compiled = _compiled()
    (batch,) = make_loader(compiled_data(), batch=8, seed=3).next_step()
    a = _train_outputs(compiled, batch, microbatch_key(3, 0))
    again = _train_outputs(compiled, batch, microbatch_key(3, 0))
    other = _train_outputs(compiled, batch, microbatch_key(3, 1))
    assert all(np.array_equal(a[k], again[k]) for k in a)
    assert a["loss"] != other["loss"]


@pytest.mark.parametrize("k", [2, 3])
def test_every_stacking_degree_draws_each_microbatchs_own_mask(k):
    compiled = _compiled()
    loader = make_loader(compiled_data(), batch=8, microbatches=k, seed=3)
    batches = loader.next_step()
    assert [b[KEY_FIELD] for b in batches] == [microbatch_key(3, g) for g in range(k)]
    params = compiled.init_params(seed=1)
    alone = [run(compiled.train_graph, params | b) for b in batches]
    stacked_graph = stack_microbatches(compiled.train_graph, k)
    stacked = {name: np.stack([b[name] for b in batches]) for name in batches[0]}
    together = run(stacked_graph, params | stacked)
    for name, value in together.items():
        np.testing.assert_allclose(
            value, sum(one[name] for one in alone), rtol=1e-5, atol=1e-7, err_msg=name
        )


@pytest.mark.parametrize("devices", ["0,1", "0,1,2,3"])
def test_any_rank_count_trains_like_one_rank(tmp_path, monkeypatch, devices):
    ranks = len(devices.split(","))
    keys = [
        b[KEY_FIELD]
        for rank in range(ranks)
        for b in make_loader(
            compiled_data(), batch=8, microbatches=4, seed=3, rank=rank, ranks=ranks
        ).next_step()
    ]
    assert keys == [microbatch_key(3, g) for g in range(4)]  # the global microbatch's key
    path = _write(tmp_path)
    monkeypatch.delenv("SEXPGPU_DEVICES", raising=False)
    one = run_experiment(path, out=tmp_path / "one")
    monkeypatch.setenv("SEXPGPU_DEVICES", devices)
    many = run_experiment(path, out=tmp_path / "many")
    for name in one.params:
        np.testing.assert_allclose(many.params[name], one.params[name], rtol=1e-5, atol=1e-7)
    a, b = series(tmp_path / "one", "train/loss"), series(tmp_path / "many", "train/loss")
    np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)], rtol=1e-6)


def test_a_resume_draws_the_uninterrupted_runs_masks(tmp_path, monkeypatch):
    monkeypatch.delenv("SEXPGPU_DEVICES", raising=False)
    path = _write(tmp_path)
    whole = run_experiment(path, out=tmp_path / "whole")
    run_experiment(path, out=tmp_path / "resumed", steps=3)
    resumed = run_experiment(path, out=tmp_path / "resumed", resume="latest")
    assert resumed.resumed_from == 3
    for name in whole.params:
        assert np.array_equal(whole.params[name], resumed.params[name]), name
    assert load_checkpoint(tmp_path / "whole" / "checkpoints").step == 6
