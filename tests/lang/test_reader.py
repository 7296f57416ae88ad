import pytest

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang import Keyword, ListNode, Literal, Symbol, Vector, read, read_file, unparse
from sexpgpu.lang.reader import MAX_DEPTH


def only(text):
    (node,) = read(text, "t.lisp")
    return node


def error(text):
    with pytest.raises(SexpgpuError) as info:
        read(text, "t.lisp")
    return info.value.render()


def test_every_syntax_reads_to_its_node():
    node = only('(f :k 42 -3 6e-4 0.5 "runs/gpt" true false [a b] -> + cross-entropy)')
    assert isinstance(node, ListNode)
    items = node.items
    assert items[0] == Symbol("f", None)
    assert items[1] == Keyword("k", None)
    assert [i.value for i in items[2:8]] == [42, -3, 6e-4, 0.5, "runs/gpt", True]
    assert type(items[2].value) is int and type(items[4].value) is float
    assert items[8] == Literal(False, None) and items[8].value is False
    assert items[9] == Vector((Symbol("a", None), Symbol("b", None)), None)
    assert [i.name for i in items[10:]] == ["->", "+", "cross-entropy"]


def test_numbers():
    values = [n.value for n in read("1. .5 1e3 -2.5e-3 +4 0 -0 1E2 9223372036854775807")]
    assert values == [1.0, 0.5, 1000.0, -0.0025, 4, 0, 0, 100.0, 2**63 - 1]
    assert [n.name for n in read("- + -> -x +y .x")] == ["-", "+", "->", "-x", "+y", ".x"]


def test_comments_and_commas_are_skipped():
    nodes = read("; a comment\n(a, b) ; trailing\n;; end")
    assert nodes == (ListNode((Symbol("a", None), Symbol("b", None)), None),)


def test_string_escapes():
    assert only(r'"a\"b\\c\nd\te"').value == 'a"b\\c\nd\te'
    assert only('"two\nlines"').value == "two\nlines"


def test_spans_carry_file_line_and_column():
    text = "(defn block (x)\n  (+ x\n     1))"
    node = only(text)
    span = node.span
    assert (str(span), span.end_line, span.end_col) == ("t.lisp:1:1", 3, 9)
    body = node.items[3]
    assert (body.span.line, body.span.col, body.span.end_line, body.span.end_col) == (2, 3, 3, 8)
    one = body.items[2]
    assert (one.span.line, one.span.col, one.span.end_col) == (3, 6, 7)
    assert span.source.line(2) == "  (+ x"


def test_string_over_two_lines_spans_both():
    node = only('\n  "a\nbc"')
    assert (node.span.line, node.span.col, node.span.end_line, node.span.end_col) == (2, 3, 3, 4)
    (_, x) = read('"a\nbc" x')
    assert (x.span.line, x.span.col) == (2, 5)


def test_unparse_reads_back():
    text = '(defrun t :opt (adamw :lr 0.001 :betas [0.9 0.95]) :s "a\\"b\\n" :x true)'
    node = only(text)
    assert unparse(node) == text
    assert only(unparse(node)) == node


def test_read_file_missing(tmp_path):
    with pytest.raises(SexpgpuError) as info:
        read_file(tmp_path / "nope.lisp")
    assert info.value.code == "E-READ-007"


def test_read_file_of_a_run_folder_says_which_file_goes_there(tmp_path):
    run = tmp_path / "runs" / "train"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    with pytest.raises(SexpgpuError) as info:
        read_file(run)
    assert info.value.render().startswith("error[E-READ-007]: a run folder, not an experiment")
    assert f"--resume latest --out {run}" in info.value.render()
    with pytest.raises(SexpgpuError) as info:
        read_file(tmp_path / "runs")
    assert info.value.render().startswith("error[E-READ-007]: a folder, not a file")


def test_read_file_not_utf8(tmp_path):
    path = tmp_path / "bad.lisp"
    path.write_bytes(b"(a \xff)")
    with pytest.raises(SexpgpuError) as info:
        read_file(path)
    assert info.value.render().startswith("error[E-READ-007]: not UTF-8 text: byte 3")


def test_read_file_skips_a_byte_order_mark(tmp_path):
    path = tmp_path / "bom.lisp"
    path.write_bytes(b"\xef\xbb\xbf(a\n  @)")
    with pytest.raises(SexpgpuError) as info:
        read_file(path)
    # The mark is neither a stray character nor a column: `@` stands at 2:3.
    assert info.value.code == "E-READ-006" and " --> " + str(path) + ":2:3" in info.value.render()
    path.write_bytes(b"\xef\xbb\xbf(defparams (a 1))")
    assert len(read_file(path)) == 1


# -- errors, pinned in full ---------------------------------------------------------


def test_unclosed_bracket_names_where_it_opened():
    assert error("(defparams (width 8))\n(defn block (x)\n  (relu x)") == (
        "error[E-READ-001]: unclosed `(`: the list opened here is never closed\n"
        " --> t.lisp:2:1\n"
        "  |\n"
        "2 | (defn block (x)\n"
        "  | ^\n"
        "  = hint: add `)` to close the list that opens at 2:1"
    )


