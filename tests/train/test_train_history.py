"""A resume never loses or mixes history: refusals, branches, superseded records, stops."""

import json
import shutil

import pytest
from standin_program import Mlp, defdata, on_cpu

from sexpgpu.cli import main
from sexpgpu.errors import SexpgpuError
from sexpgpu.lang import load_experiment_text
from sexpgpu.lang.runs import optimizer_spec
from sexpgpu.train.loop import Trainer
from sexpgpu.train.metrics import SUPERSEDED, MetricsLog, read_metrics, read_series
from sexpgpu.train.run_folder import claim_run_folder, claimed_folder
from sexpgpu.train.settings import (
    RunSettings,
    experiment_identity,
    first_difference,
    identity_hash,
)

DIGITS = defdata("digits", "(digits)")
SGD = optimizer_spec("sgd", lr=0.1)
CK = {"checkpoint_every": 2, "checkpoint_location": "checkpoints"}


def _trainer(folder, steps, resume=None, identity=None, **kw):
    settings = RunSettings(steps=steps, batch=16, microbatches=1, seed=3, optimizer=SGD, **CK)
    return Trainer(
        lambda rank: on_cpu(Mlp(batch=16)),
        DIGITS,
        settings,
        folder,
        experiment_hash=identity_hash(identity or {"setting": "1"}),
        identity=identity or {"setting": "1"},
        resume=resume,
        **kw,
    )


def _error(fn) -> SexpgpuError:
    with pytest.raises(SexpgpuError) as info:
        fn()
    return info.value


def _losses(folder):
    return [r["step"] for r in read_metrics(folder / "metrics.jsonl") if r["name"] == "train/loss"]


def test_the_metrics_log_sets_records_apart_and_deletes_none(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(1, 6):
        log.write(step, "train/loss", float(step))
    log.close()
    log = MetricsLog(path, keep_through=3)  # a resume from step 3
    assert (log.last_step, log.last_loss) == (3, 3.0)
    log.write(4, "train/loss", 40.0)
    log.close()
    assert read_series(tmp_path, "train/loss") == {1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0}
    apart = list(read_metrics(tmp_path / SUPERSEDED))
    assert [(r["step"], r["value"]) for r in apart] == [(4, 4.0), (5, 5.0)]
    assert all(r["superseded"].startswith("a resume from step 3, ") for r in apart)
    MetricsLog(path).close()  # a fresh start: every earlier record goes apart too
    assert len(list(read_metrics(tmp_path / SUPERSEDED))) == 2 + 4
    assert list(read_metrics(path)) == []


def test_a_target_below_the_newest_checkpoint_is_refused(tmp_path):
    run = tmp_path / "run"
    _trainer(run, 4).run()
    _trainer(run, 6, resume="latest").run()
    err = _error(lambda: _trainer(run, 5, resume="latest").run())
    assert err.render().splitlines() == [
        f"error[E-CKPT-006]: checkpoint {run}/checkpoints/step-6 is at step 6, "
        "past the target step 5",
        " --> --steps",
        "  = hint: continue it: --resume latest --steps 7 or more; or branch into a new "
        f"folder: --out NEW_FOLDER --resume {run}/checkpoints/step-4 --steps 5",
    ]
    err = _error(lambda: _trainer(run, 8, resume=f"{run}/checkpoints/step-4").run())
    assert err.code == "E-CKPT-006" and "is below step 6, the newest in" in err.message
    assert "--resume latest --steps 8" in err.hint
    assert _losses(run) == list(range(1, 7))  # nothing rewritten, nothing deleted
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-2",
        "step-4",
        "step-6",
    ]


def test_a_branch_records_its_parent_and_reads_as_one_trajectory(tmp_path):
    parent, branch = tmp_path / "run", tmp_path / "branch"
    _trainer(parent, 6).run()
    lines = []
    _trainer(branch, 5, resume=f"{parent}/checkpoints/step-4", announce=lines.append).run()
    assert lines == [f"resumed from {parent}/checkpoints/step-4 (step 4 of 5)"]
    record = json.loads((branch / "run.json").read_text())
    assert record["parent"] == {
        "folder": str(parent.resolve()),
        "checkpoint": f"{parent}/checkpoints/step-4",
        "step": 4,
    }
    assert sorted(p.name for p in (branch / "checkpoints").iterdir()) == ["step-5"]
    assert _losses(branch) == [5]  # nothing copied
    ours, theirs = read_series(branch, "train/loss"), read_series(parent, "train/loss")
    assert list(ours) == [1, 2, 3, 4, 5]
    assert [ours[s] for s in range(1, 5)] == [theirs[s] for s in range(1, 5)]
    assert ours[5] == theirs[5]  # the same steps from the same state: the same loss


