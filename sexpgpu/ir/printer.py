"""Print a graph as S-expressions, and read the printed text back.

One line per node, in schedule order; ``shape`` and ``dtype`` attributes
are not repeated (they are the line's own dtype and shape)::

    (graph
      (%0 f32 [8 64] (input "x"))
      (%1 f32 [64 10] (param "w"))
      (%2 f32 [8 10] (matmul %0 %1))  ; gpt.lisp:14:9
      (%3 f32 [] (sum %2 :axes [0 1] :keepdims false))
      (output "loss" %3))

`parse_graph` reads this text through `sexpgpu.lang.reader` and rebuilds the
nodes with the builder (so every shape is checked again); spans are not
kept across a round trip.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sexpgpu.ir.builder import emit
from sexpgpu.ir.dtypes import DType, numpy_dtype
from sexpgpu.ir.node import ConstArray, Graph, Node
from sexpgpu.ir.ops import Op
from sexpgpu.lang.reader import read
from sexpgpu.lang.syntax import Keyword, ListNode, Literal, Symbol, Vector

__all__ = ["format_graph", "format_lines", "parse_graph"]

# Ops whose result shape or dtype is also an attribute (restored when parsing).
_SHAPE_ATTR = frozenset({Op.INPUT, Op.PARAM, Op.CONSTANT, Op.IOTA, Op.RESHAPE, Op.BROADCAST_TO})
_DTYPE_ATTR = frozenset({Op.INPUT, Op.PARAM, Op.CONSTANT, Op.IOTA, Op.CAST})


def format_lines(graph: Graph, spans: bool = True) -> tuple[list[str], list[Node]]:
    """The printed lines of `graph` and the node each line shows (None: not a node)."""
    order = graph.nodes()
    names = {id(n): f"%{i}" for i, n in enumerate(order)}
    lines, shown = ["(graph"], [None]
    for node in order:
        args = [names[id(x)] for x in node.inputs]
        for key, value in node.attr_key():
            if key not in ("shape", "dtype"):
                args += [f":{key}" if key != "name" else "", _value(value)]
        call = " ".join(a for a in [node.op.label, *args] if a)
        text = f"  ({names[id(node)]} {node.dtype} {_value(node.shape)} ({call}))"
        if spans and node.span is not None:
            text += f"  ; {node.span}"
        lines.append(text)
        shown.append(node)
    for name, node in graph.outputs.items():
        lines.append(f"  (output {_value(name)} {names[id(node)]})")
        shown.append(None)
    lines[-1] += ")"
    return lines, shown


def format_graph(graph: Graph, spans: bool = True) -> str:
    """`graph` as S-expression text (see the module docstring)."""
    return "\n".join(format_lines(graph, spans)[0])


def _value(value: Any) -> str:
    if isinstance(value, bool | np.bool_):
        return "true" if value else "false"
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, float | np.floating):
        value = float(value)
        return repr(value) if math.isfinite(value) else str(value)
    if isinstance(value, int | np.integer):
        return str(int(value))
    if isinstance(value, ConstArray):
        return _value(tuple(value.array.reshape(-1).tolist()))
    if isinstance(value, tuple | list):
        return "[" + " ".join(_value(v) for v in value) + "]"
    raise AssertionError(f"cannot print attribute {value!r}")


def parse_graph(text: str, name: str = "<graph>") -> Graph:
    """Rebuild the graph that `format_graph` printed as `text`."""
    (form,) = read(text, name)
    assert isinstance(form, ListNode) and form.items[0] == Symbol("graph", None)
    nodes: dict[str, Node] = {}
    leaves: list[Node] = []
    outputs: dict[str, Node] = {}
    for item in form.items[1:]:
        head = item.items[0]
        if isinstance(head, Symbol) and head.name == "output":
            outputs[_literal(item.items[1])] = nodes[item.items[2].name]
            continue
        ref, dtype_sym, shape_vec, call = item.items
        node = _parse_node(DType(dtype_sym.name), _literal(shape_vec), call, nodes)
        nodes[ref.name] = node
        if node.op in (Op.INPUT, Op.PARAM):
            leaves.append(node)
    return Graph.of(outputs, leaves)


def _parse_node(dtype: DType, shape: tuple, call: ListNode, nodes: dict[str, Node]) -> Node:
    op = Op.from_label(call.items[0].name)
    inputs, attrs, rest = [], {}, list(call.items[1:])
    while rest:
        item = rest.pop(0)
        if isinstance(item, Keyword):
            attrs[item.name] = _literal(rest.pop(0))
        elif isinstance(item, Symbol) and item.name.startswith("%"):
            inputs.append(nodes[item.name])
        else:
            attrs["name"] = _literal(item)
    if op in _SHAPE_ATTR:
        attrs["shape"] = shape
    if op in _DTYPE_ATTR:
        attrs["dtype"] = dtype
    if op is Op.CONSTANT and isinstance(attrs["value"], tuple):
        array = np.array(attrs["value"], dtype=numpy_dtype(dtype)).reshape(shape)
        attrs["value"] = ConstArray(array)
    node = emit(op, *inputs, **attrs)
    assert node.dtype == dtype and node.shape == shape, (node, dtype, shape)
    return node


def _literal(item: Any) -> Any:
    if isinstance(item, Literal):
        return item.value
    if isinstance(item, Vector):
        return tuple(_literal(x) for x in item.items)
    assert isinstance(item, Symbol), item
    return float(item.name)  # inf, -inf, nan
