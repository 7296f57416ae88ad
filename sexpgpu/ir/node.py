"""The IR's one node type and the graph that names a program's ends.

A `Node` is an immutable SSA value: its op, dtype, static shape, input nodes,
attributes and the source span it came from. Nodes compare by identity, so a
graph is simply the set of nodes reachable from its outputs; `Graph.nodes`
lists them in a topological order (inputs before users).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from sexpgpu.errors import Span
from sexpgpu.ir.dtypes import DType
from sexpgpu.ir.ops import Op

__all__ = ["ConstArray", "Graph", "Node", "Shape", "topological_order"]

Shape = tuple[int, ...]


class ConstArray:
    """A read-only NumPy array usable as a hashable attribute (CONSTANT values)."""

    __slots__ = ("_digest", "array")

    def __init__(self, array: np.ndarray) -> None:
        array = np.array(array, copy=True)
        array.flags.writeable = False
        self.array = array
        self._digest = hashlib.blake2b(
            array.tobytes() + str((array.dtype, array.shape)).encode(), digest_size=16
        ).digest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConstArray) and self._digest == other._digest

    def __hash__(self) -> int:
        return hash(self._digest)

    def __repr__(self) -> str:
        return f"ConstArray({self.array.tolist()!r})"


@dataclass(frozen=True, eq=False)
class Node:
    """One SSA value of the IR.

    Parameters
    ----------
    op
        The operation.
    dtype
        The element type of the result.
    shape
        The static shape of the result (``()`` for a scalar).
    inputs
        The operand nodes, in the op's order.
    attrs
        The op's attributes (see `sexpgpu.ir.ops`), read-only.
    span
        Where in the experiment file the value comes from; backward nodes
        keep the span of their forward node.
    """

    op: Op
    dtype: DType
    shape: Shape
    inputs: tuple[Node, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)
    span: Span | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.attrs, MappingProxyType):
            object.__setattr__(self, "attrs", MappingProxyType(dict(self.attrs)))

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)  # a Python int: never wraps

    @property
    def name(self) -> str | None:
        """The name of an INPUT or PARAM node (None for other ops)."""
        return self.attrs.get("name")

    def attr_key(self) -> tuple[tuple[str, Any], ...]:
        """The attributes as a sorted, hashable tuple (for CSE and printing)."""
        return tuple(sorted(self.attrs.items()))

    def __repr__(self) -> str:
        dims = " ".join(map(str, self.shape))
        return f"<{self.op.label} {self.dtype} [{dims}] at {id(self):#x}>"


def topological_order(roots: Iterable[Node]) -> list[Node]:
    """Every node reachable from `roots`, each after its inputs (iterative DFS)."""
    order: list[Node] = []
    seen: set[int] = set()
    for root in roots:
        if id(root) in seen:
            continue
        stack: list[tuple[Node, Iterator[Node]]] = [(root, iter(root.inputs))]
        seen.add(id(root))
        while stack:
            node, pending = stack[-1]
            for child in pending:
                if id(child) not in seen:
                    seen.add(id(child))
                    stack.append((child, iter(child.inputs)))
                    break
            else:
                stack.pop()
                order.append(node)
    return order


@dataclass(frozen=True)
class Graph:
    """A program: named data inputs, named parameters and named outputs.

    Build one with `Graph.of`, which finds the INPUT and PARAM leaves.

    Parameters
    ----------
    inputs
        Data placeholders (INPUT nodes) by name.
    params
        Parameters (PARAM nodes) by name.
    outputs
        The values the program returns, by name (insertion order is kept).
    """

    inputs: Mapping[str, Node]
    params: Mapping[str, Node]
    outputs: Mapping[str, Node]

    @classmethod
    def of(cls, outputs: Mapping[str, Node], leaves: Iterable[Node] = ()) -> Graph:
        """The graph computing `outputs`, its inputs and parameters found by a walk.

        Parameters
        ----------
        outputs
            Output name -> node.
        leaves
            INPUT or PARAM nodes to keep even if no output uses them (so that
            a feed for them is accepted).
        """
        inputs: dict[str, Node] = {}
        params: dict[str, Node] = {}
        for node in [*topological_order(outputs.values()), *leaves]:
            if node.op not in (Op.INPUT, Op.PARAM):
                continue
            table = inputs if node.op is Op.INPUT else params
            other = table.get(node.name)
            assert other is None or other is node, f"two {node.op.label}s named {node.name}"
            table[node.name] = node
        return cls(inputs, params, dict(outputs))

    def nodes(self) -> list[Node]:
        """Every node of the program in topological order, declared leaves first."""
        return list(self._order)

    @functools.cached_property
    def _order(self) -> tuple[Node, ...]:
        # Made once: a graph and its nodes never change (passes build new ones).
        leaves = [*self.inputs.values(), *self.params.values()]
        return tuple(topological_order([*leaves, *self.outputs.values()]))

    def with_outputs(self, outputs: Mapping[str, Node]) -> Graph:
        """The same inputs and parameters with new outputs."""
        return Graph.of(outputs, [*self.inputs.values(), *self.params.values()])
