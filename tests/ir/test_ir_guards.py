"""User input that used to reach an internal error or a silently wrong graph (issue 13).

Each case goes through `sexpgpu check` in-process, which reads, traces,
differentiates, folds and plans the run; the errors are pinned as printed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sexpgpu.cli import main

DIGITS = """(defdata d (digits))
(defmodel m (x) {body})
(defrun r :model m :data d :loss {loss} :optimizer (sgd :lr 0.1) :batch 4 :steps 1{extra})
"""


def check(tmp_path: Path, capsys, body: str, loss: str = "(mean (m x))", extra: str = ""):
    path = tmp_path / "e.lisp"
    path.write_text(DIGITS.format(body=body, loss=loss, extra=extra))
    status = main(["check", str(path)])
    out = capsys.readouterr()
    return status, out.out, out.err


def first_lines(err: str) -> list[str]:
    lines = err.splitlines()
    return [lines[0], next(line for line in lines if "= hint" in line).strip()]


@pytest.mark.parametrize("fn", ["silu", "gelu", "sigmoid", "rsqrt"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_constant_folding_of_a_rank0_activation(tmp_path, capsys, fn, dtype) -> None:
    status, out, err = check(
        tmp_path, capsys, f"(* (linear x 3) ({fn} 2))", extra=f" :dtype {dtype}"
    )
    assert (status, err) == (0, "")
    assert "FLOPs per step" in out


def test_a_size_past_int64_is_refused_not_negative_flops(tmp_path, capsys) -> None:
    status, out, err = check(tmp_path, capsys, "(linear x 9223372036854775807)")
    assert status == 1 and "-" not in out
    assert first_lines(err) == [
        "error[E-SHAPE-012]: param: a value of shape [64 9223372036854775807] holds 5.9e+20 "
        "elements, more than the 2^48 a value may hold",
        "= hint: check the sizes that make this value (a parameter, :seq, :batch or a layer's "
        "width)",
    ]


def test_a_float_size_is_not_an_integer(tmp_path, capsys) -> None:
    status, _, err = check(tmp_path, capsys, "(linear x 1e300)")
    assert status == 1
    assert first_lines(err) == [
        "error[E-TRACE-004]: argument 2 of linear must be an integer, found the float 1e+300",
        "= hint: write it without a decimal point; divide sizes with (// a b), not (/ a b)",
    ]


@pytest.mark.parametrize(
    ("call", "token", "first"),
    [
        ("(linear x 4.0)", "4.0", "argument 2 of linear must be an integer, found the float 4.0"),
        (
            "(softmax x :axis 1.0)",
            "1.0",
            "`:axis` of softmax must be an integer, found the float 1.0",
        ),
        ("(layernorm x :eps 0)", "0", "`:eps` of layernorm must be positive, found the integer 0"),
        (
            "(rmsnorm x :eps -1e-5)",
            "-1e-5",
            "`:eps` of rmsnorm must be positive, found the number -1e-05",
        ),
        ("(slice x :from 2 :to 2)", "2", "slice: :from 2 :to 2 is empty"),
        (
            "(matmul x (param [64 3] :init (uniform 1 0)))",
            "0",
            "param: `uniform` needs its low bound below its high one, found 1 and 0",
        ),
        (
            "(matmul x (param [64 3] :init (normal -1)))",
            "-1",
            "param: the standard deviation of `normal` is negative (-1)",
        ),
    ],
)
def test_a_bad_argument_is_refused_where_it_is_written(tmp_path, capsys, call, token, first):
    status, _, err = check(tmp_path, capsys, call)
    assert status == 1
    assert err.splitlines()[0].split(": ", 1)[1] == first
    line = DIGITS.splitlines()[1].format(body=call)
    column = line.index(call) + call.rindex(token) + 1
    assert err.splitlines()[1] == f" --> {tmp_path / 'e.lisp'}:2:{column}"


def test_more_than_64_axes_is_refused_in_check(tmp_path, capsys) -> None:
    ones = " ".join(["1"] * 64)
    status, _, err = check(tmp_path, capsys, f"(reshape x [4 64 {ones}])")
    assert status == 1
    assert first_lines(err)[0] == (
        "error[E-SHAPE-012]: reshape: a value has 66 axes, more than the 64 a value may have"
    )


def test_integer_folding_past_int64_is_an_error(tmp_path, capsys) -> None:
    status, _, err = check(tmp_path, capsys, "(* (linear x 3) (* 4611686018427387904 4))")
    assert status == 1
    assert first_lines(err) == [
        "error[E-TRACE-004]: *: the integer result does not fit in 64 bits for "
        "[4611686018427387904, 4]",
        "= hint: check the numbers",
    ]


def test_a_tower_of_powers_is_refused_at_once(tmp_path, capsys) -> None:
    status, _, err = check(tmp_path, capsys, "(* (linear x 3) (pow 3 (pow 3 (pow 3 3))))")
    assert status == 1 and "pow: the integer result does not fit in 64 bits" in err


def test_a_long_sequence_is_not_folded_into_memory(tmp_path, capsys) -> None:
    # positions of [4 2^31] would be 8 GiB of int32 if folding computed them
    body = (
        "(* (linear x 3) (sum (cast (positions (reshape (linear x 536870912) [4 -1])) :dtype f32)))"
    )
    status, out, err = check(tmp_path, capsys, body)
    assert err == "" and status == 0 and "FLOPs per step" in out


def test_mse_of_different_shapes_does_not_broadcast(tmp_path, capsys) -> None:
    status, _, err = check(tmp_path, capsys, "(linear x 1)", loss="(mse (m x) (cast y :dtype f32))")
    assert status == 1
    assert err.splitlines() == [
        "error[E-SHAPE-013]: mse: prediction [4 1] and target [4] differ in shape "
        "(a loss does not broadcast)",
        " --> " + str(tmp_path / "e.lisp") + ":3:34",
        "  |",
        "3 | (defrun r :model m :data d :loss (mse (m x) (cast y :dtype f32)) "
        ":optimizer (sgd :lr 0.1) :batch 4 :steps 1)",
        "  |                                  ^",
        "  = hint: reshape the target: (reshape (cast y :dtype f32) [4 1])",
    ]


def test_mse_of_an_int_target_names_mse(tmp_path, capsys) -> None:
    status, _, err = check(tmp_path, capsys, "(linear x 1)", loss="(mse (m x) y)")
    assert status == 1
    assert first_lines(err) == [
        "error[E-SHAPE-002]: mse: the target y has dtype int32, not a float",
        "= hint: cast it first: (cast y :dtype f32)",
    ]


def test_mse_of_one_shape_and_of_a_number_check(tmp_path, capsys) -> None:
    for loss in ["(mse (m x) (reshape (cast y :dtype f32) [4 1]))", "(mse (m x) 0.5)"]:
        assert check(tmp_path, capsys, "(linear x 1)", loss=loss)[0] == 0


def test_vocabulary_modules_import_one_way() -> None:
    import sexpgpu.ir.vocabulary_layers as layers

    tree = ast.parse(Path(layers.__file__).read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "sexpgpu.ir.vocabulary" not in imported


@pytest.mark.parametrize(
    "body",
    [
        "(-> x (linear 4) (repeat 1000000000 relu))",
        "(-> x (linear 4) (repeat 65536 (linear 4)))",
    ],
)
def test_a_huge_expansion_stops_at_the_call_limit(tmp_path, capsys, body) -> None:
    status, _, err = check(tmp_path, capsys, body)
    assert status == 1
    assert err.splitlines()[0].startswith(
        "error[E-TRACE-008]: the model expands to more than 10,000 calls (at `"
    )


def test_a_defn_fan_out_stops_at_the_call_limit(tmp_path, capsys) -> None:
    fns = "".join(f"(defn f{i + 1} (x) (+ (f{i} x) (f{i} x)))\n" for i in range(40))
    path = tmp_path / "e.lisp"
    path.write_text(
        "(defn f0 (x) (relu x))\n"
        + fns
        + DIGITS.format(body="(f40 x)", loss="(mean (m x))", extra="")
    )
    assert main(["check", str(path)]) == 1
    assert "E-TRACE-008" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("body", "loss", "target"),
    [
        ("(-> x (linear 16) relu (linear 10))", "(cross-entropy (m x) y)", "y"),
        ("(-> x (linear 16) relu (linear 64))", "(mse (m x) x)", None),  # an autoencoder
        ("(-> x (linear 16) relu (linear 10))", "(mean (m x))", None),
    ],
)
def test_accuracy_only_where_the_loss_classifies(body, loss, target) -> None:
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment_text

    experiment = load_experiment_text(DIGITS.format(body=body, loss=loss, extra=""))
    assert compile_run(experiment, experiment.run()).target == target
