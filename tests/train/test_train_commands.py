import builtins
import json

import pytest

from sexpgpu.cli import main


def _metrics(run_dir):
    run_dir.mkdir()
    lines = [{"step": s, "name": "train/loss", "value": 3.0 / s} for s in range(1, 21)]
    lines += [{"step": 10, "name": "eval/loss", "value": 0.5}]
    lines += [{"step": 0, "name": "annotation", "value": "memory: plan 1 bytes per rank"}]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 21, "na'  # cut-off line
    (run_dir / "metrics.jsonl").write_text(text)


def test_plot_writes_a_png(tmp_path, capsys):
    _metrics(tmp_path / "run")
    assert main(["plot", str(tmp_path / "run")]) == 0
    png = (tmp_path / "run" / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "loss.png" in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "run"), "-o", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x.png").exists()


def test_plot_without_metrics_is_e_plot_002(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 1
    assert "error[E-PLOT-002]" in capsys.readouterr().err


def test_plot_without_matplotlib_is_e_plot_001(tmp_path, capsys, monkeypatch):
    _metrics(tmp_path / "run")
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["plot", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "error[E-PLOT-001]" in err and "pip install 'sexpgpu[plot]'" in err


@pytest.mark.parametrize("flag", ["--help"])
def test_plot_help(flag, capsys):
    with pytest.raises(SystemExit):
        main(["plot", flag])
    assert "RUN_DIR" in capsys.readouterr().out
