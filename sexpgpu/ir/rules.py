"""The per-op rule tables, side by side: plain dicts keyed by `Op`.

* `SHAPE_RULES[op](op, inputs, attrs, span) -> (dtype, shape, attrs)`: checks the
  operands, normalizes the attributes (axes made non-negative, ...) and gives
  the result's dtype and shape; raises `SexpgpuError` (E-SHAPE-*) at `span`.
* `IMPL_RULES[op](node, *arrays, out=None) -> array`: the NumPy
  implementation. `out`, when given, is a dying operand's buffer of the
  result's shape and dtype that the op may write into.
* `VJP_RULES[op](node, g, needs) -> tuple[Node | None, ...]`: the cotangent
  of each operand given the cotangent `g` of the result, built from IR nodes;
  ``needs[i]`` says whether operand ``i`` wants one (None where not).

Each table is filled by its decorator in its own modules (`shape_rules`,
`numpy_impl` and `numpy_fused`, `vjp_rules`). Every op has an entry in every
table or sits in that table's exemption set (`IMPL_EXEMPT`, `VJP_EXEMPT`; every
op has a shape rule); a test checks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sexpgpu.ir.ops import COMPARISON, FED, LEAF, RANDOM, Op

__all__ = [
    "IMPL_EXEMPT",
    "IMPL_RULES",
    "SHAPE_RULES",
    "VJP_EXEMPT",
    "VJP_RULES",
    "impl_rule",
    "shape_rule",
    "vjp_rule",
]

SHAPE_RULES: dict[Op, Callable[..., Any]] = {}
IMPL_RULES: dict[Op, Callable[..., Any]] = {}
VJP_RULES: dict[Op, Callable[..., Any]] = {}

# Ops without a NumPy implementation: the leaves the caller feeds.
IMPL_EXEMPT = FED

# Ops without a VJP: leaves (differentiation stops there), ops whose result
# is piecewise constant (zero derivative), random numbers (integer operands),
# and the gradient-only fused ops (no second derivatives).
VJP_EXEMPT = (
    LEAF
    | COMPARISON
    | RANDOM
    | {
        Op.SIGN,
        Op.SOFTMAX_GRAD,
        Op.CROSS_ENTROPY_GRAD,
        Op.ATTENTION_GRAD,
        Op.LAYERNORM_GRAD,
        Op.GELU_GRAD,
    }
)


def _register(table: dict[Op, Callable[..., Any]], ops: tuple[Op, ...]) -> Callable:
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            assert op not in table, f"{op} registered twice"
            table[op] = fn
        return fn

    return decorate


def shape_rule(*ops: Op) -> Callable:
    """Register the decorated function as the shape/dtype rule of `ops`."""
    return _register(SHAPE_RULES, ops)


def impl_rule(*ops: Op) -> Callable:
    """Register the decorated function as the NumPy implementation of `ops`."""
    return _register(IMPL_RULES, ops)


def vjp_rule(*ops: Op) -> Callable:
    """Register the decorated function as the VJP of `ops`."""
    return _register(VJP_RULES, ops)
