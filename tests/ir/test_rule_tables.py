"""Every op has an entry in every rule table, or sits in that table's exemption set."""

from __future__ import annotations

import pytest

from sexpgpu.ir import autodiff, numpy_impl  # noqa: F401  (fill VJP_RULES, IMPL_RULES)
from sexpgpu.ir.ops import (
    BINARY,
    ELEMENTWISE,
    FUSED,
    LEAF,
    MOVEMENT,
    PRODUCT,
    REDUCE,
    UNARY,
    VIEW,
    Op,
)
from sexpgpu.ir.rules import IMPL_EXEMPT, IMPL_RULES, SHAPE_RULES, VJP_EXEMPT, VJP_RULES

TABLES = {
    "shape": (SHAPE_RULES, frozenset()),
    "impl": (IMPL_RULES, IMPL_EXEMPT),
    "vjp": (VJP_RULES, VJP_EXEMPT),
}


@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_op_has_every_rule_or_an_exemption(table):
    rules, exempt = TABLES[table]
    missing = {op for op in Op if op not in rules and op not in exempt}
    assert not missing, f"{table} rules missing for {sorted(op.label for op in missing)}"
    assert not set(rules) & exempt, "an exempt op has a rule anyway"


def test_groups_partition_the_ops():
    groups = [LEAF, ELEMENTWISE, REDUCE, MOVEMENT, PRODUCT, FUSED]
    assert sum(len(g) for g in groups) == len(Op)
    assert UNARY | BINARY < ELEMENTWISE and VIEW < MOVEMENT


def test_labels_round_trip():
    for op in Op:
        assert Op.from_label(op.label) is op
    assert Op.LOG_SOFTMAX.label == "log-softmax"