def test_a_crash_after_the_last_checkpoint_is_kept_apart(tmp_path):
    run = tmp_path / "run"
    _trainer(run, 5).run()
    shutil.rmtree(run / "checkpoints" / "step-5")  # as if killed before writing it
    before = read_series(run, "train/loss")
    lines = []
    _trainer(run, 5, resume="latest", announce=lines.append).run()
    assert lines == ["resumed from checkpoints/step-4 (step 4 of 5)"]
    assert _losses(run) == [1, 2, 3, 4, 5]
    apart = [r for r in read_metrics(run / SUPERSEDED) if r["name"] == "train/loss"]
    assert [(r["step"], r["value"]) for r in apart] == [(5, before[5])]
    assert read_series(run, "train/loss") == before  # the cpu device repeats bit for bit


def test_a_stop_finishes_the_step_and_checkpoints_it(tmp_path):
    run = tmp_path / "run"
    trainer = _trainer(run, 50)
    # Set once step 3 is recorded, as a signal would be: step 4 is in flight.
    trainer.on_step = lambda r: trainer.stop.set() if r.step == 3 else None
    summary = trainer.run()
    assert summary.interrupted and summary.step == 4
    assert (run / "checkpoints" / "step-3").exists() is False
    assert (run / "checkpoints" / "step-4" / "manifest.json").exists()
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"]) == ("interrupted", 4)
    assert _losses(run)[-1] == 4
    resumed = _trainer(run, 5, resume="latest").run()
    assert (resumed.resumed_from, resumed.interrupted) == (4, False)


EXPERIMENT = """
(defparams (lr 0.1) (width 8))
(defvariant big (width 16))
(defdata digits (digits) :split 0.9)
(defmodel mlp (x) (-> x (linear width) relu (linear 10)))
(defrun train :model mlp :data digits :loss (cross-entropy (mlp x) y)
  :optimizer (sgd :lr lr) :batch 8 :steps 4)
"""


def _identity(text, variant=None):
    return experiment_identity(load_experiment_text(text, "m.lisp", variant), "train")


def test_the_identity_is_the_resolved_experiment_not_the_text():
    base = _identity(EXPERIMENT)
    edited = (
        "; a comment\n"
        + EXPERIMENT.replace("(defparams", "(defparams\n ")
        + ("(defvariant other (lr 0.5))\n")
    )
    assert identity_hash(_identity(edited)) == identity_hash(base)
    assert identity_hash(_identity(EXPERIMENT.replace(":steps 4", ":steps 9"))) == (
        identity_hash(base)
    )  # --steps or :steps extends a run
    changed = _identity(EXPERIMENT.replace("(lr 0.1)", "(lr 0.2)"))
    assert first_difference(base, changed) == "parameter lr"
    assert first_difference(base, _identity(EXPERIMENT, "big")) == "parameter width"
    moved = _identity(EXPERIMENT.replace("(linear 10)))", "(linear 10) relu))"))
    assert first_difference(base, moved) == "model mlp"


def test_e_ckpt_003_names_the_first_setting_that_differs(tmp_path):
    run = tmp_path / "run"
    _trainer(run, 2, identity={"parameter lr": "0.1", "parameter width": "8"}).run()
    mine = {"parameter lr": "0.1", "parameter width": "16"}
    err = _error(lambda: _trainer(run, 4, resume="latest", identity=mine).run())
    assert err.code == "E-CKPT-003"
    assert err.message == (
        f"checkpoint {run}/checkpoints/step-2 is of another experiment: "
        "`parameter width` differs: 8 in the checkpoint, 16 here"
    )


def test_resume_latest_finds_the_folder_this_experiment_claimed(tmp_path):
    runs = tmp_path / "runs"
    claim_run_folder(runs / "train", "a" * 64, "train", resume=False)
    claim_run_folder(runs / "train-2", "b" * 64, "train", resume=False)
    claim_run_folder(runs / "train-3", "b" * 64, "train", resume=False)
    claim_run_folder(runs / "train-4", "b" * 64, "other", resume=False)
    assert claimed_folder(runs / "train", "b" * 64, "train") == runs / "train-3"
    assert claimed_folder(runs / "train", "c" * 64, "train") is None


def test_the_cli_resumes_a_renamed_folder_and_says_which(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.lisp").write_text(
        EXPERIMENT.replace(":steps 4", ':steps 2 :checkpoint (every 2 "ck")')
    )
    (tmp_path / "b.lisp").write_text(
        (tmp_path / "a.lisp").read_text().replace("(lr 0.1)", "(lr 0.3)")
    )
    assert main(["run", "a.lisp"]) == 0
    assert main(["run", "b.lisp"]) == 0  # runs/train holds a.lisp's run: b gets runs/train-2
    capsys.readouterr()
    assert main(["run", "b.lisp", "--resume", "latest", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "run folder: runs/train-2 (the newest this experiment's run claimed)" in out
    assert "resumed from ck/step-2 (step 2 of 3)" in out
    assert _losses(tmp_path / "runs" / "train-2") == [1, 2, 3]
    assert _losses(tmp_path / "runs" / "train") == [1, 2]


def test_an_empty_out_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.lisp").write_text(EXPERIMENT)
    assert main(["run", "a.lisp", "--out", ""]) == 1
    assert "error[E-CLI-001]: --out is empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.lisp"]