def test_unclosed_bracket_points_before_the_next_top_level_form():
    text = "(defn block (x)\n  (relu (linear x 4))\n(defmodel m (x)\n  (block x))\n"
    assert error(text) == (
        "error[E-READ-001]: unclosed `(`: the list opened here is never closed\n"
        " --> t.lisp:1:1\n"
        "  |\n"
        "1 | (defn block (x)\n"
        "  | ^\n"
        "  = hint: add `)` to close the list that opens at 1:1; the form at 3:1 starts inside"
        " it, so the `)` is probably missing before line 3"
    )


def test_unclosed_vector_names_the_innermost_too():
    assert error("(let [x (f") == (
        "error[E-READ-001]: unclosed `(`: the list opened here is never closed\n"
        " --> t.lisp:1:1\n"
        "  |\n"
        "1 | (let [x (f\n"
        "  | ^\n"
        "  = hint: add `)` to close the list that opens at 1:1"
        " (2 more open inside it, the innermost at 1:9)"
    )


def test_mismatched_bracket():
    assert error("(a\n  [b c)") == (
        "error[E-READ-002]: `)` cannot close the `[` that opens at 2:3\n"
        " --> t.lisp:2:7\n"
        "  |\n"
        "2 |   [b c)\n"
        "  |       ^\n"
        "  = hint: close the vector with `]`"
    )


def test_unexpected_closing_bracket():
    assert error("(a b))") == (
        "error[E-READ-002]: unexpected `)`: no list is open here\n"
        " --> t.lisp:1:6\n"
        "  |\n"
        "1 | (a b))\n"
        "  |      ^\n"
        "  = hint: remove it, or add the `(` it should close"
    )


def test_stray_character():
    assert error("(defparams\n  (width @8))") == (
        "error[E-READ-006]: unexpected character `@`\n"
        " --> t.lisp:2:10\n"
        "  |\n"
        "2 |   (width @8))\n"
        "  |          ^\n"
        "  = hint: symbols use ASCII letters, digits and + - * / < > = ! ? _ . % & $ ^ ~;"
        " text goes in double quotes"
    )


def test_stray_characters_with_their_own_hints():
    assert error("{:a 1}").endswith("hint: maps are not part of the language; write keyword"
                                    " arguments `:key value`")  # fmt: skip
    assert "error[E-READ-006]: unexpected character U+00A0" in error("(a\u00a0b)")
    assert error("(f : x)").endswith("as in `:steps`")
    assert error("# hi").endswith("comments start with `;`")


def test_bad_number():
    assert error("(defparams (lr 6e-4.5))") == (
        "error[E-READ-005]: malformed number `6e-4.5`\n"
        " --> t.lisp:1:16\n"
        "  |\n"
        "1 | (defparams (lr 6e-4.5))\n"
        "  |                ^\n"
        "  = hint: numbers look like 42, -3, 0.5 or 6e-4; a symbol cannot start with a digit"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("12abc", "malformed number `12abc`"),
        ("010", "malformed number `010`"),
        ("1e", "malformed number `1e`"),
        ("9223372036854775808", "integer `9223372036854775808` is out of range"),
        ("1" * 5000, "integer `111111111111111111111111111...` is out of range"),
        ("1e400", "float `1e400` is out of range"),
    ],
)
def test_number_errors(text, message):
    assert error(text).startswith(f"error[E-READ-005]: {message}\n")


def test_unterminated_string():
    assert error('(defdata d (bytes "data.txt))\n') == (
        'error[E-READ-003]: unterminated string: the `"` here is never closed\n'
        " --> t.lisp:1:19\n"
        "  |\n"
        '1 | (defdata d (bytes "data.txt))\n'
        "  |                   ^\n"
        '  = hint: add `"` to end the string; write `\\"` for a quote inside it'
    )


def test_unknown_escape():
    assert error('(x "a\\qb")') == (
        "error[E-READ-004]: unknown escape `\\q` in a string\n"
        " --> t.lisp:1:6\n"
        "  |\n"
        '1 | (x "a\\qb")\n'
        "  |      ^\n"
        '  = hint: the escapes are \\" \\\\ \\n and \\t; write \\\\ for a backslash'
    )


def test_nesting_is_bounded():
    assert len(read("(" * MAX_DEPTH + ")" * MAX_DEPTH)) == 1
    assert error("(" * (MAX_DEPTH + 1)).startswith(
        f"error[E-READ-008]: brackets nested more than {MAX_DEPTH} deep\n"
    )


def test_tabs_keep_the_caret_under_the_column():
    rendered = error("(a\t@)")
    assert rendered.splitlines()[3:5] == ["1 | (a @)", "  |    ^"]


def test_literals_compare_by_type_and_value():
    one, one_float, true, other_one = read("1 1.0 true 1")
    assert one == other_one and hash(one) == hash(other_one)
    assert one != one_float and one != true
    assert len({one, one_float, true}) == 3
