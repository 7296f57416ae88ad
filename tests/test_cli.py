import subprocess
import sys
from pathlib import Path

import pytest

from sexpgpu.cli import COMMANDS, main


def test_bad_arguments_render_an_error_without_traceback(capsys):
    assert main(["no-such-command"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error[E-CLI-001]: ")
    assert "Traceback" not in err


def test_python_dash_m_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "sexpgpu", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("sexpgpu ")


def test_a_closed_pipe_ends_the_command_quietly():
    # `sexpgpu explain ... | head -1`: the reader goes away long before the IR is printed.
    proc = subprocess.Popen(
        [sys.executable, "-m", "sexpgpu", "explain", "examples/gpt.lisp"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
    )
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=120) in (0, 141)
    err = proc.stderr.read()
    assert b"Traceback" not in err
    assert b"internal error" not in err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_a_users_help_with_two_examples(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and out.count(f"  sexpgpu {command} ") >= 2, out
    assert "options:" in out and '"""' not in out


def test_memory_that_runs_out_where_nothing_retries_is_e_mem_002(monkeypatch, capsys, tmp_path):
    # The machine's doing, not a bug: never an internal error.
    from sexpgpu.commands import check

    def runs_out(args):
        raise MemoryError("the host has no room for the table")

    monkeypatch.setattr(check, "main", runs_out)
    assert main(["check", str(tmp_path / "any.lisp")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error[E-MEM-002]: memory ran out in sexpgpu check: the host has no")
    assert "internal error" not in err and "hint:" in err
