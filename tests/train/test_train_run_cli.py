"""`sexpgpu run` end to end: real experiment files through compile_run and the cpu interpreter."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from mlp_experiment import mlp_text
from run_reference import series, torch_mlp_losses
from sigkill_helpers import kill_at_step

from sexpgpu.cli import main
from sexpgpu.train import load_checkpoint, run_experiment
from sexpgpu.train.data import make_loader
from sexpgpu.train.metrics import read_metrics
from sexpgpu.train.schedules import make_schedule

ROOT = Path(__file__).resolve().parents[2]

MLP = mlp_text()


def _experiment(tmp_path, text=MLP, name="mlp.lisp"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_mlp_example_reaches_95_percent(tmp_path, capsys):
    # No time limit here: on a loaded machine it would only measure the load.
    assert main(["run", str(ROOT / "examples/mlp.lisp"), "--out", str(tmp_path / "mlp")]) == 0
    out = capsys.readouterr().out
    accuracy = series(tmp_path / "mlp", "eval/accuracy")
    assert accuracy[max(accuracy)] >= 0.95, out
    assert "done: step" in out and "eval accuracy" in out
    status = json.loads((tmp_path / "mlp" / "status.json").read_text())
    assert status["state"] == "done"


def test_ten_compiled_steps_equal_pytorch(tmp_path):
    """Golden trajectory through the language, tracer and interpreter."""
    path = _experiment(tmp_path)
    run_experiment(path, out=tmp_path / "run")
    ours = series(tmp_path / "run", "train/loss")

    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment

    experiment = load_experiment(path)
    run = experiment.run(None)
    init = compile_run(experiment, run).init_params(3)
    names = ["mlp/linear/weight", "mlp/linear/bias", "mlp/linear.1/weight", "mlp/linear.1/bias"]
    loader = make_loader(experiment.data["digits"], batch=16, microbatches=2, seed=3)
    ref = torch_mlp_losses(
        [init[n] for n in names], loader, make_schedule(run.schedule, 1e-2, 10), 10
    )
    np.testing.assert_allclose([ours[i] for i in range(1, 11)], ref, rtol=0, atol=1e-5)
    assert ref[-1] < ref[0] - 0.3


def test_n_steps_then_resume_to_2n_equals_2n(tmp_path, capsys):
    path = str(_experiment(tmp_path))
    assert main(["run", path, "--steps", "10", "--out", str(tmp_path / "a")]) == 0
    assert main(["run", path, "--steps", "10", "--out", str(tmp_path / "b")]) == 0
    args = ["run", path, "--steps", "20", "--out", str(tmp_path / "a"), "--resume", "latest"]
    assert main(args) == 0
    step10 = str(tmp_path / "b" / "checkpoints" / "step-10")
    args = ["run", path, "--steps", "20", "--out", str(tmp_path / "b"), "--resume", step10]
    assert main(args) == 0
    assert main(["run", path, "--steps", "20", "--out", str(tmp_path / "c")]) == 0
    # a cosine schedule stretches with --steps: compare against a constant one for 2N
    const = _experiment(
        tmp_path, MLP.replace("(cosine :warmup 3 :floor 0.1)", "(constant)"), "k.lisp"
    )
    for out, steps in (("k1", "10"), ("k2", "20")):
        assert main(["run", str(const), "--steps", steps, "--out", str(tmp_path / out)]) == 0
    args = ["run", str(const), "--steps", "20", "--out", str(tmp_path / "k1"), "--resume", "latest"]
    assert main(args) == 0
    assert series(tmp_path / "k1", "train/loss") == series(tmp_path / "k2", "train/loss")
    one = load_checkpoint(tmp_path / "k1" / "checkpoints")
    two = load_checkpoint(tmp_path / "k2" / "checkpoints")
    assert one.step == two.step == 20
    for k in two.params:
        assert np.array_equal(one.params[k], two.params[k])
    assert series(tmp_path / "a", "train/loss") == series(tmp_path / "b", "train/loss")
    capsys.readouterr()


def test_cli_sigkill_then_resume_equals_uninterrupted(tmp_path):
    text = MLP.replace("(steps 10)", "(steps 400)").replace(
        '(every 5 "checkpoints")', '(every 100 "checkpoints")'
    )
    path = _experiment(tmp_path, text)
    run_dir = tmp_path / "killed"
    env = dict(os.environ, SEXPGPU_DEVICE="cpu")
    # `sexpgpu run` killed after step 150: past the checkpoint of step 100
    kill_at_step(150, "sexpgpu", "run", str(path), "--out", str(run_dir), workdir=tmp_path, env=env)
    killed_at = max(series(run_dir, "train/loss"))
    resumed = run_experiment(path, out=run_dir, resume="latest")
    assert resumed.resumed_from is not None and resumed.resumed_from < killed_at
    whole = run_experiment(path, out=tmp_path / "whole")
    for k in whole.params:
        assert np.array_equal(whole.params[k], resumed.params[k])
    assert series(run_dir, "train/loss") == series(tmp_path / "whole", "train/loss")


def test_two_simulated_ranks_through_the_cli(tmp_path, monkeypatch, capsys):
    path = str(_experiment(tmp_path))
    assert main(["run", path, "--out", str(tmp_path / "one")]) == 0
    monkeypatch.setenv("SEXPGPU_DEVICES", "0,1")
    assert main(["run", path, "--out", str(tmp_path / "two")]) == 0
    one, two = series(tmp_path / "one", "train/loss"), series(tmp_path / "two", "train/loss")
    np.testing.assert_allclose(
        [two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=1e-5
    )
    notes = [r["value"] for r in read_metrics(tmp_path / "two" / "metrics.jsonl")]
    assert "devices: 2 x cpu" in notes
    # the checkpoint of two ranks resumes only on two
    monkeypatch.setenv("SEXPGPU_DEVICES", "0")
    args = ["run", path, "--steps", "12", "--out", str(tmp_path / "two"), "--resume", "latest"]
    assert main(args) == 1
    assert "error[E-DP-002]" in capsys.readouterr().err
    odd = _experiment(tmp_path, MLP.replace("(microbatches 2)", "(microbatches 3)"), "odd.lisp")
    monkeypatch.setenv("SEXPGPU_DEVICES", "0,1")
    assert main(["run", str(odd), "--out", str(tmp_path / "odd")]) == 1
    assert "error[E-DP-003]" in capsys.readouterr().err


def test_cli_errors_are_rendered(tmp_path, capsys):
    path = _experiment(tmp_path)
    assert main(["run", str(path), "--out", str(tmp_path / "r")]) == 0
    path.write_text("; a comment changes nothing\n" + MLP)
    resume = ["run", str(path), "--out", str(tmp_path / "r"), "--resume", "latest"]
    assert main([*resume, "--steps", "11"]) == 0
    path.write_text(MLP.replace(":lr 1e-2", ":lr 2e-2"))
    assert main([*resume, "--steps", "12"]) == 1
    err = capsys.readouterr().err
    assert "error[E-CKPT-003]" in err and "change only --steps" in err
    assert '`run train :optimizer` differs: {"name": "adamw", "options": {"betas"' in err
    missing = _experiment(
        tmp_path,
        MLP.replace("(digits)", '(bytes "nope.txt")').replace(":split 0.9", ":seq 8 :split 0.9"),
        "bad.lisp",
    )
    assert main(["run", str(missing), "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "error[E-" in err and "Traceback" not in err


def test_a_byte_file_trains_a_tiny_language_model(tmp_path, capsys):
    corpus = (ROOT / "sexpgpu" / "train" / "data.py").read_bytes() * 4
    (tmp_path / "corpus.txt").write_bytes(corpus)
    text = """
