"""Tracing errors, pinned exactly as the command line prints them."""

from __future__ import annotations

import textwrap

import pytest

from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.trace import trace_run
from sexpgpu.lang import load_experiment_text


def traced_error(body: str, head: str = "", loss: str = "(cross-entropy (m x) y)") -> str:
    """The rendered error of tracing model `body` over the digits fields."""
    text = f"""(defparams (width 32) (heads 5))
(defdata d (digits))
{head}
(defmodel m (x)
  {body})
(defrun r :model m :data d :loss {loss} :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
"""
    experiment = load_experiment_text(text, "exp.lisp")
    with pytest.raises(SexpgpuError) as info:
        trace_run(experiment, experiment.run())
    return info.value.render()


def expect(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def test_matmul_inner_mismatch_names_both_shapes_and_the_operand_to_transpose() -> None:
    body = (
        "(let [h (linear x width)\n"
        "        w-out (param [10 width] :init xavier)]\n"
        "    (matmul h w-out))"
    )
    assert traced_error(body) == expect(
        """
        error[E-SHAPE-003]: matmul: inner dimensions differ, 32 and 10 ([4 32] by [10 32])
         --> exp.lisp:7:5
          |
        7 |     (matmul h w-out)))
          |     ^
          = hint: w-out is [10 32]; did you mean (transpose w-out)?
        """
    )


def test_matmul_mismatch_without_a_transpose_that_fits() -> None:
    rendered = traced_error("(matmul x (param [3 7]))")
    assert rendered.splitlines()[0] == (
        "error[E-SHAPE-003]: matmul: inner dimensions differ, 64 and 3 ([4 64] by [3 7])"
    )
    assert rendered.splitlines()[-1] == (
        "  = hint: x is [4 64] and (param [3 7]) is [3 7]: the left's last axis must equal "
        "the right's second-to-last"
    )


def test_unknown_function_suggests_the_nearest_and_lists_the_vocabulary() -> None:
    rendered = traced_error("(lienar x 10)", head="(defn block (x) x)")
    vocabulary = (
        "* + - -> / < <= = > >= abs amax attention cast concat cos cross-entropy dropout embed "
        "exp gelu layernorm let linear log log-softmax matmul max mean min mse neg param "
        "positions pow relu repeat reshape rmsnorm rope rsqrt sdpa sigmoid silu sin slice "
        "softmax sqrt sum take tanh transpose where"
    )
    assert rendered == "\n".join(
        [
            "error[E-TRACE-001]: unknown function `lienar`",
            " --> exp.lisp:5:4",
            "  |",
            "5 |   (lienar x 10))",
            "  |    ^",
            f"  = hint: did you mean `linear`? defined: block m; vocabulary: {vocabulary}",
        ]
    )


def test_broadcast_error_points_at_the_users_form() -> None:
    assert traced_error("(+ (linear x 10) (linear x 3))") == "\n".join(
        [
            "error[E-SHAPE-001]: add: shapes [4 10] and [4 3] do not broadcast (axis -1)",
            " --> exp.lisp:5:3",
            "  |",
            "5 |   (+ (linear x 10) (linear x 3)))",
            "  |   ^",
            "  = hint: sizes must be equal or 1 on each axis, counted from the end; "
            "reshape or transpose one operand",
        ]
    )


def test_unknown_keyword_suggests_the_nearest() -> None:
    assert traced_error("(softmax (linear x 10) :axes 0)") == expect(
        """
        error[E-TRACE-003]: `softmax` has no keyword `:axes`
         --> exp.lisp:5:26
          |
        5 |   (softmax (linear x 10) :axes 0))
          |                          ^
          = hint: did you mean `:axis`? keywords: :axis
        """
    )


def test_unknown_name_suggests_the_nearest() -> None:
    assert traced_error("(linear x widht)") == expect(
        """
        error[E-TRACE-002]: unknown name `widht`
         --> exp.lisp:5:13
          |
        5 |   (linear x widht))
          |             ^
          = hint: did you mean `width`? names in scope: heads, width, x
        """
    )


@pytest.mark.parametrize(
    ("body", "head", "first_line"),
    [
        ("(linear x)", "", "error[E-TRACE-003]: `linear` takes 2 arguments, found 1"),
        ("(f x 1)", "(defn f (x) x)", "error[E-TRACE-003]: `f` takes 1 argument, found 2"),
        ("(softmax x :axis)", "", "error[E-TRACE-003]: keyword `:axis` has no value"),
        ("(+ x gelu)", "", "error[E-TRACE-002]: `gelu` is a function, not a value"),
        (
            "(f x)",
            "(defn f (x) (f x))",
            "error[E-TRACE-007]: calls nest deeper than 48 levels (in `f`)",
        ),
        (
            "(attention (reshape x [4 2 32]) :heads heads)",
            "",
            "error[E-TRACE-004]: attention: width 32 does not split into 5 heads",
        ),
        (
            "(linear x 2.5)",
            "",
            "error[E-TRACE-004]: argument 2 of linear must be an integer, found the float 2.5",
        ),
        (
            "(softmax x :axis [0 1])",
            "",
            "error[E-TRACE-004]: `:axis` of softmax must be an integer, found a vector of 2",
        ),
        (
            "(repeat x -1 relu)",
            "",
            "error[E-TRACE-004]: repeat: the count must be a non-negative integer, "
            "found the integer -1",
        ),
        ("(-> x (repeat 2))", "", "error[E-TRACE-005]: repeat: takes 3 arguments, found 2"),
        (
            "(let [h] h)",
            "",
            "error[E-TRACE-005]: let: the bindings need a name and an expression each",
        ),
        (
            "(param [10 10] :init (normal))",
            "",
            "error[E-TRACE-005]: param: `normal` takes 1 number, found 0",
        ),
        ("(param [3] :init gauss)", "", "error[E-TRACE-005]: param: unknown initializer gauss"),
        (
            "(cast x :dtype f16)",
            "",
            "error[E-TRACE-004]: cast: `:dtype` must be one of f32, bf16, int32, "
            "found the string 'f16'",
        ),
        (
            "(+ (positions x) 0.5)",
            "",
            "error[E-TRACE-004]: +: the number 0.5 cannot join an int32 tensor",
        ),
        (
            "(take x x)",
            "",
            "error[E-SHAPE-009]: take: indices have dtype f32, not int32",
        ),
        ("(* x (/ 1 0))", "", "error[E-TRACE-004]: /: division by zero for [1, 0]"),
        ("(/ 1 0 x)", "", "error[E-TRACE-004]: /: division by zero for [1, 0]"),
        ("(concat [])", "", "error[E-TRACE-004]: concat: the vector of parts is empty"),
        (
            "(cross-entropy x (sum x :axis 1))",
            "",
            "error[E-SHAPE-010]: cross-entropy: targets have dtype f32, not int32",
        ),
        (
            "(* x (pow -1 0.5))",
            "",
            "error[E-TRACE-004]: pow: the result is not a real number for [-1, 0.5]",
        ),
        (
            "(* x (pow 10 400))",
            "",
            "error[E-TRACE-004]: pow: the integer result does not fit in 64 bits for [10, 400]",
        ),
    ],
)
def test_call_errors(body: str, head: str, first_line: str) -> None:
    assert traced_error(body, head).splitlines()[0] == first_line


def test_loss_must_be_a_scalar() -> None:
    assert traced_error("(linear x 10)", loss="(m x)").splitlines()[0] == (
        "error[E-TRACE-006]: the loss must be a float scalar, found a f32 tensor [4 10]"
    )


def test_cross_entropy_with_targets_of_the_wrong_shape() -> None:
    rendered = traced_error("(linear x 10)", loss="(cross-entropy (m x) (positions x))")
    assert rendered.splitlines()[0] == (
        "error[E-SHAPE-010]: cross-entropy: logits [4 10] and targets [4 64] disagree"
    )
