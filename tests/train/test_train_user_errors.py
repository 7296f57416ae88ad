"""What `sexpgpu run` and `sexpgpu plot` say to a user who gives them something they cannot use."""

import json

import numpy as np
import pytest

from sexpgpu.cli import main
from sexpgpu.errors import SexpgpuError
from sexpgpu.train import run_experiment
from sexpgpu.train.metrics import read_metrics

RUN = """
(defdata digits (digits) :split 0.9)
(defmodel mlp (x) {body})
(defrun train :model mlp :data digits :loss (cross-entropy (mlp x) y)
  :optimizer (sgd :lr 0.1) :batch 8 :steps {steps})
"""
SMALL = "(-> x (linear 8) relu (linear 10))"


def _file(tmp_path, body=SMALL, steps=3, name="m.lisp"):
    path = tmp_path / name
    path.write_text(RUN.format(body=body, steps=steps))
    return path


def _error(capsys) -> str:
    return capsys.readouterr().err


def test_a_model_larger_than_the_host_is_refused_before_any_initializer(tmp_path, capsys):
    # 64 x 1e9 floats is 238 GiB: the plan must refuse it without allocating a byte of it.
    path = _file(tmp_path, "(let [w (param [64 1000000000])] (-> x (matmul w) (linear 10)))")
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 1
    err = _error(capsys)
    assert "error[E-MEM-001]" in err and "parameters" in err and "host memory" in err
    assert "shrink the model's sizes" in err
    assert not (tmp_path / "run").exists()


def test_sexpgpu_memory_budgets_a_cpu_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SEXPGPU_MEMORY", "2KiB")
    assert main(["run", str(_file(tmp_path)), "--out", str(tmp_path / "run")]) == 1
    err = _error(capsys)
    assert "error[E-MEM-001]" in err and "--> SEXPGPU_MEMORY" in err
    assert "optimizer" in err and "activations" in err


@pytest.mark.parametrize("out", ["a-file", "a-file/sub"])
def test_an_out_that_cannot_be_a_folder_is_a_user_error(tmp_path, capsys, out):
    (tmp_path / "a-file").write_text("not a run")
    assert main(["run", str(_file(tmp_path)), "--out", str(tmp_path / out)]) == 1
    err = _error(capsys)
    assert "error[E-CLI-001]" in err and "as the run directory" in err
    assert ("it is a file" if out == "a-file" else "Not a directory") in err
    assert (tmp_path / "a-file").read_text() == "not a run"


def test_integer_fields_beyond_int32_are_refused_not_wrapped(tmp_path, capsys):
    rows = np.random.default_rng(0).random((40, 4), dtype=np.float32)
    np.savez(tmp_path / "d.npz", x=rows, y=np.full(40, 2**40, np.int64))
    path = tmp_path / "m.lisp"
    path.write_text(
        '(defdata d (arrays "d.npz" :fields [x y]))\n'
        "(defmodel m (x) (-> x (linear 3)))\n"
        "(defrun a :model m :data d :loss (cross-entropy (m x) y)"
        " :optimizer (sgd :lr 0.1) :batch 4 :steps 2)\n"
    )
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 1
    err = _error(capsys)
    assert "error[E-DATA-003]" in err and "outside int32" in err and "field y" in err


def test_ctrl_c_marks_the_status_interrupted_and_keeps_the_last_step(tmp_path):
    def stop(report):
        if report.step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(_file(tmp_path, steps=5), out=tmp_path / "run", on_step=stop)
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "interrupted"
    assert status["steps"] == 5


def _run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_experiment(_file(tmp_path, steps=2), out=run_dir)
    return run_dir


def test_plot_skips_undecodable_and_malformed_lines(tmp_path, capsys):
    run_dir = tmp_path / "bin"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_bytes(b"\xa4\xff\x00garbage\n")
    assert main(["plot", str(run_dir)]) == 1
    assert "error[E-PLOT-002]" in _error(capsys)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": "x", "name": "train/loss", "value": "a"}\n')
    assert main(["plot", str(run_dir)]) == 1
    assert "no train/loss records" in _error(capsys)


