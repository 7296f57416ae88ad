"""Recomputation: forward values the backward reads, made again there instead of kept.

A training graph's forward (what its loss depends on) leaves values for the
backward: each forward value a backward node reads stays alive from the
forward to that read. `recompute_graph` rewrites the graph so that chosen
values are made again in the backward from values that are kept, and `fit`
chooses them for a memory budget, with the least added work:

1. **the moves** (`moves`): a greedy walk over the kept values, each step
   taking the move that frees the most kept bytes per unit of added work.
   A move recomputes one kept value from what is kept so far; or, where an
   operand it reads is not kept, that operand with it, back to kept values
   (recomputing a block's output from its input is such a move, so
   whole-block checkpointing is one point of the walk, not the only one).
   Work is counted per op (`work`): a product's ``2 M N K``, attention's two
   products, a few per element for elementwise ops and normalizations, so
   norms, casts and activations go first and products last;
2. **the prefix**: the fewest moves whose graph fits, found by bisection
   with the device's own live-set estimate (the ``fits`` callable), which
   sees the schedule, views and in-place reuse that the walk's byte count
   does not;
3. **checkpointing at the cuts**, where even the walk's last move does not
   fit: every forward value is made again except the cuts (`cuts`), the
   values every path from the model's input to the loss passes through (a
   residual network's sums between its blocks and sub-blocks). A segment's
   values are then made again from the cut before it, in the segment's own
   backward, so only the cuts and one segment live at once. It costs about
   one more forward. Where it does not fit, every second cut is kept, then
   every third, every fourth; when none fits, nothing does;
4. **keeping back**, where checkpointing fits with room to spare: the
   recomputed values that save the most work per byte kept (products
   first, and among equals the latest in the forward, whose backward comes
   first, before most gradients exist) are kept again, the most that still
   fit, found by bisection. A model whose peak comes at the end of the
   backward keeps most of its late blocks' products this way.

Apart from any budget, `cheap` lists what a fusing device makes again
always, as PyTorch's partitioner does: kept values of the ops made in one
pass over their operands (`ONE_PASS`: elementwise ops, norms, gelu) made
from kept values only. Making them again frees their bytes and keeps
nothing new; the backward's fused kernels make them where they read them.

Values are counted by buffer: a view (reshape, transpose, broadcast, slice)
shares its operand's buffer, is never a choice of its own, and is made again
with the buffer it views. A recomputed value is made once, by its first
reader in the backward, from the same operands in the same order, so it
holds the same bits as the forward's.

The rewritten graph lists the parameters' gradients last parameter first:
the schedule (a depth-first walk from the outputs, `Graph.nodes`) then makes
each layer's weight gradients as soon as its backward reaches them, instead
of holding every layer's activation gradients (and the values their products
read) to the end of the step.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable

from sexpgpu.ir.dtypes import DType
from sexpgpu.ir.node import Graph, Node, topological_order
from sexpgpu.ir.ops import ELEMENTWISE, FUSED, LEAF, VIEW, Op

__all__ = [
    "ONE_PASS",
    "Move",
    "Recomputation",
    "cheap",
    "cuts",
    "fit",
    "moves",
    "recompute_graph",
    "work",
]

_ITEMSIZE = {DType.F32: 4, DType.BF16: 2, DType.F64: 8, DType.INT32: 4, DType.BOOL: 1}
# Work per element of the fused ops, relative to an add (their exp, rsqrt, tanh, rows).
_PER_ELEMENT = {op: 5 for op in FUSED} | {Op.LAYERNORM: 8, Op.GELU: 8}
# The ops a fusing device makes inside the kernel that reads their value, in one pass over
# their operands (`cheap`): elementwise ones, and those whose element reads one row of
# its operand (a norm, a softmax, gelu). A layernorm made again reads its input where the
# kept value was read: the same bytes, and the forward no longer writes it.
ONE_PASS = ELEMENTWISE | {Op.GELU, Op.LAYERNORM, Op.SOFTMAX, Op.LOG_SOFTMAX}


_NEVER = 1 << 62
_SPACINGS = (1, 2, 3, 4)  # which cuts checkpointing keeps: every one, every second, ...
_NEARBY = 8


def work(node: Node) -> int:
    """What making `node` costs, in FLOP-like units: products dominate, views are free."""
    if node.op in LEAF or node.op in VIEW:
        return 0
    if node.op is Op.MATMUL:
        return 2 * node.size * node.inputs[0].shape[-1]
    if node.op is Op.ATTENTION:
        q = node.inputs[0]
        return 4 * q.size * q.shape[-2]  # (.. S D) * S, as `matmul_flops` counts it
    elements = max([node.size, *(x.size for x in node.inputs)])
    return _PER_ELEMENT.get(node.op, 1) * elements


def _bytes(node: Node) -> int:
    return node.size * _ITEMSIZE[node.dtype]


def _root(node: Node) -> Node:
    """The node whose buffer `node` lives in (itself unless a view)."""
    while node.op in VIEW:
        node = node.inputs[0]
    return node


@dataclasses.dataclass(frozen=True)
class Move:
    """One step of the walk: values to recompute, the kept bytes it frees, the work it adds."""

    roots: tuple[Node, ...]
    freed: int
    work: int


class _Boundary:
    """What the backward reads of the forward, and which buffers that keeps.

    `needed` holds the forward nodes read after the forward (by the backward
    or by recomputed values); a needed node whose buffer is recomputed is
    made again, and its operands are needed in turn; any other needed node
    keeps its buffer (`kept`), except leaves, which the step holds anyway.
    """

    def __init__(self, graph: Graph, loss: str) -> None:
        forward = topological_order([graph.outputs[loss]])
        self.nodes: dict[int, Node] = {id(n): n for n in forward}
        self.position = {id(n): i for i, n in enumerate(forward)}  # ties go the same way each run
        self.needed: set[int] = set()
        self.by_root: dict[int, list[Node]] = {}  # needed nodes per buffer
        for node in graph.nodes():
            if id(node) not in self.nodes:
                for x in node.inputs:
                    if id(x) in self.nodes:
                        self._need(x)
        self.recomputed: set[int] = set()
        self.kept = {r for r in self.by_root if self.nodes[r].op not in LEAF}
        self._cache: dict[int, tuple[list[Move], set[int]]] = {}  # kept buffer -> its moves
        # When the backward first reads each buffer, and when a recomputed value first
        # reads it (schedule positions). A value made again for a reader well before
        # its own first read (the residual stream, each layer's input rebuilt from the
        # one before at the start of the backward) lives about as long as the kept one
        # did: not a choice. "Well before": the backward first reads more than
        # `_NEARBY` other kept buffers in between (a layer's backward reads a dozen
        # or two), or the reader is such an early copy itself (a chain of them).
        self.direct: dict[int, int] = {}
        self.copy_read: dict[int, int] = {}
        for at, node in enumerate(_reordered(graph, loss).nodes()):
            if id(node) not in self.nodes:
                for x in node.inputs:
                    r = id(_root(x))
                    if r in self.nodes and at < self.direct.get(r, _NEVER):
                        self.direct[r] = at
        self.first_reads = sorted(self.direct[r] for r in self.kept)
        self.early_readers: set[int] = set()  # buffers first read by a copy made early itself

    def _too_early(self, r: int) -> bool:
        """Whether kept buffer `r` would be made again well before the backward reads it."""
        made, read = self.copy_read.get(r, _NEVER), self.direct.get(r, _NEVER)
        if made >= read or read == _NEVER:
            return False
        if r in self.early_readers:
            return True  # a chain of early copies: each layer's input from the one before
        between = bisect_left(self.first_reads, read) - bisect_right(self.first_reads, made)
        return between > _NEARBY

    def _need(self, node: Node) -> None:
        if id(node) not in self.needed:
            self.needed.add(id(node))
            self.by_root.setdefault(id(_root(node)), []).append(node)

    def _closure(
        self, root: Node, extra: set[int], pull: bool, reads: set[int] | None = None
    ) -> tuple[list[Node], set[int], int]:
        """Recomputing `root` (and the roots in `extra`): (newly needed, newly kept, work).

        With `pull`, a buffer an operand lives in that is not kept yet is
        recomputed as well (added to `extra`) instead of being kept. `reads`
        collects the buffers the recomputed values read.
        """
        newly = {id(root)} | extra
        new_needed: list[Node] = []
        new_kept: set[int] = set()
        reads = set() if reads is None else reads
        added = 0
        stack = [*self.by_root.get(id(root), []), root]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            base = _root(node)
            if id(node) in seen or base.op in LEAF:
                continue
            seen.add(id(node))
            b = id(base)
            if b not in newly:
                reads.add(b)
            if b not in self.recomputed and b not in newly:
                if b in self.kept:
                    continue
                if not pull:
                    new_kept.add(b)
                    continue
                newly.add(b)
                extra.add(b)
            if b not in newly and id(node) in self.needed:
                continue  # made again already, its operands needed already
            added += work(node)
            if id(node) not in self.needed:
                new_needed.append(node)
            stack.extend(node.inputs)
        return new_needed, new_kept, added

    def candidates(self) -> list[Move]:
        """Per kept buffer: recompute it from what is kept, or back to kept values."""
        for r in self.kept - self._cache.keys():
            self._cache[r] = self._moves_of(r)
        return [m for r in sorted(self.kept, key=self.position.get) for m in self._cache[r][0]]

    def _moves_of(self, r: int) -> tuple[list[Move], set[int]]:
        """The moves of kept buffer `r`, and the buffers they looked at (when to look again)."""
        touched = {r}
        if self._too_early(r):
            return [], touched
        found = []
        root = self.nodes[r]
        _, new_kept, added = self._closure(root, set(), False, touched)
        freed = _bytes(root) - sum(_bytes(self.nodes[k]) for k in new_kept)
        if freed > 0:
            found.append(Move((root,), freed, added))
        if new_kept:
            extra: set[int] = set()
            _, _, added = self._closure(root, extra, True, touched)
            touched |= extra
            roots = (root, *(self.nodes[e] for e in sorted(extra, key=self.position.get)))
            found.append(Move(roots, _bytes(root), added))
        return found, touched

    def apply(self, move: Move) -> None:
        """Take `move`: its buffers are recomputed, what they read is needed."""
        chosen = {id(n) for n in move.roots}
        reads: set[int] = set()
        new_needed, new_kept, _ = self._closure(move.roots[0], set(chosen), False, reads)
        r = id(move.roots[0])
        made = min(self.direct.get(r, _NEVER), self.copy_read.get(r, _NEVER))
        early = made < self.direct.get(r, _NEVER)
        for b in reads:
            if made < self.copy_read.get(b, _NEVER):
                self.copy_read[b] = made
                if early:
                    self.early_readers.add(b)
                else:
                    self.early_readers.discard(b)
        for node in new_needed:
            self._need(node)
        self.recomputed |= chosen
        self.kept = (self.kept - chosen) | new_kept
        # Moves that looked at a buffer whose state changed are found again.
        changed = chosen | new_kept | reads | {id(_root(n)) for n in new_needed}
        for k in [k for k, (_, touched) in self._cache.items() if touched & changed]:
            del self._cache[k]


def moves(graph: Graph, loss: str = "loss") -> list[Move]:
    """The greedy walk over `graph`'s kept values (see the module docstring), in order.

    Each move's ``freed`` is its bytes per unit of ``work`` best among those
    left at its turn (ties: the more bytes); the walk ends when no move
    frees anything.
    """
    boundary = _Boundary(graph, loss)
    walk: list[Move] = []

    def rank(m: Move) -> tuple:
        return (m.freed / (m.work + 1), m.freed, -len(m.roots), boundary.position[id(m.roots[0])])

    while True:
        found = boundary.candidates()
        if not found:
            return walk
        best = max(found, key=rank)
        boundary.apply(best)
        walk.append(best)


def cheap(graph: Graph, loss: str = "loss", *, into_products: bool = True) -> list[Node]:
    """The kept buffers free to make again: values of `ONE_PASS` ops made from kept values.

    Taken one at a time, most bytes first, so that a chain (a sigmoid, then
    the product with it) goes whole. A cast of a leaf stays kept (a fusing
    device reads the parameters' copies). Without `into_products`, a value
    a product or another fused op reads in the backward stays kept too: it
    would be made into a buffer of its own there, an extra pass.
    """
    boundary = _Boundary(graph, loss)
    readers: dict[int, set[Op]] = {}
    for node in graph.nodes():
        if id(node) not in boundary.nodes:
            for x in node.inputs:
                readers.setdefault(id(_root(x)), set()).add(node.op)
    pointwise = ELEMENTWISE | VIEW

    def free(move: Move) -> bool:
        (root,) = move.roots if len(move.roots) == 1 else (None,)
        return (
            root is not None
            and root.op in ONE_PASS
            and move.freed == _bytes(root)
            and not all(_root(x).op in LEAF for x in root.inputs)
            and (into_products or readers.get(id(root), set()) <= pointwise)
        )

    taken: list[Node] = []
    while found := [m for m in boundary.candidates() if free(m)]:
        best = max(found, key=lambda m: (m.freed, -boundary.position[id(m.roots[0])]))
        boundary.apply(best)
        taken.append(best.roots[0])
    return taken


def cuts(graph: Graph, loss: str = "loss") -> list[Node]:
    """The forward's cut values, in forward order: each lies on every path to the loss.

    These are the post-dominators of the forward value deepest in the
    post-dominator tree (the nodes that every path from it to output `loss`
    passes through): in a residual network, the sums that join a block's
    branch and its skip.
    Views are followed to the buffer they view.
    """
    forward = topological_order([graph.outputs[loss]])
    inside = {id(n) for n in forward}
    readers: dict[int, list[Node]] = {}
    for node in forward:
        for x in node.inputs:
            readers.setdefault(id(x), []).append(node)
    # Immediate post-dominators, from the loss back: the deepest node on every
    # reader's chain (the classic intersection, by depth on the post-dominator tree).
    parent: dict[int, Node | None] = {}
    depth: dict[int, int] = {}
    for node in reversed(forward):
        users = [u for u in readers.get(id(node), []) if id(u) in inside]
        if not users:
            parent[id(node)], depth[id(node)] = None, 0
            continue
        meet: Node | None = users[0]
        for user in users[1:]:
            a, b = meet, user
            while a is not b:
                if a is None or b is None:
                    a = b = None
                    break
                if depth[id(a)] >= depth[id(b)]:
                    a = parent[id(a)]
                else:
                    b = parent[id(b)]
            meet = a
        parent[id(node)] = meet
        depth[id(node)] = -1 if meet is None else depth[id(meet)] + 1
    # The longest chain: from a value at the model's input (a weight shared with the
    # head, as a tied embedding, is post-dominated by the logits alone).
    values = [n for n in forward if n.op not in LEAF]
    start = max(values, key=lambda n: depth[id(n)], default=None)
    chain: list[Node] = []
    node = None if start is None else parent[id(start)]
    while node is not None:
        base = _root(node)
        if base.op not in LEAF and (not chain or chain[-1] is not base):
            chain.append(base)
        node = parent[id(node)]
    return chain


def _checkpointed(
    graph: Graph, loss: str, every: int = 1, found: list[Node] | None = None
) -> list[Node]:
    """The buffers to make again when checkpointing at every `every`-th cut: all but those.

    `found`: the graph's `cuts`, where the caller has them already.
    """
    found = cuts(graph, loss) if found is None else found
    keep = {id(n) for n in found[every - 1 :: every]}
    forward = topological_order([graph.outputs[loss]])
    return [n for n in forward if n.op not in LEAF and n.op not in VIEW and id(n) not in keep]


def recompute_graph(graph: Graph, roots: Iterable[Node], loss: str = "loss") -> Graph:
    """`graph` with the forward values in the buffers of `roots` made again in the backward.

    The forward is what output `loss` depends on; every other node reads a
    recomputed copy of each forward value whose buffer is in `roots`
    (views of it included), made from recomputed or kept operands. Outputs
    keep their names; the gradients are listed in reverse order.
    """
    return _rewrite(graph, roots, loss)[0]


def _rewrite(graph: Graph, roots: Iterable[Node], loss: str) -> tuple[Graph, int]:
    """`recompute_graph`, and how many values (views apart) it makes again."""
    chosen = {id(r) for r in roots}
    forward = {id(n) for n in topological_order([graph.outputs[loss]])}
    copies: dict[int, Node] = {}

    def copy(node: Node) -> Node:
        # Iterative: a chain of recomputed values can be as deep as the model.
        stack = [node]
        while stack:
            top = stack[-1]
            if id(top) in copies or id(_root(top)) not in chosen:
                stack.pop()
                continue
            pending = [x for x in top.inputs if id(_root(x)) in chosen and id(x) not in copies]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            inputs = tuple(copies.get(id(x), x) for x in top.inputs)
            copies[id(top)] = Node(top.op, top.dtype, top.shape, inputs, top.attrs, top.span)
        return copies.get(id(node), node)

    new: dict[int, Node] = {}
    for node in graph.nodes():
        if id(node) in forward:
            new[id(node)] = node
            continue
        inputs = tuple(copy(x) if id(x) in forward else new[id(x)] for x in node.inputs)
        same = all(a is b for a, b in zip(inputs, node.inputs, strict=True))
        new[id(node)] = (
            node if same else Node(node.op, node.dtype, node.shape, inputs, node.attrs, node.span)
        )
    outputs = {name: new[id(node)] for name, node in graph.outputs.items()}
    rewritten = _reordered(graph.with_outputs(outputs), loss)
    return rewritten, sum(1 for n in copies.values() if n.op not in VIEW)


def _reordered(graph: Graph, loss: str) -> Graph:
    """`graph` with output `loss` first and the others (the gradients) in reverse order."""
    names = list(graph.outputs)
    order = [n for n in names if n == loss] + [n for n in reversed(names) if n != loss]
    return graph.with_outputs({name: graph.outputs[name] for name in order})


@dataclasses.dataclass(frozen=True)
class Recomputation:
    """The rewritten graph that fits, or the cheapest full recomputation where none does.

    Attributes
    ----------
    graph
        The training graph to run.
    values
        Forward values made again in the backward (views not counted).
    flops, base_flops
        The products' FLOPs (`sexpgpu.ir.compile.matmul_flops`'s count) of
        `graph` and of the graph without recomputation.
    fits
        Whether `graph` fits the budget.
    """

    graph: Graph
    values: int
    flops: int
    base_flops: int
    fits: bool

    def line(self, plan: str) -> str:
        """``recompute: 412 values, +18% FLOPs, plan 31.2 of 40.0 GiB`` (`plan` the last part)."""
        extra = 100.0 * (self.flops - self.base_flops) / self.base_flops if self.base_flops else 0.0
        shown = f"{extra:+.1f}" if abs(extra) < 10 else f"{extra:+.0f}"  # +0.4%: cheap values
        return f"recompute: {self.values} values, {shown}% FLOPs, {plan}"


def fit(
    graph: Graph,
    fits: Callable[[Graph], bool],
    flops: Callable[[Graph], int],
    loss: str = "loss",
) -> Recomputation | None:
    """The least recomputation of `graph` that `fits`; None where `graph` fits as it is.

    Parameters
    ----------
    graph
        A training graph (output `loss` and the gradients).
    fits
        Whether a graph fits the device's budget (its plan from the graph).
    flops
        The FLOPs a graph's step costs, for the report.
    loss
        The output the forward ends in.

    Returns
    -------
    Recomputation or None
        Of the walk's fewest moves that fit and the graph checkpointed at the
        cuts (every one kept, else every second, ...) with the most kept back
        that fits, the one of fewer FLOPs; where neither fits, the one keeping
        every cut, with ``fits`` False.
    """
    if fits(graph):
        return None
    walk = moves(graph, loss)
    made: dict[int, tuple[Graph, int]] = {}

    def at(k: int) -> tuple[Graph, int]:
        if k not in made:
            made[k] = _rewrite(graph, [r for move in walk[:k] for r in move.roots], loss)
        return made[k]

    base = flops(graph)
    found: list[Recomputation] = []
    k = _least(len(walk), lambda k: fits(at(k)[0]))
    if k is not None:
        rewritten, values = at(k)
        found.append(Recomputation(rewritten, values, flops(rewritten), base, True))
    # Every cut kept, then every second, ...: longer segments, fewer values kept between
    # them, about the same work (each value is made once more either way). The first
    # that fits keeps back what its room allows, and may then cost less than the walk.
    tried, at_cuts = [], cuts(graph, loss)
    for every in _SPACINGS:
        roots = _checkpointed(graph, loss, every, at_cuts)
        rewritten, values = _rewrite(graph, roots, loss)
        tried.append(Recomputation(rewritten, values, flops(rewritten), base, False))
        if fits(rewritten):
            rewritten, values = _kept_back(graph, roots, fits, loss)
            found.append(Recomputation(rewritten, values, flops(rewritten), base, True))
            break
    return min(found, key=lambda r: (r.flops, r.values)) if found else tried[0]


def _kept_back(
    graph: Graph, roots: list[Node], fits: Callable[[Graph], bool], loss: str
) -> tuple[Graph, int]:
    """`graph` recomputing `roots` but for the most of them kept back that still fits.

    Kept back first: the most work per byte (products), then the latest in
    the forward. `roots` recomputed all must fit; fitting is taken as
    monotone in how many are kept back.
    """
    position = {id(n): i for i, n in enumerate(graph.nodes())}
    order = sorted(roots, key=lambda n: (-work(n) / max(_bytes(n), 1), -position[id(n)]))
    made: dict[int, tuple[Graph, int]] = {}

    def keeping(k: int) -> tuple[Graph, int]:
        if k not in made:
            kept = {id(n) for n in order[:k]}
            made[k] = _rewrite(graph, [n for n in roots if id(n) not in kept], loss)
        return made[k]

    # The most kept back that fits: the fewest left to recompute (all of them fit).
    n = len(order)
    least = _least(n, lambda k: fits(keeping(n - k)[0]))
    assert least is not None, "the checkpointed graph fits"
    return keeping(n - least)


def _least(n: int, ok: Callable[[int], bool]) -> int | None:
    """The least k in 0..n with ok(k), by bisection (ok taken as monotone); None if not ok(n)."""
    if not ok(n):
        return None
    low, high = 0, n  # ok(high); the answer is in [low, high]
    while low < high:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid + 1
    return high
