"""Reverse-mode autodiff: a reverse walk over the graph applying `VJP_RULES`.

Cotangents of a value used several times are added up as they arrive (fan
out); values that do not depend on any `wrt` node are skipped; the backward
nodes keep their forward node's span.
"""

from __future__ import annotations

from collections.abc import Sequence

from sexpgpu.ir import builder as b
from sexpgpu.ir import vjp_rules as _vjp_rules  # noqa: F401  (fills VJP_RULES)
from sexpgpu.ir.dtypes import FLOATS
from sexpgpu.ir.node import Graph, Node, topological_order
from sexpgpu.ir.ops import Op
from sexpgpu.ir.rules import VJP_EXEMPT, VJP_RULES

__all__ = ["grad", "training_graph"]


def grad(loss: Node, wrt: Sequence[Node], cotangent: Node | None = None) -> tuple[Node, ...]:
    """The gradient of `loss` with respect to each node of `wrt`, as IR nodes.

    Parameters
    ----------
    loss
        The value to differentiate; a scalar unless `cotangent` is given.
    wrt
        Nodes (usually PARAM nodes) to differentiate with respect to.
    cotangent
        The cotangent of `loss` (default: 1 for a scalar loss).

    Returns
    -------
    tuple of Node
        One node per `wrt` entry, of its shape and dtype (zeros where `loss`
        does not depend on it).
    """
    if cotangent is None:
        assert loss.shape == (), f"grad of a non-scalar {loss} needs a cotangent"
        cotangent = b.constant(1.0, loss.dtype, span=loss.span)
    assert cotangent.shape == loss.shape and cotangent.dtype == loss.dtype
    order = topological_order([loss])
    active = _depends_on(order, wrt)
    wanted = {id(w) for w in wrt}
    cts: dict[int, list[Node]] = {id(loss): [cotangent]}
    found: dict[int, Node] = {}
    for node in reversed(order):
        parts = cts.pop(id(node), None)
        if parts is None:
            continue
        g = _total(parts)
        if id(node) in wanted:
            found[id(node)] = g
        if node.op in VJP_EXEMPT or id(node) not in active:
            continue
        needs = tuple(id(x) in active and x.dtype in FLOATS for x in node.inputs)
        for x, gx in zip(node.inputs, VJP_RULES[node.op](node, g, needs), strict=True):
            if gx is None or id(x) not in active:
                continue
            assert gx.shape == x.shape, (node, x, gx)
            if gx.dtype != x.dtype:
                gx = b.cast(gx, x.dtype, span=node.span)
            cts.setdefault(id(x), []).append(gx)
    return tuple(found.get(id(w)) or _zeros(w) for w in wrt)


def _total(parts: list[Node]) -> Node:
    """The sum of a value's cotangent contributions (fan-out).

    Contributions that are zero-padded slices tiling one axis without
    overlap (the cotangents of ``q``, ``k``, ``v`` cut from one ``qkv``) are
    joined with one ``concat`` instead of padded and added.
    """
    joined = _join_pads(parts)
    if joined is not None:
        return joined
    total = parts[0]
    for part in parts[1:]:
        total = b.add(total, part, span=part.span)
    return total


def _join_pads(parts: list[Node]) -> Node | None:
    if len(parts) < 2 or any(p.op is not Op.PAD for p in parts):
        return None
    axis = parts[0].attrs["axis"]
    if any(p.attrs["axis"] != axis for p in parts):
        return None
    pieces, at = [], 0
    for p in sorted(parts, key=lambda p: p.attrs["before"]):
        start = p.attrs["before"]
        if start < at:
            return None  # overlapping ranges: add them
        if start > at:
            pieces.append(_zeros_like_gap(p, axis, start - at))
        pieces.append(p.inputs[0])
        at = start + p.inputs[0].shape[axis]
    end = parts[0].shape[axis]
    if at < end:
        pieces.append(_zeros_like_gap(parts[0], axis, end - at))
    return b.concat(pieces, axis, span=parts[0].span)


def _zeros_like_gap(like: Node, axis: int, size: int) -> Node:
    shape = (*like.shape[:axis], size, *like.shape[axis + 1 :])
    zero = b.constant(0.0, like.dtype, span=like.span)
    return b.broadcast_to(zero, shape, span=like.span)


def _depends_on(order: list[Node], wrt: Sequence[Node]) -> set[int]:
    """Ids of the nodes of `order` that depend on some `wrt` node (wrt included)."""
    active = {id(w) for w in wrt}
    for node in order:
        if any(id(x) in active for x in node.inputs):
            active.add(id(node))
    return active


def _zeros(node: Node) -> Node:
    zero = b.constant(0.0, node.dtype, span=node.span)
    return b.broadcast_to(zero, node.shape, span=node.span)


def training_graph(forward: Graph, loss: str = "loss", prefix: str = "grad/") -> Graph:
    """`forward` with the gradient of output `loss` for every parameter added.

    The result's outputs are those of `forward` followed by ``prefix + name``
    for each parameter, in `forward.params` order.
    """
    params = list(forward.params.values())
    grads = grad(forward.outputs[loss], params)
    outputs = dict(forward.outputs)
    outputs.update({prefix + p.name: g for p, g in zip(params, grads, strict=True)})
    return forward.with_outputs(outputs)
