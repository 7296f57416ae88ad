"""Sibling products: one input times several weights, made one product.

A Llama block multiplies its normalized input by the query, key and value
weights, and the next one by the SwiGLU's gate and up weights: products that
share their left operand. `merge_siblings` makes each such group one
product with the weights joined along their columns, and each old product a
slice of its result::

    (matmul x Wq) (matmul x Wk) (matmul x Wv)
      ->  y = (matmul x (concat Wq Wk Wv))   (slice y ...) for each

One wide product keeps the GPU's product kernels busier than several narrow
ones (profiled: a SwiGLU's gate and up products apart ran 5 to 7% slower
per FLOP than PyTorch's joined one, benches/README.md), and the backward follows
the forward only: the pass runs on the training graph, after the
backward is made, so each weight's gradient and the input's gradient stay
products of their own (joining those would join the cotangents into one
buffer first, more memory than the products save). Only weights join (a
parameter, or a cast of one): joining them costs a copy of the weights, not
of activations. The same arithmetic, summed in another order: not the same
bits as the products apart.
"""

from __future__ import annotations

from sexpgpu.ir import builder as b
from sexpgpu.ir.node import Graph, Node, topological_order
from sexpgpu.ir.ops import VIEW, Op
from sexpgpu.ir.passes import cse, rewrite, with_inputs

__all__ = ["merge_siblings"]


def _weight(node: Node) -> bool:
    """A parameter, or a cast of one: a matrix joined for the cost of a copy."""
    if node.op is Op.CAST:
        node = node.inputs[0]
    return node.op is Op.PARAM and node.ndim == 2


def _held(graph: Graph, loss: str) -> set[int]:
    """The forward values (of output `loss`) the backward reads, directly or through views."""
    forward = {id(n) for n in topological_order([graph.outputs[loss]])}
    held: set[int] = set()
    for node in graph.nodes():
        if id(node) not in forward:
            for x in node.inputs:
                while id(x) in forward and id(x) not in held:
                    held.add(id(x))
                    if x.op not in VIEW:
                        break
                    x = x.inputs[0]
    return held


def merge_siblings(graph: Graph, loss: str | None = None) -> Graph:
    """`graph` with each group of products of one input by weights made one product.

    Common subexpressions are merged first: each linear layer reshapes its
    input for itself. In a training graph (`loss` its forward's output),
    products the backward reads join only products it reads too, and the
    others only others: a slice kept for the backward (attention's values)
    would keep its siblings' bytes (the queries and keys, which the
    backward does not read) alive with it.
    """
    given, graph = graph, cse(graph)
    held = _held(graph, loss) if loss is not None else set()
    groups: dict[tuple[int, str, bool], list[Node]] = {}
    for node in graph.nodes():
        if node.op is Op.MATMUL and _weight(node.inputs[1]):
            key = (id(node.inputs[0]), node.dtype.name, id(node) in held)
            groups.setdefault(key, []).append(node)
    members = {id(n): group for group in groups.values() if len(group) > 1 for n in group}
    if not members:
        return given
    merged: dict[int, Node] = {}  # first member's id -> the one product

    def visit(node: Node, inputs: tuple[Node, ...]) -> Node:
        group = members.get(id(node))
        if group is None:
            return with_inputs(node, inputs)
        first = group[0]
        if id(first) not in merged:
            # The weights are leaves' casts, which no pass here rebuilds.
            weights = b.concat([m.inputs[1] for m in group], axis=1, span=first.span)
            merged[id(first)] = b.matmul(inputs[0], weights, span=first.span)
        start = 0
        for m in group:
            if m is node:
                break
            start += m.shape[-1]
        last = node.ndim - 1
        return b.slice(merged[id(first)], last, start, start + node.shape[-1], span=node.span)

    return rewrite(graph, visit)
