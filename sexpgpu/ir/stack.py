"""Stacking: one call of a training graph runs `k` microbatches at once.

`stack_microbatches(graph, k)` batches a graph as ``vmap`` would: every INPUT
gets a new leading axis of size `k` (microbatch ``i`` is row ``i``), every
value that depends on an input carries that axis in front, and values made
only from parameters, constants and iotas stay what they were (the same
nodes). Microbatch ``i`` is computed exactly as the original graph computes
it on microbatch ``i`` alone; each output is then summed over the `k`
microbatches (the loss: the sum of the losses; ``grad/x``: the sum of the
gradients), so any model and any loss stack, not only mean losses.

Each op has a rule (`_RULES`), chosen by which operands are batched:

* elementwise ops, ``where`` and ``matmul`` broadcast as NumPy does, from the
  trailing axes: a batched operand of lower rank than the result is first
  reshaped to ``[k 1.. *shape]``, so its batch axis lines up with the
  result's and never with another axis of size `k`;
* axis attributes (reductions, softmax, slice, pad, concat, transpose) move
  up by one, reshape and broadcast-to get `k` in front of their shapes;
* ops whose operands must share one shape (concat, the fused ops and their
  gradients) broadcast an unbatched operand to ``[k *shape]`` first;
* ``scatter-add`` gives each microbatch its own table: ids offset by
  ``i * rows`` into ``[k*rows ..]``, reshaped to ``[k rows ..]``;
* ``take`` from a batched table (a table computed from the data, which no
  model here makes) runs once per microbatch on slices and concatenates:
  exact, and each take keeps its id check (E-DATA-006).

Summing the outputs: where an output is the only use of a node linear in
its batched operands (add, sub, neg, a product or quotient by a shared
value, transpose, reshape, sum, matmul, scatter-add, a float-to-float
cast), the sum over the microbatches moves into the operands (`_TOTALS`):
a weight's gradient ``x^T g`` becomes one product over all microbatches'
rows, ``[m k*n]`` by ``[k*n p]``, a bias's one sum, and an embedding's one
scatter-add of every microbatch's ids into one table, so neither `k`
per-microbatch gradients nor ``[k*rows ..]`` tables are made. The sums are
the same, added in another order; through a cast (a bf16 product's f32
gradient) they are rounded once, as one batch of all the rows would be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sexpgpu.ir import builder as b
from sexpgpu.ir.dtypes import FLOATS, DType
from sexpgpu.ir.node import Graph, Node
from sexpgpu.ir.ops import BINARY, LEAF, UNARY, Op
from sexpgpu.ir.passes import optimize
from sexpgpu.ir.verify import verify

__all__ = ["stack_microbatches"]

_INT32_MAX = 2**31 - 1


def stack_microbatches(graph: Graph, k: int) -> Graph:
    """`graph` run on `k` microbatches at once, each output summed over them.

    Parameters
    ----------
    graph
        A program whose INPUT nodes hold one microbatch's data fields (a
        training graph: ``loss`` and ``grad/<param>``); PARAM nodes are
        shared by the microbatches.
    k
        The number of microbatches, 1 or more.

    Returns
    -------
    Graph
        INPUT nodes of the same names and dtypes with shapes ``[k *shape]``
        (microbatch ``i`` at index ``i``; also for ``k == 1``); PARAM,
        CONSTANT and IOTA nodes unchanged; outputs of the same names and
        shapes, each the sum over the microbatches of the original output
        (an output no input reaches is multiplied by `k`). Optimized, and
        verified after each pass.

    Raises
    ------
    ValueError
        When `k` is not a whole number of at least 1, or an output is bool
        (there is no sum of bools).
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"stack_microbatches: k must be a whole number >= 1, not {k!r}")
    for name, node in graph.outputs.items():
        if node.dtype is DType.BOOL:
            raise ValueError(f"stack_microbatches: output {name!r} is bool and has no sum")
    stacker = _Stacker(k, _uses(graph))
    for node in graph.nodes():
        stacker.visit(node)
    outputs = {name: stacker.total(node) for name, node in graph.outputs.items()}
    leaves = [stacker.value(n) for n in (*graph.inputs.values(), *graph.params.values())]
    return optimize(Graph.of(outputs, leaves), check=verify)


def _uses(graph: Graph) -> dict[int, int]:
    """How often each node is an operand or an output."""
    uses: dict[int, int] = {}
    operands = [x for node in graph.nodes() for x in node.inputs]
    for x in [*operands, *graph.outputs.values()]:
        uses[id(x)] = uses.get(id(x), 0) + 1
    return uses


