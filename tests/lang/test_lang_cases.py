"""Language tests written in the language: each tests/lang/cases/*.lisp states its outcome.

The leading ``;;`` lines of a case say what loading it gives:

- ``;; ok``, then ``;; param NAME = VALUE`` lines: it loads, with these values;
- ``;; expect:``, then the full rendered error, one ``;; `` line per line;
- ``;; variant: NAME`` (either kind): load with this variant.
"""

from pathlib import Path

import pytest
from lisp_cases import case_files, each_case, header

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang import load_experiment_text
from sexpgpu.lang.values import show_value

CASES = Path(__file__).parent / "cases"


def parse_header(lines):
    variant, params, expected, ok = None, {}, None, False
    for i, line in enumerate(lines):
        if line == "ok":
            ok = True
        elif line.startswith("variant: "):
            variant = line.removeprefix("variant: ")
        elif line.startswith("param "):
            name, value = line.removeprefix("param ").split(" = ")
            params[name] = value
        elif line == "expect:":
            expected = "\n".join(lines[i + 1 :])
            break
    assert ok != (expected is not None), "a case says `;; ok` or `;; expect:`"
    return variant, params, expected


@each_case(CASES)
def test_case(path):
    text = path.read_text()
    variant, params, expected = parse_header(header(text))
    if expected is None:
        exp = load_experiment_text(text, path.name, variant)
        assert {name: show_value(exp.params[name]) for name in params} == params
        return
    with pytest.raises(SexpgpuError) as info:
        load_experiment_text(text, path.name, variant)
    assert info.value.render() == expected


def test_there_are_cases_of_both_kinds():
    kinds = {"ok" in header(p.read_text()) for p in case_files(CASES)}
    assert kinds == {True, False}
