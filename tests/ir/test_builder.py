"""The builder runs each op's shape rule and reports misuse at the user's span."""

from __future__ import annotations

import pytest

from sexpgpu.errors import SexpgpuError, Source, Span
from sexpgpu.ir import builder as b
from sexpgpu.ir.ops import Op

SOURCE = Source("gpt.lisp", "(defmodel m (x)\n    (matmul h w-out))\n")
SPAN = Span(SOURCE, 2, 5, 2, 21)


def f32(name: str, *shape: int):
    return b.input(name, shape, "f32")


def test_matmul_error_names_both_shapes_at_the_span():
    with pytest.raises(SexpgpuError) as info:
        b.matmul(f32("a", 16, 32), f32("w", 7, 3), span=SPAN)
    assert info.value.code == "E-SHAPE-003"
    assert info.value.render() == (
        "error[E-SHAPE-003]: matmul: inner dimensions differ, 32 and 7 ([16 32] by [7 3])\n"
        " --> gpt.lisp:2:5\n"
        "  |\n"
        "2 |     (matmul h w-out))\n"
        "  |     ^\n"
        "  = hint: the left operand's last axis must equal the right's second-to-last; "
        "did you mean to transpose one of them?"
    )


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (lambda: b.add(f32("a", 2, 3), f32("b", 4, 3)), "E-SHAPE-001"),
        (lambda: b.add(f32("a", 2, 3), b.input("i", (2, 3), "int32")), "E-SHAPE-002"),
        (lambda: b.exp(b.input("i", (2,), "int32")), "E-SHAPE-002"),
        (lambda: b.sum(f32("a", 2, 3), axes=2), "E-SHAPE-004"),
        (lambda: b.sum(f32("a", 2, 3), axes=(1, -1)), "E-SHAPE-004"),
        (lambda: b.transpose(f32("a", 2, 3), axes=(0, 0)), "E-SHAPE-004"),
        (lambda: b.reshape(f32("a", 2, 3), (4, 2)), "E-SHAPE-005"),
        (lambda: b.matmul(f32("a", 3), f32("b", 3, 2)), "E-SHAPE-006"),
        (lambda: b.slice(f32("a", 2, 3), 1, 2, 5), "E-SHAPE-007"),
        (lambda: b.concat([f32("a", 2, 3), f32("b", 3, 2)], axis=0), "E-SHAPE-008"),
        (lambda: b.take(f32("t", 5, 3), f32("i", 4)), "E-SHAPE-009"),
        (lambda: b.cross_entropy(f32("l", 4, 5), b.input("t", (5,), "int32")), "E-SHAPE-010"),
        (lambda: b.broadcast_to(f32("a", 2, 3), (3, 3)), "E-SHAPE-001"),
        (lambda: b.attention(f32("q", 2, 4), f32("k", 3, 4), f32("v", 3, 4), True), "E-SHAPE-011"),
    ],
)
def test_shape_errors_have_codes_and_hints(make, code):
    with pytest.raises(SexpgpuError) as info:
        make()
    assert info.value.code == code
    assert info.value.hint


def test_shapes_and_normalized_attrs():
    x = f32("x", 2, 3, 4)
    assert b.sum(x, axes=-1, keepdims=True).shape == (2, 3, 1)
    assert b.sum(x, axes=(0, 2)).attrs["axes"] == (0, 2)
    assert b.max(x).shape == ()
    assert b.reshape(x, (-1, 4)).shape == (6, 4)
    assert b.transpose(x).shape == (2, 4, 3)
    assert b.slice(x, -1, -3, 4).shape == (2, 3, 3)
    assert b.pad(x, 1, 1, 2).shape == (2, 6, 4)
    assert b.concat([x, x], axis=-1).shape == (2, 3, 8)
    assert b.matmul(x, f32("w", 4, 5)).shape == (2, 3, 5)
    assert b.matmul(f32("p", 7, 1, 3, 4), f32("q", 5, 4, 2)).shape == (7, 5, 3, 2)
    ids = b.input("ids", (2, 3), "int32")
    assert b.take(f32("t", 10, 4), ids).shape == (2, 3, 4)
    assert b.scatter_add(ids, x, rows=10).shape == (10, 4)
    assert b.lt(x, b.constant(0.0, "f32")).dtype == "bool"
    assert b.cast(ids, "f32").dtype == "f32"
    assert b.iota((3, 5), axis=-1).attrs["axis"] == 1
    assert b.cross_entropy(f32("l", 2, 3, 9), ids).shape == (2, 3)
    assert b.gt(x, x).op is Op.LT


def test_nodes_keep_their_span():
    y = b.neg(f32("x", 2), span=SPAN)
    assert y.span is SPAN
