import json
import logging

import pytest
from tiny_lm import TEXT, write_tiny_lm

from sexpgpu.cli import main
from sexpgpu.errors import SexpgpuError
from sexpgpu.lang import load_experiment_text
from sexpgpu.train import loggers

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _events(run_dir):
    acc = event_accumulator.EventAccumulator(
        str(run_dir / loggers.TENSORBOARD_FOLDER), size_guidance={"scalars": 0, "tensors": 0}
    )
    acc.Reload()
    return acc


def _check_mirrored(run_dir):
    acc = _events(run_dir)
    records = _records(run_dir)
    for name in ("train/loss", "eval/loss", "train/lr"):
        want = {r["step"]: r["value"] for r in records if r["name"] == name}
        got = {e.step: e.value for e in acc.Scalars(name)}
        assert set(got) == set(want) and want
        assert all(got[s] == pytest.approx(want[s], rel=1e-6) for s in want)
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("annotation")]
    assert texts == [r["value"] for r in records if r["name"] == "annotation"]


def test_log_tensorboard_mirrors_every_metric_and_annotation(tmp_path, capsys):
    path = write_tiny_lm(tmp_path)
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--log", "tensorboard"]) == 0
    _check_mirrored(out)


def test_the_log_run_setting_and_the_option_give_each_logger_once(tmp_path, capsys):
    path = write_tiny_lm(tmp_path, TEXT.replace(":seed 3", ":seed 3 :log [tensorboard]"))
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--log", "tensorboard"]) == 0
    _check_mirrored(out)
    assert len(list((out / loggers.TENSORBOARD_FOLDER).iterdir())) == 1


class _Breaks:
    def __init__(self, *args):
        self.calls = 0

    def scalar(self, step, name, value):
        self.calls += 1
        if self.calls == 3:
            raise OSError("disk full")

    text = scalar

    def close(self):
        raise AssertionError("a dropped logger is not closed")


def test_a_failing_logger_warns_once_and_never_stops_the_run(tmp_path, capsys, caplog, monkeypatch):
    monkeypatch.setitem(loggers.LOGGERS, "tensorboard", _Breaks)
    path = write_tiny_lm(tmp_path)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        assert main(["run", str(path), "--out", str(out), "--log", "tensorboard"]) == 0
    warnings = [r.getMessage() for r in caplog.records if "--log tensorboard" in r.getMessage()]
    assert len(warnings) == 1 and "disk full" in warnings[0] and "metrics.jsonl" in warnings[0]
    assert {r["step"] for r in _records(out) if r["name"] == "train/loss"} == {1, 2, 3, 4}


def test_a_logger_that_cannot_start_warns_once(tmp_path, capsys, caplog, monkeypatch):
    def missing(*args):
        raise ImportError("no module named wandb", name="wandb")

    monkeypatch.setitem(loggers.LOGGERS, "wandb", missing)
    path = write_tiny_lm(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert main(["run", str(path), "--out", str(tmp_path / "run"), "--log", "wandb"]) == 0
    warnings = [r.getMessage() for r in caplog.records if "--log wandb" in r.getMessage()]
    assert len(warnings) == 1 and "pip install 'sexpgpu[wandb]'" in warnings[0]


def test_wandb_runs_offline_in_the_run_folder(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    path = write_tiny_lm(tmp_path)
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--log", "wandb"]) == 0
    assert list((out / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize(
    ("log", "code", "message"),
    [
        (":log [tensorbord]", "E-FORM-006", "unknown logger tensorbord"),
        (":log [tensorboard tensorboard]", "E-FORM-004", "named twice"),
        (':log "tensorboard"', "E-FORM-006", "unknown logger"),
    ],
)
def test_log_setting_misuse(log, code, message):
    with pytest.raises(SexpgpuError) as err:
        load_experiment_text(TEXT.replace(":seed 3", f":seed 3 {log}"))
    assert err.value.code == code and message in err.value.message


def test_log_option_misuse(tmp_path, capsys):
    path = write_tiny_lm(tmp_path)
    assert main(["run", str(path), "--log", "mlflow"]) == 1
    assert "error[E-CLI-001]" in capsys.readouterr().err
