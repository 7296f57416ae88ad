"""`sexpgpu explain` and the traced-model section of `sexpgpu check`."""

from __future__ import annotations

from pathlib import Path

from sexpgpu.cli import main
from sexpgpu.commands.explain import format_flops
from sexpgpu.ir.printer import parse_graph

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MLP = str(EXAMPLES / "mlp.lisp")


def test_explain_prints_a_header_and_a_graph_that_reads_back(capsys) -> None:
    assert main(["explain", MLP]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"; {MLP}, run train: train graph, ")
    assert lines[1] == "; parameters: 9,610 in 4 tensors"
    assert lines[2] == (
        "; FLOPs per step: 2.59 MFLOP (1 microbatch of 64 rows, 2.59 MFLOP each; "
        "matmuls forward and backward)"
    )
    assert lines[3].startswith("; memory: ") and "planned peak on the cpu interpreter" in lines[3]
    graph = parse_graph(out)
    assert set(graph.params) == {
        "mlp/linear/weight",
        "mlp/linear/bias",
        "mlp/linear.1/weight",
        "mlp/linear.1/bias",
    }
    assert next(iter(graph.outputs)) == "loss"
    assert "grad/mlp/linear.1/bias" in graph.outputs
    assert "mlp.lisp:12:" in out  # nodes name the form they come from


def test_explain_eval_graph_without_spans(capsys) -> None:
    assert main(["explain", MLP, "--graph", "eval", "--no-spans"]) == 0
    out = capsys.readouterr().out
    assert "; " + MLP + ", run train: eval graph" in out
    assert "mlp.lisp:12:" not in out.split("(graph", 1)[1]
    assert list(parse_graph(out).outputs) == ["loss", "output"]


def test_explain_reports_trace_errors_as_user_errors(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.lisp"
    bad.write_text(
        (EXAMPLES / "mlp.lisp").read_text().replace("(linear classes)", "(linaer classes)")
    )
    assert main(["explain", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error[E-TRACE-001]: unknown function `linaer`\n")
    assert "did you mean `linear`?" in err


def test_check_lists_every_parameter_with_its_shape(capsys) -> None:
    assert main(["check", MLP]) == 0
    out = capsys.readouterr().out
    section = out.split("traced model: parameters, FLOPs, memory\n", 1)[1].splitlines()
    assert section[0] == "  train (model mlp, dtype f32)"
    assert section[1] == "    parameters: 9,610 in 4 tensors"
    assert section[2].startswith("    FLOPs per step: 2.59 MFLOP")
    assert section[3].startswith("    memory: ")
    assert [line.split() for line in section[4:]] == [
        ["mlp/linear/weight", "[64", "128]", "xavier"],
        ["mlp/linear/bias", "[128]", "zeros"],
        ["mlp/linear.1/weight", "[128", "10]", "xavier"],
        ["mlp/linear.1/bias", "[10]", "zeros"],
    ]


def test_format_flops() -> None:
    assert format_flops(1.409e9) == "1.41 GFLOP"
    assert format_flops(2.5e14) == "250 TFLOP"
    assert format_flops(12) == "12 FLOP"


def test_check_of_the_full_size_bf16_gpt(capsys) -> None:
    assert main(["check", str(EXAMPLES / "gpt.lisp")]) == 0
    out = capsys.readouterr().out
    section = out.split("traced model: parameters, FLOPs, memory\n", 1)[1].splitlines()
    assert section[0] == "  train (model gpt, dtype bf16)"
    # 12 blocks of 12 w^2 + 13 w, the tied embedding, the positions, the last norm
    w = 768
    count = 12 * (12 * w * w + 13 * w) + 256 * w + 1024 * w + 2 * w
    assert section[1] == f"    parameters: {count:,} in 196 tensors"
    assert "gpt/block.11/linear.1/weight" in out
