"""Graph passes: dead code elimination, common subexpressions, constant folding.

Nodes are immutable, so each pass rebuilds the nodes it changes (and their
users) and returns a new `Graph`; spans are kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sexpgpu.ir.dtypes import numpy_dtype
from sexpgpu.ir.node import ConstArray, Graph, Node
from sexpgpu.ir.numpy_impl import evaluate
from sexpgpu.ir.ops import FED, Op

__all__ = ["cse", "dce", "fold_constants", "optimize", "rewrite", "substitute", "with_inputs"]

log = logging.getLogger(__name__)

_FOLDABLE_BYTES = 1 << 20  # larger constant results stay computed at run time
# A broadcast constant costs nothing at run time; folded, it would be stored.
_UNFOLDED = FED | {Op.BROADCAST_TO}


def rewrite(graph: Graph, visit: Callable[[Node, tuple[Node, ...]], Node]) -> Graph:
    """Rebuild `graph` bottom-up: ``visit(node, new_inputs)`` gives each node's replacement.

    `visit` gets each node with its operands' replacements and returns the
    node to use instead (the node itself, rebuilt on the new operands when
    they differ, is the identity rewrite).
    """
    new: dict[int, Node] = {}
    for node in graph.nodes():
        new[id(node)] = visit(node, tuple(new[id(x)] for x in node.inputs))
    outputs = {name: new[id(n)] for name, n in graph.outputs.items()}
    leaves = [new[id(n)] for n in [*graph.inputs.values(), *graph.params.values()]]
    return Graph.of(outputs, leaves)


def with_inputs(node: Node, inputs: tuple[Node, ...]) -> Node:
    """`node` on `inputs`: itself where they are its operands already, else rebuilt."""
    if all(a is b for a, b in zip(inputs, node.inputs, strict=True)):
        return node
    return Node(node.op, node.dtype, node.shape, inputs, node.attrs, node.span)


def substitute(graph: Graph, pairs: Sequence[tuple[Node, Node]]) -> Graph:
    """`graph` with each ``(node, replacement)`` of `pairs` replaced (dropout in evaluation).

    A replacement is a node of `graph` computed before the node it replaces
    (dropout's operand); it stands in for that node wherever it is used.
    """
    swap = {id(node): replacement for node, replacement in pairs}
    done: dict[int, Node] = {}

    def visit(node: Node, inputs: tuple[Node, ...]) -> Node:
        other = swap.get(id(node))
        done[id(node)] = done[id(other)] if other is not None else with_inputs(node, inputs)
        return done[id(node)]

    return rewrite(graph, visit)


def dce(graph: Graph, keep_unused_leaves: bool = True) -> Graph:
    """Drop every node no output needs (and unused inputs/parameters unless kept)."""
    leaves = [*graph.inputs.values(), *graph.params.values()] if keep_unused_leaves else []
    result = Graph.of(graph.outputs, leaves)
    log.debug("dce: %d -> %d nodes", len(graph.nodes()), len(result.nodes()))
    return result


def cse(graph: Graph) -> Graph:
    """Merge nodes with the same op, operands, attributes, dtype and shape."""
    seen: dict[tuple[Any, ...], Node] = {}

    def visit(node: Node, inputs: tuple[Node, ...]) -> Node:
        if node.op in FED:
            return node  # names make fed leaves unique; they stay the declared nodes
        key = (node.op, node.dtype, node.shape, tuple(map(id, inputs)), node.attr_key())
        return seen.setdefault(key, with_inputs(node, inputs))

    return rewrite(graph, visit)


def fold_constants(graph: Graph, max_bytes: int = _FOLDABLE_BYTES) -> Graph:
    """Evaluate nodes whose operands are all constants into CONSTANT nodes.

    Results larger than `max_bytes` (a causal mask for a long sequence, a
    broadcast scalar) are left to be computed at run time; the size is judged
    from the static shape, so no large value is ever computed here, and an
    op folds only from operands that were small enough to be evaluated.
    """
    values: dict[int, np.ndarray] = {}

    def small(x: Node) -> bool:  # judged on the static shape, before anything is computed
        return x.size * numpy_dtype(x.dtype).itemsize <= max_bytes

    def visit(node: Node, inputs: tuple[Node, ...]) -> Node:
        node = with_inputs(node, inputs)
        if not small(node):
            return node  # never evaluated: `:seq 2147483647` must not fill 2^31 positions
        if node.op in (Op.CONSTANT, Op.IOTA):
            values[id(node)] = evaluate(node)
            return node
        if node.op in _UNFOLDED or not inputs or any(id(x) not in values for x in inputs):
            return node
        with np.errstate(all="ignore"):
            value = evaluate(node, *(values[id(x)] for x in inputs))
        folded = Node(
            Op.CONSTANT,
            node.dtype,
            node.shape,
            (),
            {"value": ConstArray(value), "shape": node.shape, "dtype": node.dtype},
            node.span,
        )
        values[id(folded)] = value
        return folded

    return rewrite(graph, visit)


def optimize(graph: Graph, check: Callable[[Graph], None] | None = None) -> Graph:
    """CSE, constant folding, CSE again, DCE; `check` (e.g. `verify`) runs after each."""
    for step in (cse, fold_constants, cse, dce):
        graph = step(graph)
        if check is not None:
            check(graph)
    return graph