class _Stacker:
    """The batched graph under construction.

    `stacked` maps each original node that depends on an input to its batched
    node (batch axis leading); every other node stands for itself.
    """

    def __init__(self, k: int, uses: dict[int, int]) -> None:
        self.k = k
        self.uses = uses
        self.stacked: dict[int, Node] = {}

    def value(self, node: Node) -> Node:
        """The node standing for original `node` in the new graph."""
        return self.stacked.get(id(node), node)

    def visit(self, node: Node) -> None:
        """Batch `node` if an input reaches it (its operands are visited already)."""
        if node.op is Op.INPUT:
            shape = (self.k, *node.shape)
            self.stacked[id(node)] = b.input(node.name, shape, node.dtype, span=node.span)
            return
        batched = tuple(id(x) in self.stacked for x in node.inputs)
        if not any(batched):
            return  # params, constants and what is made of them alone: shared
        xs = tuple(self.value(x) for x in node.inputs)
        result = _RULES[node.op](self, node, xs, batched)
        assert result.shape == (self.k, *node.shape), (node, result)
        assert result.dtype == node.dtype, (node, result)
        self.stacked[id(node)] = result

    def total(self, node: Node) -> Node:
        """Original `node` summed over the microbatches.

        Where the sum is `node`'s only use and `node` is linear in its
        batched operands, the sum moves into them (`_TOTALS`), so a weight's
        gradient is one product over all microbatches' rows and an embedding's
        one scatter-add of all their ids, not `k` of each summed after.
        """
        if id(node) not in self.stacked:
            # The same value for every microbatch: k times it.
            return b.mul(node, b.constant(self.k, node.dtype, span=node.span), span=node.span)
        rule = _TOTALS.get(node.op)
        if rule is not None and self.uses.get(id(node), 0) == 1:
            result = rule(self, node)
            if result is not None:
                assert result.shape == node.shape and result.dtype == node.dtype, (node, result)
                return result
        return b.sum(self.stacked[id(node)], axes=0, span=node.span)

    def batched(self, node: Node) -> bool:
        """Whether an input reaches original `node`."""
        return id(node) in self.stacked

    # ------------------------------------------------------------ helpers

    def emit(self, node: Node, *inputs: Node, **attrs) -> Node:
        """`node`'s op on `inputs`, with `node`'s attributes updated by `attrs`, at its span."""
        return b.emit(node.op, *inputs, span=node.span, **{**node.attrs, **attrs})

    def full(self, node: Node, x: Node, batched: bool) -> Node:
        """`x` with the batch axis: an unbatched operand repeated (a broadcast) `k` times."""
        if batched:
            return x
        return b.broadcast_to(x, (self.k, *x.shape), span=node.span)

    def aligned(self, node: Node, x: Node, batched: bool, rank: int) -> Node:
        """`x` ready to broadcast against values of original `rank` from the trailing axes.

        A batched operand of lower original rank gets size-1 axes after its
        batch axis (``[k 1.. *shape]``); an unbatched one needs nothing, its
        rank being at most `rank` (< the batched result's).
        """
        missing = rank - (x.ndim - 1)
        if not batched or missing == 0:
            return x
        return b.reshape(x, (self.k, *(1,) * missing, *x.shape[1:]), span=node.span)

    def slot(self, node: Node, x: Node, batched: bool, i: int) -> Node:
        """Microbatch `i` of operand `x`, in its original shape (unbatched: `x` itself)."""
        if not batched:
            return x
        row = b.slice(x, 0, i, i + 1, span=node.span)
        return b.reshape(row, x.shape[1:], span=node.span)


Rule = Callable[[_Stacker, Node, tuple[Node, ...], tuple[bool, ...]], Node]
_RULES: dict[Op, Rule] = {}


def _rule(*ops: Op) -> Callable[[Rule], Rule]:
    """Register the decorated function as the batching rule of `ops`."""

    def register(fn: Rule) -> Rule:
        for op in ops:
            assert op not in _RULES, f"{op} batched twice"
            _RULES[op] = fn
        return fn

    return register


def _shifted(axes: Sequence[int]) -> tuple[int, ...]:
    """Axis numbers of the original value as axes of the batched one (normalized: >= 0)."""
    return tuple(a + 1 for a in axes)


# ---------------------------------------------------------------- elementwise, products


