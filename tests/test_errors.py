import re
from pathlib import Path

import pytest

from sexpgpu.errors import CODES, SexpgpuError, Source, Span

DOCS = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def test_every_code_is_documented_and_every_documented_code_exists():
    documented = set(re.findall(r"^\| (E-[A-Z]+-\d{3}) \|", DOCS.read_text(), re.M))
    assert documented == set(CODES)


def test_render_with_span_matches_the_language_contract():
    src = Source("examples/gpt.lisp", "\n" * 13 + "    (matmul h w-out)\n")
    err = SexpgpuError(
        "E-FORM-005",
        "matmul: inner dimensions differ, 128 and 64",
        Span(src, 14, 9, 14, 10),
        hint="w-out is [64 256]; did you mean (transpose w-out)?",
    )
    assert err.render() == (
        "error[E-FORM-005]: matmul: inner dimensions differ, 128 and 64\n"
        "  --> examples/gpt.lisp:14:9\n"
        "   |\n"
        "14 |     (matmul h w-out)\n"
        "   |         ^\n"
        "   = hint: w-out is [64 256]; did you mean (transpose w-out)?"
    )


def test_render_with_plain_location():
    err = SexpgpuError("E-CLI-001", "bad value", "SEXPGPU_DEVICE", hint="use cpu or cuda")
    assert str(err) == (
        "error[E-CLI-001]: bad value\n --> SEXPGPU_DEVICE\n  = hint: use cpu or cuda"
    )


def test_unknown_code_is_an_internal_error():
    with pytest.raises(AssertionError):
        SexpgpuError("E-NOPE-001", "x")
