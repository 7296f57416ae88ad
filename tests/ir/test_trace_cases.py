"""Tracing tests written in the language: each tests/ir/trace_cases/*.lisp states its outcome.

The leading ``;;`` lines of a case say what tracing its only run gives:

- ``;; params:``, then one ``;; NAME [shape]`` line per parameter, in order;
- ``;; expect:``, then the full rendered error, one ``;; `` line per line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lisp_cases import case_files, each_case, header

from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.shape_rules import format_shape
from sexpgpu.ir.trace import trace_run
from sexpgpu.lang import load_experiment_text

CASES = Path(__file__).parent / "trace_cases"


def traced(path: Path):
    experiment = load_experiment_text(path.read_text(), path.name, base_dir=path.parent)
    return trace_run(experiment, experiment.run())


@each_case(CASES)
def test_case(path: Path) -> None:
    kind, *rest = header(path.read_text())
    if kind == "params:":
        params = traced(path).params
        assert [f"{name} {format_shape(spec.shape)}" for name, spec in params.items()] == rest
    else:
        assert kind == "expect:", f"{path.name}: the header starts with params: or expect:"
        with pytest.raises(SexpgpuError) as info:
            traced(path)
        assert info.value.render() == "\n".join(rest)


def test_there_are_cases_of_both_kinds() -> None:
    kinds = {header(p.read_text())[0] for p in case_files(CASES)}
    assert kinds == {"params:", "expect:"}
