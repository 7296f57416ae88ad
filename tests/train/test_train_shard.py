"""Optimizer states sharded over ranks (ZeRO stage 1): bitwise an unsharded run, on every path.

Simulated cpu ranks through ``sexpgpu run``'s library side, for each optimizer
and across a resume in either direction; the cuda lowering on PyTorch's CPU
device; the plan's choice; loopback nodes live in test_train_nodes.py.
"""

import numpy as np
import pytest
from mlp_experiment import mlp_text
from run_reference import series

from sexpgpu.train import run_experiment
from sexpgpu.train.metrics import read_metrics

OPTIMIZERS = {
    "adamw": None,  # the experiment's own
    "sgd": "(sgd :lr 0.05 :momentum 0.9 :nesterov true)",
    "muon": "(muon :lr 0.1 :adamw-lr 1e-2 :weight-decay 0.1)",
}
ADAMW = "(adamw :lr 1e-2 :betas [0.9 0.95] :weight-decay 0.1)"


def _experiment(tmp_path, optimizer=None, microbatches=4):
    text = mlp_text(hidden=16, steps=6, every=3).replace(
        "(microbatches 2)", f"(microbatches {microbatches})"
    )
    text = text.replace(":seed 3", ":seed 3\n  :diagnostics ((grad-norm :every 1 :reduce max))")
    if optimizer is not None:
        text = text.replace(ADAMW, optimizer)
    path = tmp_path / "mlp.lisp"
    path.write_text(text)
    return str(path)


def _run(path, out, ranks, shard, **kw):
    environ = {
        "SEXPGPU_DEVICES": ",".join(map(str, range(ranks))),
        "SEXPGPU_SHARD_OPTIMIZER": shard,
    }
    return run_experiment(path, out=out, environ=environ, **kw)


def _notes(run_dir):
    return [
        r["value"] for r in read_metrics(run_dir / "metrics.jsonl") if r["name"] == "annotation"
    ]


def _same_checkpoints(a, b, steps=("step-3", "step-6")):
    """Both runs' checkpoints are the same files, byte for byte (state.json and all)."""
    for step in steps:
        for file in sorted((a / "checkpoints" / step).iterdir()):
            other = b / "checkpoints" / step / file.name
            assert file.read_bytes() == other.read_bytes(), (step, file.name)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sharded_states_train_bitwise_like_every_rank_keeping_all(tmp_path, optimizer, ranks):
    path = _experiment(tmp_path, OPTIMIZERS[optimizer])
    whole = _run(path, tmp_path / "whole", ranks, "0")
    shard = _run(path, tmp_path / "shard", ranks, "1")
    for k in whole.params:
        assert np.array_equal(whole.params[k], shard.params[k]), k
    for name in ("train/loss", "train/grad_norm", "diag/grad-norm"):
        assert series(tmp_path / "whole", name) == series(tmp_path / "shard", name), name
    _same_checkpoints(tmp_path / "whole", tmp_path / "shard")
    line = f"optimizer states: sharded over {ranks} ranks (SEXPGPU_SHARD_OPTIMIZER=1)"
    assert line in _notes(tmp_path / "shard")
    assert not [n for n in _notes(tmp_path / "whole") if n.startswith("optimizer states")]


@pytest.mark.parametrize("first, then", [("1", "0"), ("0", "1"), ("1", "1")])
def test_a_resume_crosses_between_sharded_and_whole_states(tmp_path, first, then):
    path = _experiment(tmp_path, microbatches=2)
    straight = _run(path, tmp_path / "straight", 2, "0")
    _run(path, tmp_path / "first", 2, first)
    step3 = tmp_path / "first" / "checkpoints" / "step-3"
    resumed = _run(path, tmp_path / "resumed", 2, then, resume=str(step3))
    assert resumed.resumed_from == 3
    for k in straight.params:
        assert np.array_equal(straight.params[k], resumed.params[k]), k
    assert series(tmp_path / "straight", "train/loss") == series(tmp_path / "resumed", "train/loss")
    _same_checkpoints(tmp_path / "straight", tmp_path / "resumed", steps=("step-6",))


def test_the_cuda_lowering_shards_as_it_keeps_all(tmp_path):
    pytest.importorskip("torch")
    from device_seam import device_named

    from sexpgpu.devices.cuda.device import CudaDevice

    path = _experiment(tmp_path, microbatches=2)
    with device_named("cpu", CudaDevice("cpu")):
        whole = _run(path, tmp_path / "whole", 2, "0")
        shard = _run(path, tmp_path / "shard", 2, "1")
    for k in whole.params:
        assert np.array_equal(whole.params[k], shard.params[k]), k
    assert series(tmp_path / "whole", "train/loss") == series(tmp_path / "shard", "train/loss")
    _same_checkpoints(tmp_path / "whole", tmp_path / "shard")
