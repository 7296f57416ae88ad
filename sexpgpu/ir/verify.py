"""The IR verifier, run after every pass whenever a run is compiled (run, check, explain).

It recomputes each node's dtype, shape and normalized attributes with the
op's shape rule, checks that operands come before their users and that
every INPUT and PARAM node is declared once by its name in the graph. A
failure raises `IRError` showing the printed program around the bad node.
"""

from __future__ import annotations

from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.node import Graph, Node
from sexpgpu.ir.ops import Op
from sexpgpu.ir.printer import format_lines
from sexpgpu.ir.rules import SHAPE_RULES
from sexpgpu.ir.shape_rules import format_shape

__all__ = ["IRError", "verify"]

_CONTEXT = 3


class IRError(AssertionError):
    """A malformed graph: a bug in whatever built or rewrote it."""


def verify(graph: Graph) -> None:
    """Check `graph`'s invariants; raise `IRError` on the first broken one."""
    order = graph.nodes()
    seen: set[int] = set()
    declared = {**_declared(graph, Op.INPUT), **_declared(graph, Op.PARAM)}
    for node in order:
        if any(id(x) not in seen for x in node.inputs):
            _fail(graph, node, "an operand is not computed before its user")
        problem = _check_rule(node)
        if problem:
            _fail(graph, node, problem)
        if node.op in (Op.INPUT, Op.PARAM) and declared.get((node.op, node.name)) is not node:
            _fail(graph, node, f"{node.op.label} {node.name!r} is not the graph's declared one")
        seen.add(id(node))


def _declared(graph: Graph, op: Op) -> dict[tuple[Op, str], Node]:
    table = graph.inputs if op is Op.INPUT else graph.params
    out = {}
    for name, node in table.items():
        if node.op is not op or node.name != name:
            raise IRError(f"graph declares {name!r} as {node.op.label} {node.name!r}")
        out[(op, name)] = node
    return out


def _check_rule(node: Node) -> str | None:
    try:
        dtype, shape, attrs = SHAPE_RULES[node.op](
            node.op, node.inputs, dict(node.attrs), node.span
        )
    except SexpgpuError as err:
        return f"the shape rule rejects the node: {err.message}"
    if dtype != node.dtype or tuple(shape) != node.shape:
        return (
            f"the rule gives {dtype} {format_shape(shape)}, "
            f"the node says {node.dtype} {format_shape(node.shape)}"
        )
    if dict(attrs) != dict(node.attrs):
        return f"attributes {dict(node.attrs)} are not normalized (the rule gives {dict(attrs)})"
    return None


def _fail(graph: Graph, node: Node, problem: str) -> None:
    lines, shown = format_lines(graph)
    at = next(i for i, n in enumerate(shown) if n is node)
    lo, hi = max(0, at - _CONTEXT), min(len(lines), at + _CONTEXT + 1)
    excerpt = [(">> " if i == at else "   ") + lines[i] for i in range(lo, hi)]
    raise IRError(f"invalid IR at line {at + 1}: {problem}\n" + "\n".join(excerpt))
