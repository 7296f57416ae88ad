import json

import numpy as np
import pytest
from run_reference import series, torch_mlp_losses
from standin_program import Bigram, Mlp, defdata, on_cpu

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang.definitions import DiagnosticSpec
from sexpgpu.lang.runs import optimizer_spec, schedule_spec
from sexpgpu.runtime.memory import MemoryPlan, detect_budget
from sexpgpu.train.data import make_loader
from sexpgpu.train.loop import Trainer
from sexpgpu.train.metrics import read_metrics
from sexpgpu.train.schedules import make_schedule
from sexpgpu.train.settings import RunSettings

DIGITS = defdata("digits", "(digits)")
ADAMW = optimizer_spec("adamw", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _settings(**kw):
    base = dict(steps=10, batch=16, microbatches=2, seed=3, optimizer=ADAMW)
    base |= dict(schedule=schedule_spec("cosine", warmup=3, floor=0.1), clip=0.5)
    return RunSettings(**(base | kw))


def _trainer(tmp_path, settings, devices=("cpu:0",), name="run", **kw):
    return Trainer(
        lambda rank: on_cpu(Mlp(batch=settings.batch)),
        DIGITS,
        settings,
        tmp_path / name,
        experiment_hash="hash-1",
        devices=devices,
        target="y",
        plan=MemoryPlan(detect_budget("cpu"), {"activations": Mlp().planned_peak_bytes}),
        **kw,
    )


def test_ten_step_losses_equal_pytorch_adamw(tmp_path):
    """Golden trajectory: the same MLP, init, batches, clip and schedule in PyTorch."""
    s = _settings()
    trainer = _trainer(tmp_path, s)
    trainer.run()
    ours = series(trainer.run_dir, "train/loss")

    init = Mlp(batch=s.batch).init_params(s.seed)
    loader = make_loader(DIGITS, batch=s.batch, microbatches=2, seed=s.seed)
    lr = make_schedule(s.schedule, 1e-2, s.steps)
    ref = torch_mlp_losses([init[f"mlp/{k}"] for k in ("w1", "b1", "w2", "b2")], loader, lr, 10)
    assert sorted(ours) == list(range(1, 11))
    np.testing.assert_allclose([ours[i] for i in range(1, 11)], ref, rtol=0, atol=1e-5)
    assert ref[-1] < ref[0] - 0.3  # it learns: the comparison is not of constants


def test_resume_continues_bit_for_bit(tmp_path):
    ck = {"checkpoint_every": 3, "checkpoint_location": "checkpoints"}
    const = schedule_spec("constant")
    whole = _trainer(tmp_path, _settings(steps=12, schedule=const, **ck), name="whole").run()
    _trainer(tmp_path, _settings(steps=6, schedule=const, **ck), name="split").run()
    resumed = _trainer(
        tmp_path, _settings(steps=12, schedule=const, **ck), name="split", resume="latest"
    ).run()
    assert resumed.resumed_from == 6
    for k in whole.params:
        assert np.array_equal(whole.params[k], resumed.params[k])
    a, b = series(tmp_path / "whole", "train/loss"), series(tmp_path / "split", "train/loss")
    assert a == b and len(a) == 12


def test_two_simulated_ranks_train_like_one(tmp_path):
    s = _settings(microbatches=4, diagnostics=(DiagnosticSpec("grad-norm", 2, "max"),))
    one = _trainer(tmp_path, s, name="one").run()
    two = _trainer(tmp_path, s, devices=("cpu:0", "cpu:1"), name="two").run()
    for k in one.params:
        np.testing.assert_allclose(one.params[k], two.params[k], rtol=1e-5, atol=1e-6)
    diag = series(tmp_path / "two", "diag/grad-norm")
    assert sorted(diag) == [2, 4, 6, 8, 10]
    annotations = series(tmp_path / "two", "annotation")
    assert annotations[0] == "data: digits (digits), 16 items per microbatch"


def test_two_ranks_with_odd_microbatches_is_e_dp_003(tmp_path):
    with pytest.raises(SexpgpuError) as info:
        _trainer(tmp_path, _settings(microbatches=3), devices=("cpu:0", "cpu:1")).run()
    assert info.value.code == "E-DP-003"


def test_resume_guards_experiment_and_rank_count(tmp_path):
    ck = {"checkpoint_every": 2, "checkpoint_location": "ck"}
    _trainer(tmp_path, _settings(steps=2, **ck)).run()
    with pytest.raises(SexpgpuError) as info:
        _trainer(
            tmp_path, _settings(steps=4, **ck), devices=("cpu:0", "cpu:1"), resume="latest"
        ).run()
    assert info.value.code == "E-DP-002"
    assert "written by 1 device(s)" in info.value.message
    other = Trainer(
        lambda r: on_cpu(Mlp(batch=16)),
        DIGITS,
        _settings(steps=4, **ck),
        tmp_path / "run",
        experiment_hash="hash-2",
        resume="latest",
    )
    with pytest.raises(SexpgpuError) as info:
        other.run()
    assert info.value.code == "E-CKPT-003"
    with pytest.raises(SexpgpuError) as info:
        _trainer(tmp_path, _settings(steps=4), resume="latest").run()
    assert info.value.code == "E-CKPT-001"


def test_metrics_status_and_eval_accuracy(tmp_path):
    s = _settings(
        steps=60,
        eval_every=30,
        eval_batches=3,
        microbatches=1,
        diagnostics=(DiagnosticSpec("activation-rms", 10, "mean"),),
    )
    summary = _trainer(tmp_path, s).run()
    run_dir = tmp_path / "run"
    names = {r["name"] for r in read_metrics(run_dir / "metrics.jsonl")}
    assert names >= {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/step_time_s",
        "runtime/peak_bytes",
        "eval/loss",
        "eval/accuracy",
        "annotation",
    }
    assert sorted(series(run_dir, "eval/accuracy")) == [30, 60]
    assert summary.eval_accuracy > 0.7
    peaks = series(run_dir, "runtime/peak_bytes")
    assert len(peaks) == 60 and min(peaks.values()) > 0
    notes = [
        r["value"] for r in read_metrics(run_dir / "metrics.jsonl") if r["name"] == "annotation"
    ]
    assert any("activation-rms skipped" in n for n in notes)
    assert any(n.startswith("memory: peak") for n in notes)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["step"] == 60 and status["state"] == "done" and status["tokens_per_s"] > 0


def test_a_token_stream_trains_below_uniform(tmp_path):
    s = RunSettings(
        steps=60,
        batch=8,
        microbatches=1,
        seed=0,
        optimizer=optimizer_spec("adamw", lr=0.1),
        eval_every=60,
        eval_batches=2,
    )
    text = defdata("text", "(python-stdlib)", seq=32)
    summary = Trainer(
        lambda r: on_cpu(Bigram(batch=8, seq=32)),
        text,
        s,
        tmp_path / "lm",
        experiment_hash="h",
        target="next",
    ).run()
    assert summary.eval_loss < np.log(256) - 1.5


def test_a_diverging_loss_is_e_train_002(tmp_path):
    class Nan(Mlp):
        def train_step(self, p, batch):
            _, grads = super().train_step(p, batch)
            return float("nan"), grads

    s = _settings(steps=3)
    with pytest.raises(SexpgpuError) as info:
        Trainer(
            lambda r: on_cpu(Nan(batch=16)), DIGITS, s, tmp_path / "nan", experiment_hash="h"
        ).run()
    assert info.value.code == "E-TRAIN-002"
    assert json.loads((tmp_path / "nan" / "status.json").read_text())["state"] == "failed"


def test_ranks_whose_parameters_differ_write_no_checkpoint(tmp_path):
    class Skewed(Mlp):
        def __init__(self, rank, **kw):
            super().__init__(**kw)
            self.rank = rank

        def init_params(self, seed):
            return super().init_params(seed + self.rank)

    s = _settings(steps=2, microbatches=2, checkpoint_every=2, checkpoint_location="ck")
    trainer = Trainer(
        lambda rank: on_cpu(Skewed(rank, batch=16)),
        DIGITS,
        s,
        tmp_path / "skew",
        experiment_hash="h",
        devices=("cpu:0", "cpu:1"),
    )
    with pytest.raises(SexpgpuError) as info:
        trainer.run()
    assert info.value.code == "E-DP-004"
    assert not (tmp_path / "skew" / "ck").exists()
