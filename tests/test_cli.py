import subprocess
import sys

from sexpgpu.cli import main


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
