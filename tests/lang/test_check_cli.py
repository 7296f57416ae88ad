import subprocess
import sys
from pathlib import Path

from sexpgpu.cli import main
from sexpgpu.commands.check import SECTIONS, Section, render_report
from sexpgpu.lang import load_experiment

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "gpt.lisp")


def test_check_prints_the_resolved_experiment(capsys):
    assert main(["check", GPT, "--variant", "smoke"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{GPT} (variant smoke)"
    lines = [line.split() for line in out.splitlines()]
    assert ["layers", "2", "smoke", "(default", "12)"] in lines
    assert ["vocab", "256"] in lines
    assert [
        "text",
        "(python-stdlib)",
        "seq",
        "64,",
        "split",
        "0.9,",
        "fields",
        "[tokens",
        "next]",
    ] in lines
    assert ["optimizer", "(adamw", ":lr", "0.001", ":betas", "[0.9", "0.95]", ":eps", "1e-08",
            ":weight-decay", "0.1)"] in lines  # fmt: skip
    assert ["checkpoint", "every", "100", "steps", "to", '"checkpoints"'] in lines
    for title in ["parameters", "data", "functions", "models", "runs"]:
        assert [title] in lines


def test_check_one_run(capsys):
    assert main(["check", str(ROOT / "examples" / "mlp.lisp"), "--run", "train"]) == 0
    out = capsys.readouterr().out
    assert "    schedule      (constant)\n" in out
    assert "    clip          none\n" in out


def test_sections_can_be_added(monkeypatch):
    exp = load_experiment(GPT, "smoke")
    extra = Section("sizes", lambda exp, runs: [f"  {len(runs)} run"])
    monkeypatch.setattr("sexpgpu.commands.check.SECTIONS", [*SECTIONS, extra])
    assert render_report(exp, list(exp.runs.values())).endswith("\n\nsizes\n  1 run")


def test_unknown_run_is_a_user_error(capsys):
    assert main(["check", GPT, "--run", "trian"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error[E-FORM-006]: unknown run `trian`\n")
    assert "did you mean `train`?" in err


def test_the_command_line_shows_no_traceback(tmp_path):
    bad = tmp_path / "bad.lisp"
    bad.write_text("(defparams (width 8)\n(defvariant smoke (width 4))\n")
    done = subprocess.run(
        [sys.executable, "-m", "sexpgpu", "check", str(bad)], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (
        "error[E-READ-001]: unclosed `(`: the list opened here is never closed\n"
        f" --> {bad}:1:1\n"
        "  |\n"
        "1 | (defparams (width 8)\n"
        "  | ^\n"
        "  = hint: add `)` to close the list that opens at 1:1; the form at 2:1 starts inside"
        " it, so the `)` is probably missing before line 2\n"
    )


def test_the_readme_command_works():
    done = subprocess.run(
        [sys.executable, "-m", "sexpgpu", "check", "examples/gpt.lisp", "--variant", "smoke"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("examples/gpt.lisp (variant smoke)\n")


def test_missing_file(capsys):
    assert main(["check", "no/such.lisp"]) == 1
    assert capsys.readouterr().err.startswith("error[E-READ-007]: no such file: no/such.lisp")


def test_check_says_when_a_data_file_is_not_there(tmp_path, capsys):
    path = tmp_path / "m.lisp"
    path.write_text(
        '(defdata text (bytes "gone.txt") :seq 4)\n'
        "(defmodel m (tokens) (let [w (param [256 8])] (-> (take w tokens) (linear 256))))\n"
        "(defrun a :model m :data text :loss (cross-entropy (m tokens) next)"
        " :optimizer (sgd :lr 0.1) :batch 2 :steps 2)\n"
    )
    assert main(["check", str(path)]) == 0
    assert "file not found (`run` stops with E-DATA-001)" in capsys.readouterr().out
    (tmp_path / "gone.txt").write_text("some text to train on")
    assert main(["check", str(path)]) == 0
    assert "file not found" not in capsys.readouterr().out
