import json

import pytest
from tiny_lm import TEXT, train_tiny_lm, write_tiny_lm

from sexpgpu.cli import main
from sexpgpu.train.run_folder import claim_run_folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny_lm(tmp_path_factory.mktemp("lm"))


def _records(run_dir, name):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["value"] for r in map(json.loads, lines) if r["name"] == name}


def _eval(capsys, path, *extra):
    code = main(["eval", str(path), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("step", [2, 4])
def test_eval_equals_the_runs_own_evaluation_at_that_step(trained, capsys, step):
    path, run_dir = trained
    where = run_dir / "checkpoints" / f"step-{step}"
    code, out, _ = _eval(capsys, path, "--resume", str(where))
    assert code == 0
    record = json.loads(out.splitlines()[-1])
    assert record["step"] == step and record["batches"] == 3 and record["data"] == "text"
    assert record["loss"] == _records(run_dir, "eval/loss")[step]
    assert record["accuracy"] == _records(run_dir, "eval/accuracy")[step]
    assert record["perplexity"] == pytest.approx(2.718281828 ** record["loss"])
    assert f"step {step}, data text, 3 batches: loss {record['loss']:.4f}" in out


def test_eval_latest_takes_the_newest_checkpoint(trained, capsys):
    path, run_dir = trained
    code, out, _ = _eval(capsys, path, "--resume", "latest", "--out", str(run_dir))
    assert code == 0 and json.loads(out.splitlines()[-1])["step"] == 4


def test_eval_batches_and_another_data_set(tmp_path, capsys):
    text = TEXT.replace(
        '(defdata text (bytes "text.txt") :seq seq :split 0.8)',
        '(defdata text (bytes "text.txt") :seq seq :split 0.8)\n'
        '(defdata other (bytes "other.txt") :seq seq :split 0.5)\n'
        '(defdata wide (bytes "other.txt") :seq 8 :split 0.5)',
    )
    path = write_tiny_lm(tmp_path, text)
    (tmp_path / "other.txt").write_text("entirely different words here " * 20)
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    where = str(tmp_path / "run" / "checkpoints" / "step-4")
    code, out, _ = _eval(capsys, path, "--resume", where, "--batches", "5", "--data", "other")
    record = json.loads(out.splitlines()[-1])
    assert code == 0 and record["batches"] == 5 and record["data"] == "other"
    assert record["loss"] != _records(tmp_path / "run", "eval/loss")[4]
    code, _, err = _eval(capsys, path, "--resume", where, "--data", "wide")
    assert code == 1 and "error[E-DATA-008]" in err and "field `tokens` is int32 [4, 8]" in err
    code, _, err = _eval(capsys, path, "--resume", where, "--data", "othr")
    assert code == 1 and "error[E-CLI-001]" in err and "other" in err


def test_eval_latest_finds_the_renamed_run_folder_as_a_resume_does(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = write_tiny_lm(tmp_path)
    claim_run_folder(tmp_path / "runs" / "train", "b" * 64, "train", resume=False)
    assert main(["run", path.name, "--steps", "2"]) == 0  # runs/train is another's: train-2
    capsys.readouterr()
    code, out, err = _eval(capsys, path.name, "--resume", "latest")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["checkpoint"].endswith("train-2/checkpoints/step-2")
    assert "run folder: runs/train-2 (the newest this experiment's run claimed)" in err
    code, _, err = _eval(capsys, path.name, "--resume", "latest", "--set", "lr=1")
    assert code == 1 and "error[E-CKPT-001]" in err  # no folder of that experiment's run


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (["--batches", "0"], "E-CLI-001", "--batches 0 is not positive"),
        ([], "E-CLI-001", "the following arguments are required: --resume"),
        (["--resume", "nowhere/step-3"], "E-CKPT-001", "nowhere/step-3: no such checkpoint"),
        (["--set", "lr=1"], "E-CKPT-003", "--set lr=1.0 here"),
        (["--set", "lr"], "E-CLI-001", "is not NAME=VALUE"),
    ],
)
def test_eval_misuse(trained, capsys, extra, code, message):
    path, run_dir = trained
    resume = [] if "--resume" in extra or not extra else ["--resume", "latest"]
    argv = [*extra, *resume, "--out", str(run_dir)]
    status, _, err = _eval(capsys, path, *argv)
    assert status == 1 and f"error[{code}]" in err and message in err, err


def test_eval_help_has_options_and_examples(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert "--batches" in out and "--data" in out and out.count("  sexpgpu eval ") == 2