(defdata text (bytes "corpus.txt") :seq 16 :split 0.9)
(defmodel lm (tokens)
  (let [wte (param [256 32] :init (normal 0.02))]
    (-> (take wte tokens) (linear 256))))
(defrun train :model lm :data text :loss (cross-entropy (lm tokens) next)
  :optimizer (adamw :lr 3e-2) :batch 8 :steps 60 :seed 0 :eval (every 60 :batches 4))
"""
    path = _experiment(tmp_path, text, "lm.lisp")
    assert main(["run", str(path), "--out", str(tmp_path / "lm")]) == 0
    eval_loss = series(tmp_path / "lm", "eval/loss")
    assert eval_loss[60] < np.log(256) - 2.0
    capsys.readouterr()


@pytest.mark.parametrize("device", ["cuda"])
def test_cuda_training_is_refused_clearly(tmp_path, capsys, device):
    assert main(["run", str(_experiment(tmp_path)), "--device", device]) == 1
    assert "error[E-" in capsys.readouterr().err


def test_a_second_fresh_run_gets_its_own_folder(tmp_path, capsys, monkeypatch):
    """Running one command twice gives runs/NAME and runs/NAME-2, never one mixed folder."""
    path = _experiment(tmp_path, MLP.replace("(steps 10)", "(steps 2)"))
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(path)]) == 0
    assert main(["run", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"run folder: {Path('runs/train-2')} ({Path('runs/train')} holds an earlier run" in out
    for folder in ("runs/train", "runs/train-2"):
        assert sorted(series(tmp_path / folder, "train/loss")) == [1, 2]
    # --resume latest continues the newest folder of this experiment's run.
    assert main(["run", str(path), "--resume", "latest", "--steps", "3"]) == 0
    assert sorted(series(tmp_path / "runs/train-2", "train/loss")) == [1, 2, 3]
    assert sorted(series(tmp_path / "runs/train", "train/loss")) == [1, 2]


def test_another_experiment_of_the_same_run_name_is_refused(tmp_path, capsys):
    first = _experiment(tmp_path, MLP.replace("(steps 10)", "(steps 2)"), "a.lisp")
    second = _experiment(tmp_path, MLP.replace("(hidden 32)", "(hidden 16)"), "b.lisp")
    out = str(tmp_path / "run")
    assert main(["run", str(first), "--out", out]) == 0
    capsys.readouterr()
    assert main(["run", str(second), "--out", out]) == 1
    err = capsys.readouterr().err
    assert "error[E-CKPT-005]" in err and "belongs to run `train` of experiment" in err
    # Its parameters do not fit this model: no checkpoint of this run to resume.
    assert main(["run", str(second), "--out", out, "--resume", "latest"]) == 1
    assert "error[E-CKPT-001]: no complete checkpoint" in capsys.readouterr().err
    assert sorted(series(tmp_path / "run", "train/loss")) == [1, 2]  # nothing mixed in


def test_a_state_without_a_key_is_damage_and_the_one_before_is_used(tmp_path, capsys):
    import hashlib

    path = _experiment(tmp_path)
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out)]) == 0
    step = out / "checkpoints" / "step-10"
    state = json.loads((step / "state.json").read_text())
    del state["loaders"]
    blob = json.dumps(state).encode()
    (step / "state.json").write_bytes(blob)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["state.json"] = hashlib.sha256(blob).hexdigest()
    (step / "manifest.json").write_text(json.dumps(manifest))  # the checksums match again
    capsys.readouterr()
    assert main(["run", str(path), "--out", str(out), "--resume", "latest"]) == 0
    notes = [r["value"] for r in read_metrics(out / "metrics.jsonl") if r["name"] == "annotation"]
    assert any("skipped damaged" in n and "has no `loaders`" in n for n in notes)
    assert any(n.startswith("resume: from") and n.endswith("step-5") for n in notes)