def test_plot_output_names(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    assert main(["plot", str(run_dir), "-o", str(tmp_path / "loss.txt")]) == 1
    err = _error(capsys)
    assert "error[E-CLI-001]" in err and "no `.txt` images" in err and ".png" in err
    # Without a suffix matplotlib adds .png: the message names the file written.
    assert main(["plot", str(run_dir), "-o", str(tmp_path / "loss")]) == 0
    assert f"wrote {tmp_path / 'loss.png'}" in capsys.readouterr().out
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert main(["plot", str(run_dir), "-o", "/proc/no-such/loss.png"]) == 1
    assert "error[E-CLI-001]" in _error(capsys)
    # Naming the metrics file rather than its folder plots the same run.
    assert main(["plot", str(run_dir / "metrics.jsonl")]) == 0
    assert f"wrote {run_dir / 'loss.png'}" in capsys.readouterr().out


def test_errors_stay_sexpgpu_errors_in_the_library(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(SexpgpuError) as info:
        run_experiment(_file(tmp_path), out=tmp_path / "f")
    assert info.value.code == "E-CLI-001"


class _NoCredentials:
    """An fsspec filesystem whose backend refuses every call, as s3fs does without keys."""

    def __getattr__(self, name):
        def refuse(*args, **kwargs):
            raise RuntimeError("Unable to locate credentials")

        return refuse


def test_a_remote_location_that_refuses_is_e_ckpt_004_before_the_run(tmp_path, monkeypatch):
    from sexpgpu.train import checkpoint

    monkeypatch.setattr(checkpoint, "_filesystem", lambda url, options: (_NoCredentials(), "b/x"))
    location = checkpoint.Location("s3://b/x")
    for call in (location.steps, lambda: location.read(1, "manifest.json")):
        with pytest.raises(SexpgpuError, match="Unable to locate credentials") as info:
            call()
        assert info.value.code == "E-CKPT-004"
    path = tmp_path / "m.lisp"
    path.write_text(
        RUN.format(body=SMALL, steps=2).replace(
            ":steps 2", ':steps 2 :checkpoint (every 1 "s3://b/x")'
        )
    )
    with pytest.raises(SexpgpuError) as info:
        run_experiment(path, out=tmp_path / "run")
    assert info.value.code == "E-CKPT-004" and not (tmp_path / "run").exists()


def test_a_manifest_that_is_not_an_object_is_a_damaged_checkpoint(tmp_path, capsys):
    path = tmp_path / "m.lisp"
    path.write_text(
        RUN.format(body=SMALL, steps=2).replace(":steps 2", ':steps 2 :checkpoint (every 2 "ck")')
    )
    run_experiment(path, out=tmp_path / "run")
    (tmp_path / "run/ck/step-2/manifest.json").write_text("[1, 2]")
    resume = ["--resume", str(tmp_path / "run/ck/step-2"), "--steps", "3"]
    assert main(["run", str(path), "--out", str(tmp_path / "run"), *resume]) == 1
    err = _error(capsys)
    assert "error[E-CKPT-002]" in err and "not a JSON object" in err


STREAM = """
(defdata text (bytes "{path}") :seq 4 :split {split})
(defmodel m (tokens) (let [w (param [256 8])] (-> (take w tokens) (linear 256))))
(defrun a :model m :data text :loss (cross-entropy (m tokens) next)
  :optimizer (sgd :lr 0.1) :batch 2 :steps 2)
"""


@pytest.mark.parametrize(
    ("target", "said"),
    [
        ("folder", "is a folder"),
        ("/dev/null", "is a device, not a regular file"),
        ("nope", "does not exist"),
    ],
)
def test_a_data_path_that_is_not_a_file_says_what_it_is(tmp_path, capsys, target, said):
    (tmp_path / "folder").mkdir()
    path = tmp_path / "m.lisp"
    path.write_text(STREAM.format(path=target, split=0.9))
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 1
    err = _error(capsys)
    assert "error[E-DATA-001]" in err and f"{target} {said}" in err


def test_split_1_without_eval_trains_on_everything(tmp_path):
    # The language accepts :split 1 when the run does not evaluate; the loaders agree.
    (tmp_path / "text.txt").write_bytes(b"abcdefgh")
    path = tmp_path / "m.lisp"
    path.write_text(STREAM.format(path="text.txt", split=1))
    assert run_experiment(path, out=tmp_path / "run").step == 2
    arrays = RUN.format(body=SMALL, steps=2).replace(":split 0.9", ":split 1")
    path.write_text(arrays)
    assert run_experiment(path, out=tmp_path / "run2").step == 2


@pytest.mark.parametrize(
    ("body", "loss"),
    [
        ("(-> x (linear 10))", "(mean (cast y :dtype f32))"),  # the model is never called
        ("(-> x relu (* 2))", "(cross-entropy (mlp x) y)"),  # the model has no parameter
    ],
)
def test_a_loss_no_parameter_reaches_is_refused_by_run_only(tmp_path, capsys, body, loss):
    path = tmp_path / "m.lisp"
    path.write_text(RUN.format(body=body, steps=2).replace("(cross-entropy (mlp x) y)", loss))
    assert main(["check", str(path)]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 1
    err = _error(capsys)
    assert "error[E-TRACE-006]" in err and "depends on no parameter" in err
    assert not (tmp_path / "run").exists()


def test_resuming_past_the_run_s_steps_is_refused(tmp_path, capsys):
    path = tmp_path / "m.lisp"
    path.write_text(
        RUN.format(body=SMALL, steps=4).replace(":steps 4", ':steps 4 :checkpoint (every 4 "ck")')
    )
    run_experiment(path, out=tmp_path / "run")
    again = ["run", str(path), "--out", str(tmp_path / "run"), "--resume", "latest"]
    assert main([*again, "--steps", "3"]) == 1
    err = _error(capsys)
    assert "error[E-CKPT-006]" in err and "at step 4, past the target step 3" in err
    assert "--resume latest --steps 5 or more" in err
    assert main([*again, "--steps", "4"]) == 0  # nothing left to do is not an error


def _run_until_a_checkpoint(tmp_path):
    import subprocess
    import sys
    import time

    path = tmp_path / "m.lisp"
    path.write_text(
        RUN.format(body=SMALL, steps=10**6).replace(
            ":steps 1000000", ':steps 1000000 :checkpoint (every 20 "ck")'
        )
    )
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "sexpgpu", "run", str(path), "--out", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "ck" / "step-20").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(proc.stderr.read())
        time.sleep(0.02)
    return path, run_dir, proc


def _last_step(run_dir):
    losses = [
        r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r["name"] == "train/loss"
    ]
    return max(losses)


@pytest.mark.parametrize(("signum", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_finishes_the_step_checkpoints_and_stops(tmp_path, signum, code):
    import signal

    path, run_dir, proc = _run_until_a_checkpoint(tmp_path)
    try:
        proc.send_signal(getattr(signal, signum))
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code and "Traceback" not in err, err
    status = json.loads((run_dir / "status.json").read_text())
    last = _last_step(run_dir)
    assert status["state"] == "interrupted" and status["step"] == last
    assert f"interrupted after step {last} (checkpoint written)" in err
    assert (run_dir / "ck" / f"step-{last}" / "manifest.json").exists()  # nothing lost
    resumed = ["run", str(path), "--out", str(run_dir), "--resume", "latest"]
    assert main([*resumed, "--steps", str(last + 1)]) == 0


def test_a_second_sigint_stops_at_once(tmp_path):
    import signal

    _, run_dir, proc = _run_until_a_checkpoint(tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    status = json.loads((run_dir / "status.json").read_text())
    # Stopped wherever it was, status.json still names metrics.jsonl's last step.
    assert status["state"] == "interrupted" and status["step"] == _last_step(run_dir)


def test_u32_token_ids_beyond_int32_are_named_not_wrapped(tmp_path, capsys):
    np.full(200, 4_000_000_000, "<u4").tofile(tmp_path / "t.bin")  # every window meets it
    path = tmp_path / "m.lisp"
    path.write_text(
        STREAM.format(path="t.bin", split=0.5).replace(
            '(bytes "t.bin")', '(tokens "t.bin" :dtype u32)'
        )
    )
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 1
    err = _error(capsys)
    assert "error[E-DATA-003]" in err and "token id 4000000000, beyond int32" in err


def test_progress_lines_give_the_time_left_readably():
    from sexpgpu.commands.run import duration

    cases = {42: "42s", 725: "12m05s", 11220: "3h07m", 4 * 86400 + 3 * 3600: "4d03h"}
    assert {s: duration(s) for s in cases} == cases
    assert duration(1e20) == ">10000d" and duration(float("inf")) == ">10000d"
    assert duration(float("nan")) == "-"


def test_a_checkpoint_write_that_fails_leaves_no_half_folder(tmp_path, monkeypatch):
    import errno
    import os

    from sexpgpu.train import checkpoint

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(SexpgpuError, match="No space left") as info:
        checkpoint.Location(tmp_path / "ck").write(3, {"a.bin": b"x" * 100})
    assert info.value.code == "E-CKPT-004"
    assert list((tmp_path / "ck").iterdir()) == []


@pytest.mark.parametrize(
    ("steps", "said"), [("0", "is not positive"), (str(2**63), "is too large")]
)
def test_steps_on_the_command_line_has_the_file_s_bounds(tmp_path, capsys, steps, said):
    assert main(["run", str(_file(tmp_path)), "--out", str(tmp_path / "r"), "--steps", steps]) == 1
    err = _error(capsys)
    assert "error[E-CLI-001]" in err and f"--steps {steps} {said}" in err


def test_a_split_leaving_less_than_a_batch_is_e_data_002(tmp_path, capsys):
    path = _file(tmp_path)
    path.write_text(path.read_text().replace(":split 0.9", ":split 0.0005", 1))
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 1
    err = _error(capsys)
    assert "error[E-DATA-002]" in err and "leaves 1 to train, fewer than a batch of 8" in err


def test_arrays_report_samples_per_second(tmp_path, capsys):
    assert main(["run", str(_file(tmp_path)), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert " samples/s " in out and "tok/s" not in out


def test_a_diverging_run_leaks_no_numpy_warning(tmp_path, capsys):
    import warnings

    path = _file(tmp_path, "(-> x (linear 64) (linear 64) (linear 10))", steps=30)
    path.write_text(path.read_text().replace("(sgd :lr 0.1)", "(adamw :lr 1e9)"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would fail the run
        assert main(["run", str(path), "--out", str(tmp_path / "run")]) in (0, 1)
    err = _error(capsys)
    assert "Warning" not in err and "internal error" not in err


def test_resume_of_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    again = ["run", str(_file(tmp_path)), "--out", str(tmp_path / "run")]
    assert main([*again, "--resume", str(tmp_path / "nope" / "step-3")]) == 1
    err = _error(capsys)
    assert f"error[E-CKPT-001]: --resume {tmp_path}/nope/step-3: no such checkpoint" in err


def test_the_license_is_an_spdx_string():
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).parents[2] / "pyproject.toml"
    assert tomllib.loads(pyproject.read_text())["project"]["license"] == "Apache-2.0"
