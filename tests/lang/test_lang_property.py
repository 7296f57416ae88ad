"""Any text either loads or raises SexpgpuError: never another exception, never a hang."""

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sexpgpu.commands.check import LANGUAGE_SECTIONS, render_report
from sexpgpu.errors import SexpgpuError
from sexpgpu.lang import load_experiment, load_experiment_text

EXAMPLES = [
    p.read_text() for p in sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.lisp"))
]
LANGUAGE_CHARS = '()[]:;"\\ \n\t-+*/.,#@ 0123456789eE abcdefghijklmnopqrstuvwxyz'
FAST = settings(
    derandomize=True,
    max_examples=50,
    deadline=10_000,  # a hang guard, not a speed test: loaded CI machines stall
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)


def outcome(text, variant=None):
    """Load `text`, then describe it (`check`'s language sections) or render its error."""
    try:
        exp = load_experiment_text(text, "fuzz.lisp", variant)
    except SexpgpuError as err:
        assert err.render().startswith(f"error[{err.code}]: ")
        return err.code
    render_report(exp, list(exp.runs.values()), LANGUAGE_SECTIONS)
    return "ok"


@FAST
@given(st.text(max_size=300))
def test_any_text(text):
    outcome(text)


@FAST
@given(st.text(alphabet=LANGUAGE_CHARS, max_size=300), st.sampled_from([None, "smoke"]))
def test_text_made_of_the_language_characters(text, variant):
    outcome(text, variant)


@st.composite
def mutated_example(draw):
    text = draw(st.sampled_from(EXAMPLES))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 12)))
        op = draw(st.sampled_from(["delete", "insert", "replace", "duplicate"]))
        piece = draw(st.text(alphabet=LANGUAGE_CHARS, min_size=1, max_size=4))
        if op == "delete":
            text = text[:i] + text[j:]
        elif op == "insert":
            text = text[:i] + piece + text[i:]
        elif op == "replace":
            text = text[:i] + piece + text[j:]
        else:
            text = text[:j] + text[i:j] + text[j:]
    return text


@FAST
@given(mutated_example(), st.sampled_from([None, "smoke"]))
def test_mutated_examples(text, variant):
    outcome(text, variant)


@FAST
@given(st.binary(max_size=200))
def test_any_bytes_in_a_file(data):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzz.lisp"
        path.write_bytes(data)
        try:
            load_experiment(path)
        except SexpgpuError as err:
            err.render()


def test_the_examples_themselves_load():
    assert [outcome(text) for text in EXAMPLES] == ["ok"] * len(EXAMPLES)
