import json

from tiny_lm import write_tiny_lm

from sexpgpu.cli import main


def test_run_records_set_and_a_resume_with_other_values_is_named(tmp_path, capsys):
    path = write_tiny_lm(tmp_path)
    out = str(tmp_path / "run")
    assert main(["run", str(path), "--out", out, "--set", "lr=0.002", "--steps", "2"]) == 0
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["sets"] == {"lr": 0.002}
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-2" / "state.json").read_text())
    assert state["sets"] == {"lr": 0.002}
    capsys.readouterr()
    resume = ["run", str(path), "--out", out, "--resume", "latest", "--steps", "4"]
    assert main([*resume, "--set", "lr=0.003"]) == 1
    err = capsys.readouterr().err
    assert "error[E-CKPT-003]" in err
    assert "--set lr=0.003 here, --set lr=0.002 in the checkpoint" in err
    assert main([*resume, "--set", "lr=0.002"]) == 0