@_rule(*UNARY, *BINARY, Op.WHERE, Op.UNIFORM, Op.MATMUL)
def _broadcasting(s: _Stacker, node: Node, xs, batched) -> Node:
    # matmul broadcasts its leading axes as the elementwise ops broadcast all
    # of theirs, and its two matrix axes are trailing: one alignment serves both.
    args = (s.aligned(node, x, bt, node.ndim) for x, bt in zip(xs, batched, strict=True))
    return s.emit(node, *args)


# ---------------------------------------------------------------- axis attributes


@_rule(Op.SUM, Op.MAX)
def _reduction(s: _Stacker, node: Node, xs, batched) -> Node:
    return s.emit(node, xs[0], axes=_shifted(node.attrs["axes"]))


@_rule(Op.SLICE, Op.PAD, Op.SOFTMAX, Op.LOG_SOFTMAX)
def _one_axis(s: _Stacker, node: Node, xs, batched) -> Node:
    return s.emit(node, xs[0], axis=node.attrs["axis"] + 1)


@_rule(Op.CONCAT, Op.SOFTMAX_GRAD)
def _one_axis_full(s: _Stacker, node: Node, xs, batched) -> Node:
    args = (s.full(node, x, bt) for x, bt in zip(xs, batched, strict=True))
    return s.emit(node, *args, axis=node.attrs["axis"] + 1)


@_rule(Op.TRANSPOSE)
def _transpose(s: _Stacker, node: Node, xs, batched) -> Node:
    return s.emit(node, xs[0], axes=(0, *_shifted(node.attrs["axes"])))


@_rule(Op.RESHAPE)
def _reshape(s: _Stacker, node: Node, xs, batched) -> Node:
    return s.emit(node, xs[0], shape=(s.k, *node.shape))


@_rule(Op.BROADCAST_TO)
def _broadcast_to(s: _Stacker, node: Node, xs, batched) -> Node:
    x = s.aligned(node, xs[0], True, node.ndim)  # new axes go after the batch axis
    return s.emit(node, x, shape=(s.k, *node.shape))


# ---------------------------------------------------------------- rows


@_rule(Op.TAKE)
def _take(s: _Stacker, node: Node, xs, batched) -> Node:
    table, ids = xs
    if not batched[0]:
        return s.emit(node, table, ids)  # [k *ids *row]: ids' batch axis leads
    return _each_microbatch(s, node, xs, batched)


@_rule(Op.SCATTER_ADD)
def _scatter_add(s: _Stacker, node: Node, xs, batched) -> Node:
    # Microbatch i's ids move to rows [i*rows, (i+1)*rows) of one table of k*rows
    # rows: each microbatch gets its own rows, summed as alone. The ids are
    # those a take has already checked (this op is take's gradient).
    rows = node.attrs["rows"]
    ids, updates = (s.full(node, x, bt) for x, bt in zip(xs, batched, strict=True))
    assert s.k * rows <= _INT32_MAX, "stacked scatter-add rows overflow int32 ids"
    which = b.iota(ids.shape, 0, DType.INT32, span=node.span)
    step = b.constant(rows, DType.INT32, span=node.span)
    offset = b.mul(which, step, span=node.span)
    moved = b.add(ids, offset, span=node.span)
    table = s.emit(node, moved, updates, rows=s.k * rows)
    return b.reshape(table, (s.k, *node.shape), span=node.span)


# ---------------------------------------------------------------- fused


@_rule(
    Op.LAYERNORM,
    Op.LAYERNORM_GRAD,
    Op.GELU,
    Op.GELU_GRAD,
    Op.CROSS_ENTROPY,
    Op.CROSS_ENTROPY_GRAD,
    Op.ATTENTION,
    Op.ATTENTION_GRAD,
)
def _rowwise(s: _Stacker, node: Node, xs, batched) -> Node:
    # Each works on its last axis (or last two) with any leading axes, and
    # wants its operands of one shape.
    return s.emit(node, *(s.full(node, x, bt) for x, bt in zip(xs, batched, strict=True)))


# ---------------------------------------------------------------- fallback


def _each_microbatch(s: _Stacker, node: Node, xs, batched) -> Node:
    """`node` run once per microbatch on slices of its batched operands, joined on axis 0.

    Exact for any op (each run is the original op on one microbatch's
    values), at the price of `k` nodes: for what no rule batches whole.
    """
    parts = []
    for i in range(s.k):
        args = (s.slot(node, x, bt, i) for x, bt in zip(xs, batched, strict=True))
        one = s.emit(node, *args)
        parts.append(b.reshape(one, (1, *one.shape), span=node.span))
    return b.concat(parts, axis=0, span=node.span)


