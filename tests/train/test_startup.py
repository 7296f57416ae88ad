"""The first step's wait, split by phase (`runtime/startup/*`), on the cpu device."""

import re
from pathlib import Path

import pytest

from sexpgpu.cli import main
from sexpgpu.train.metrics import read_series

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.lisp"
PHASES = ("front_end", "plan", "load", "step")


def test_the_first_steps_wait_is_split_by_phase(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", str(GPT), "--variant", "smoke", "--steps", "2", "--out", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("first step"))
    assert re.fullmatch(
        r"first step after [\d.]+ s \(runtime/first_step_s\): "
        r"front end [\d.]+ s, plan [\d.]+ s, load [\d.]+ s, step [\d.]+ s",
        line,
    ), line
    total = read_series(out, "runtime/first_step_s")
    assert list(total) == [1]
    phases = [read_series(out, f"runtime/startup/{name}_s") for name in PHASES]
    assert all(list(p) == [1] for p in phases)  # the first step alone
    assert sum(p[1] for p in phases) == pytest.approx(total[1], rel=1e-6)
