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
    assert "RUN" in capsys.readouterr().out


def _capture_figure(monkeypatch):
    from matplotlib.figure import Figure

    seen = []
    real = Figure.savefig

    def save(fig, *args, **kwargs):
        seen.append([ax.get_title() for ax in fig.axes if ax.get_visible()])
        seen.append([len(ax.lines) for ax in fig.axes if ax.get_visible()])
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", save)
    return seen


def _full_metrics(run_dir, accuracy=True, bad=()):
    run_dir.mkdir()
    lines = []
    for s in range(1, 31):
        for name, value in [
            ("train/loss", 3.0 / s),
            ("train/lr", 1e-3),
            ("train/grad_norm", 1.0),
            ("train/tokens_per_s", 1000.0 + s),
        ]:
            lines.append({"step": s, "name": name, "value": value})
    lines += [{"step": 10, "name": "eval/loss", "value": 0.5}]
    if accuracy:
        lines += [{"step": 10, "name": "eval/accuracy", "value": 0.9}]
    lines += [{"step": 40 + i, "name": "train/loss", "value": v} for i, v in enumerate(bad)]
    text = "".join(json.dumps(r, allow_nan=True) + "\n" for r in lines)
    (run_dir / "metrics.jsonl").write_text(text)


def test_plot_draws_a_panel_per_metric_and_runs_side_by_side(tmp_path, capsys, monkeypatch):
    seen = _capture_figure(monkeypatch)
    _full_metrics(tmp_path / "a")
    _full_metrics(tmp_path / "b", accuracy=False)
    out = tmp_path / "both.png"
    argv = ["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--smooth", "5", "-o", str(out)]
    assert main(argv) == 0
    titles, lines = seen
    assert titles == ["loss", "learning rate", "gradient norm", "eval accuracy", "tokens/s"]
    # loss: two runs x (raw + smoothed train, eval); accuracy: run a only
    assert lines == [6, 2, 4, 1, 4]
    assert out.read_bytes()[:4] == b"\x89PNG"
    seen.clear()
    assert main(["plot", str(tmp_path / "b")]) == 0
    assert seen[0] == ["loss", "learning rate", "gradient norm", "tokens/s"]
    assert (tmp_path / "b" / "loss.png").exists()


def test_plot_leaves_out_nan_inf_and_huge_values_and_says_so(tmp_path, capsys, monkeypatch):
    seen = _capture_figure(monkeypatch)
    _full_metrics(tmp_path / "a", bad=[float("nan"), float("inf"), 1e308, -1e308, 2.0])
    assert main(["plot", str(tmp_path / "a")]) == 0
    assert seen[0][0] == "loss (4 points not drawn: NaN, inf or huge)"


def test_plot_of_a_metrics_folder_is_e_plot_003(tmp_path, capsys):
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    assert main(["plot", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "error[E-PLOT-003]" in err and "is not a file" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--smooth", "0"], "--smooth 0 is not positive"), (["-o", "x.nope"], "no `.nope` images")],
)
def test_plot_option_misuse(tmp_path, capsys, extra, message):
    _full_metrics(tmp_path / "a")
    assert main(["plot", str(tmp_path / "a"), *extra]) == 1
    err = capsys.readouterr().err
    assert "error[E-CLI-001]" in err and message in err
