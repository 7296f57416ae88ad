"""The vocabulary's registry: `Entry`, the `VOCABULARY` table and the `entry` decorator.

`sexpgpu.ir.vocabulary` (arithmetic, activations, reductions, shape,
products) and `sexpgpu.ir.vocabulary_layers` (layers and losses) fill the
table; both import this module and nothing imports them back, so the
imports run one way: ``vocabulary -> vocabulary_layers -> vocabulary_table``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sexpgpu.errors import Span
from sexpgpu.ir import builder as b
from sexpgpu.ir.node import Node
from sexpgpu.ir.trace_call import Call, Value

__all__ = ["VOCABULARY", "Entry", "entry", "mean_over"]

Fn = Callable[[Call], Value]


@dataclass(frozen=True)
class Entry:
    """A vocabulary function.

    Attributes
    ----------
    name
        The name users call.
    fn
        ``fn(call) -> value``.
    usage
        How to call it, shown in hints: ``(linear x n :bias true)``.
    min_args, max_args
        Positional argument counts (max None: any number).
    keywords
        Keyword name -> default (None: absent unless written).
    layer
        Whether calls own parameters (and so take a segment of the path name).
    quoted
        Keywords whose bare symbols are taken as names (``:dtype bf16``)
        unless they are bound.
    """

    name: str
    fn: Fn
    usage: str
    min_args: int
    max_args: int | None
    keywords: Mapping[str, Any] = field(default_factory=dict)
    layer: bool = False
    quoted: frozenset[str] = frozenset()


VOCABULARY: dict[str, Entry] = {}


def entry(
    name: str,
    usage: str,
    args: tuple[int, int | None] = (1, 1),
    keywords: Mapping[str, Any] | None = None,
    layer: bool = False,
    quoted: tuple[str, ...] = (),
) -> Callable[[Fn], Fn]:
    """Register the decorated function as the vocabulary entry `name`."""

    def decorate(fn: Fn) -> Fn:
        assert name not in VOCABULARY, name
        VOCABULARY[name] = Entry(
            name, fn, usage, args[0], args[1], dict(keywords or {}), layer, frozenset(quoted)
        )
        return fn

    return decorate


def _scale(x: Node, factor: float, span: Span | None) -> Node:
    """``x * factor`` with the constant in x's dtype."""
    return b.mul(x, b.constant(factor, x.dtype, span=span), span=span)


def mean_over(x: Node, axes: tuple[int, ...] | None, keep: bool, span: Span | None) -> Node:
    """The mean over `axes` (all when None): a sum times one over the count."""
    total = b.sum(x, axes, keepdims=keep, span=span)
    count = x.size // max(total.size, 1) if x.size else 1
    return _scale(total, 1.0 / count, span)