# ---------------------------------------------------------------- sums moved inward
# `_TOTALS[op](stacker, node)`: the sum over the microbatches of original
# `node`, built from its operands' sums (`_Stacker.total`) where `node` is
# linear in them; None where the rule does not apply. The result is the same
# sum in another order of additions.

Total = Callable[[_Stacker, Node], Node | None]
_TOTALS: dict[Op, Total] = {}


def _total(*ops: Op) -> Callable[[Total], Total]:
    """Register the decorated function as the sum-moving rule of `ops`."""

    def register(fn: Total) -> Total:
        for op in ops:
            _TOTALS[op] = fn
        return fn

    return register


@_total(Op.ADD, Op.SUB, Op.NEG, Op.TRANSPOSE, Op.RESHAPE)
def _linear_total(s: _Stacker, node: Node) -> Node:
    # sum(a_i + b_i) = sum(a_i) + sum(b_i), a shared a counting k times.
    return s.emit(node, *(s.total(x) for x in node.inputs))


@_total(Op.MUL, Op.DIV)
def _scaled_total(s: _Stacker, node: Node) -> Node | None:
    # sum(a_i * c) = sum(a_i) * c for a shared c (a mean's 1/n); a_i / c likewise.
    batched = [s.batched(x) for x in node.inputs]
    if sum(batched) != 1 or (node.op is Op.DIV and not batched[0]):
        return None  # a product of two batched values, or c / a_i, is not linear
    operands = (s.total(x) if t else x for x, t in zip(node.inputs, batched, strict=True))
    return s.emit(node, *operands)


@_total(Op.SUM)
def _sum_total(s: _Stacker, node: Node) -> Node:
    # One reduction over the batch axis and the node's axes (bias gradients).
    x = s.stacked[id(node.inputs[0])]
    axes, keep = (0, *_shifted(node.attrs["axes"])), node.attrs["keepdims"]
    summed = b.sum(x, axes=axes, keepdims=keep, span=node.span)
    return b.reshape(summed, node.shape, span=node.span) if keep else summed


@_total(Op.CAST)
def _cast_total(s: _Stacker, node: Node) -> Node | None:
    # Float to float: the microbatches summed before the cast, as one batch of
    # all their rows is (a bf16 gradient product or bias sum cast to f32).
    if node.dtype not in FLOATS or node.inputs[0].dtype not in FLOATS:
        return None  # a cast to or from integers is not linear
    return s.emit(node, s.total(node.inputs[0]))


@_total(Op.MATMUL)
def _matmul_total(s: _Stacker, node: Node) -> Node | None:
    a, w = node.inputs
    if not s.batched(a):  # sum(a w_i) = a sum(w_i)
        return s.emit(node, a, s.total(w))
    if not s.batched(w):  # sum(a_i w) = sum(a_i) w
        return s.emit(node, s.total(a), w)
    if a.ndim != 2 or w.ndim != 2:
        return None
    # sum_i a_i w_i over [m n] by [n p] is one product [m k*n] by [k*n p].
    k, span = s.k, node.span
    (m, n), p = a.shape, w.shape[1]
    if (
        a.op is Op.TRANSPOSE and a.attrs["axes"] == (1, 0) and s.batched(a.inputs[0])
    ):  # a weight's gradient: x^T g
        rows = b.reshape(s.stacked[id(a.inputs[0])], (k * n, m), span=span)
        left = b.transpose(rows, span=span)  # a view: the product reads it transposed
    else:
        moved = b.transpose(s.stacked[id(a)], (1, 0, 2), span=span)
        left = b.reshape(moved, (m, k * n), span=span)
    right = b.reshape(s.stacked[id(w)], (k * n, p), span=span)
    return s.emit(node, left, right)


@_total(Op.SCATTER_ADD)
def _scatter_add_total(s: _Stacker, node: Node) -> Node:
    ids, updates = node.inputs
    if not s.batched(ids):
        return s.emit(node, ids, s.total(updates))  # one table, the updates summed
    # All microbatches' ids into one table of `rows` rows: no offsets, no k tables.
    new_ids = s.stacked[id(ids)]
    new_updates = s.full(node, s.value(updates), s.batched(updates))
    return s.emit(node, new_ids, new_updates)


assert frozenset(_RULES) == frozenset(Op) - LEAF
