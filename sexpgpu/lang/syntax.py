"""Syntax nodes: what the reader makes of an experiment's text.

Five frozen node types, each with the `Span` it was read from. Two nodes are
equal when their contents are equal; spans take no part in equality or
hashing, so ``Symbol("x", a) == Symbol("x", b)``.

=========  ==============================  ======================
node       text                            field
=========  ==============================  ======================
Symbol     ``width``, ``+``, ``->``        ``name``
Keyword    ``:steps``                      ``name`` (no colon)
Literal    ``42``, ``0.5``, ``"s"``,       ``value`` (int, float,
           ``true``                        str or bool)
ListNode   ``( ... )``                     ``items`` (a tuple)
Vector     ``[ ... ]``                     ``items`` (a tuple)
=========  ==============================  ======================
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sexpgpu.errors import Span

__all__ = [
    "Keyword",
    "ListNode",
    "Literal",
    "Node",
    "Symbol",
    "Vector",
    "describe",
    "literal_text",
    "unparse",
]


@dataclass(frozen=True, slots=True)
class Symbol:
    """A name: a parameter, a function, an operation, a data field."""

    name: str
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Keyword:
    """An argument name such as ``:steps``; `name` is ``"steps"``."""

    name: str
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True, eq=False)
class Literal:
    """An integer, float, string or boolean written in the text.

    Equal literals have equal values of the same type: ``1``, ``1.0`` and
    ``true`` are three different literals, unlike in Python.
    """

    value: int | float | str | bool
    span: Span = field(repr=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Literal):
            return NotImplemented
        return type(self.value) is type(other.value) and self.value == other.value

    def __hash__(self) -> int:
        return hash((type(self.value), self.value))


@dataclass(frozen=True, slots=True)
class ListNode:
    """``( ... )``: a form or a call."""

    items: tuple[Node, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Vector:
    """``[ ... ]``: `let` bindings, shapes, tuples."""

    items: tuple[Node, ...]
    span: Span = field(compare=False, repr=False)


Node = Symbol | Keyword | Literal | ListNode | Vector

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t"}


def unparse(node: Node) -> str:
    """The node as text that reads back to an equal node.

    Parameters
    ----------
    node
        Any syntax node.

    Returns
    -------
    str
        One line of S-expression text, items separated by single spaces.
    """
    if isinstance(node, Symbol):
        return node.name
    if isinstance(node, Keyword):
        return ":" + node.name
    if isinstance(node, Literal):
        return literal_text(node.value)
    inner = " ".join(unparse(item) for item in node.items)
    return f"({inner})" if isinstance(node, ListNode) else f"[{inner}]"


def literal_text(value: int | float | str | bool) -> str:
    """A literal value as the language writes it: ``true``, ``"a\\"b"``, ``0.0006``, ``42``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + "".join(_ESCAPES.get(ch, ch) for ch in value) + '"'
    return repr(value)


def describe(node: Node) -> str:
    """A short phrase naming the node's kind and text, for error messages.

    For example ``integer `3` `` or ``list `(every 5)` ``; long text is cut at 40 characters.
    """
    if isinstance(node, Literal):
        kind = {bool: "boolean", int: "integer", float: "float", str: "string"}[type(node.value)]
    else:
        kind = {Symbol: "symbol", Keyword: "keyword", ListNode: "list", Vector: "vector"}[
            type(node)
        ]
    text = unparse(node)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{kind} `{text}`"
