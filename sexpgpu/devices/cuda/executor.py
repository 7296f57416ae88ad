"""`TorchGraph`: one IR graph planned once and run with PyTorch on one device.

The plan, made when the graph is built:

* the schedule is the graph's topological order; each value is dropped
  right after its last use (outputs are kept to the end);
* CONSTANT and IOTA nodes are made once on the device and held by the plan;
* an ``attention`` or ``cross-entropy`` whose gradient is in the same graph
  (same operand nodes and attributes) keeps what its gradient needs (the
  attention kernel's log-sum-exp and output; cross-entropy's per-row
  log-sum-exp) in a stash keyed by the forward's position, and the gradient
  takes it from there (then the stash entry is dropped) instead of
  computing it again;
* a cross-entropy whose gradient's row weights (``1/rows`` for a mean)
  can be made before it runs is computed together with that gradient by one
  kernel (`sexpgpu.devices.cuda.xent`): the weights' nodes, where none
  depends on the forward, move ahead of it, and the gradient is stashed
  until its own step;
* attention's gradient is kept as its three parts (`_Pieces`) while its
  readers take one part at a time (the VJP's slices, through transposes),
  so each part stays in the layout the kernel wrote, its operand's, and
  the products read it without a copy; any other reader gets them joined;
* `planned_peak_bytes` is the schedule's largest live set, computed without
  running from torch element sizes (bf16 = 2 bytes): constants always,
  fed leaves from their first to their last use, views sharing their
  operand's buffer, the stashed log-sum-exp while it waits, and the f32
  rows cross-entropy's kernels hold while they run.

`report` says which torch call each op kind made and which attention
backend ran.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sexpgpu.devices.cuda.attention import sdpa_backward, sdpa_forward, select_sdpa_backend
from sexpgpu.devices.cuda.lowering import (
    LOWERINGS,
    TORCH_CALLS,
    cross_entropy_and_lse,
    cross_entropy_grad,
    cross_entropy_with_grad,
    torch_dtype,
)
from sexpgpu.devices.cuda.triton_support import available
from sexpgpu.devices.schedule import free_lists, last_uses, simulate_peak
from sexpgpu.ir.decompose import decompose
from sexpgpu.ir.dtypes import DType
from sexpgpu.ir.node import ConstArray, Graph, Node
from sexpgpu.ir.ops import FED, PRODUCT, VIEW, Op

__all__ = ["TorchGraph", "feed_tensor", "made_once_bytes", "select_sdpa_backend"]

_MADE_ONCE = frozenset({Op.CONSTANT, Op.IOTA})
# Ops whose torch call always returns a new buffer (a cast may return its operand).
_FRESH = PRODUCT | {Op.ADD}
XENT_CALL = "the loss and its gradient in one kernel (sexpgpu::xent_with_grad: Triton on a GPU)"
# Gradients that take what their forward stashed, and the forwards' operand counts.
_PAIRED = {Op.ATTENTION_GRAD: Op.ATTENTION, Op.CROSS_ENTROPY_GRAD: Op.CROSS_ENTROPY}
_FORWARD_ARITY = {Op.ATTENTION: 3, Op.CROSS_ENTROPY: 2}


@dataclass(frozen=True)
class _Step:
    node: Node
    args: tuple[int, ...]  # schedule positions of the operands
    frees: tuple[int, ...]  # schedule positions dropped after this step
    forward: int | None  # a paired gradient: the stashing forward's position
    # A cross-entropy made with its gradient, and that gradient: the other's position.
    made_with: int | None = None


class TorchGraph:
    """A graph planned for PyTorch on `device`; call it with feeds to run it.

    Parameters
    ----------
    graph
        The program. Its INPUT and PARAM nodes are fed by name.
    device
        Where it runs: ``torch.device("cuda")``, or ``torch.device("cpu")``
        (tests: the same lowering, checked against the interpreter).
    attention_backend
        Force one of `sexpgpu.devices.cuda.attention.BACKENDS`; default:
        `select_sdpa_backend` for each attention's dtype.
    kernels
        Whether sexpgpu's Triton kernels run (a cross-entropy alone then
        holds no f32 rows); default: where `device` has them. A plan made on
        the CPU for a GPU says True.

    Attributes
    ----------
    planned_peak_bytes
        The largest live set over the schedule, in bytes.
    peak_node
        The node at which that peak is reached.
    """

    def __init__(
        self,
        graph: Graph,
        device: torch.device,
        attention_backend: str | None = None,
        kernels: bool | None = None,
    ) -> None:
        # What the lowering has no kernel for runs as its decomposition into primitives.
        graph = decompose(graph, keep=LOWERINGS.__contains__)
        self.graph = graph
        self.device = torch.device(device)
        self._kernels = available(self.device) if kernels is None else kernels
        self.order = _weights_before_forwards(graph.nodes())
        self._pos = {id(n): i for i, n in enumerate(self.order)}
        self._outputs = {name: self._pos[id(n)] for name, n in graph.outputs.items()}
        self._backends = {
            i: attention_backend or select_sdpa_backend(self.device, torch_dtype(n.dtype))
            for i, n in enumerate(self.order)
            if n.op in (Op.ATTENTION, Op.ATTENTION_GRAD)
        }
        # What each attention node ran: (backend, why it fell back), never its
        # tensors, which would outlive the call (1.2 GiB of examples/gpt.lisp's).
        self._used: dict[int, tuple[str, str | None]] = {}
        self._buffers = self._storage()
        self.steps, self._stash_users, self._last, self._over = self._plan()
        self.planned_peak_bytes, self.peak_node = self._peak()
        self._constants = {
            i: LOWERINGS[n.op](n, self.device)
            for i, n in enumerate(self.order)
            if n.op in _MADE_ONCE
        }

    # ------------------------------------------------------------ plan

    def _pairs(self) -> dict[int, int]:
        """Paired gradient's position -> the position of its forward, where the graph has it."""
        return _pairs(self.order)

    def _plan(self) -> tuple[list[_Step], Counter, list[int], set[int]]:
        pairs = self._pairs()
        users = Counter(pairs.values())
        # Cross-entropies made with their (only) gradient: the forward reads the
        # gradient's row weights, the gradient reads nothing.
        with_grad = {
            j: i
            for j, i in pairs.items()
            if self.order[j].op is Op.CROSS_ENTROPY_GRAD
            and users[i] == 1
            and self._pos[id(self.order[j].inputs[2])] < i
        }
        inputs = [tuple(self._pos[id(x)] for x in node.inputs) for node in self.order]
        for j, i in with_grad.items():
            inputs[i] += (inputs[j][2],)
            inputs[j] = ()
        last = last_uses(self.order, self._outputs.values(), inputs)
        for j, i in pairs.items():
            last[i] = max(last[i], j)  # the stash holds the forward's output until then
        storage = self._buffers
        # Logits nothing reads after their cross-entropy take its gradient (one dtype), where
        # a product or a sum made them (a buffer of their own: torch allocated it).
        over = {
            i
            for j, i in with_grad.items()
            if self.order[i].inputs[0].dtype == self.order[j].dtype
            and self.order[storage[inputs[i][0]]].op in _FRESH
            and all(last[m] <= i for m, b in enumerate(storage) if b == storage[inputs[i][0]])
        }
        frees = free_lists(last)
        made_with = {**with_grad, **{i: j for j, i in with_grad.items()}}
        steps = [
            _Step(node, inputs[i], frees[i], pairs.get(i), made_with.get(i))
            for i, node in enumerate(self.order)
        ]
        return steps, users, last, over

    def _storage(self) -> list[int]:
        """Each position's buffer: the position that made it (views share their operand's)."""
        storage = list(range(len(self.order)))
        for i, node in enumerate(self.order):
            if node.op in VIEW:
                storage[i] = storage[self._pos[id(node.inputs[0])]]
        return storage

    def peak_with_params_held(self) -> tuple[int, Node | None]:
        """(peak bytes, node at the peak), the parameters held for the whole call.

        What a step that returns its gradients holds: each gradient from when
        it is made, beside the activations still alive, while the parameters
        stay (they outlive the call); the schedule's own peak drops a
        parameter after its last use, about when its gradient appears.
        """
        return self._peak(held=True)

    def _peak(self, held: bool = False) -> tuple[int, Node | None]:
        """(peak bytes, node at the peak): buffers added as they appear, dropped after last use."""
        last = self._last
        n = len(self.order)
        storage = list(self._buffers)
        for i in self._over:  # the gradient is made in its logits' buffer
            j = self.steps[i].made_with
            storage[j] = storage[self.steps[i].args[0]]
        buffer_last = list(last)
        nbytes = [0] * n
        always = 0
        for i, node in enumerate(self.order):
            if storage[i] != i:
                buffer_last[storage[i]] = max(buffer_last[storage[i]], last[i])
            elif node.op in _MADE_ONCE:
                always += made_once_bytes(node)
            elif held and node.op is Op.PARAM:
                always += node.size * _itemsize(node.dtype)
            else:
                nbytes[i] = node.size * _itemsize(node.dtype)
        change: Counter = Counter()  # what a forward stashes, until its (last) gradient
        for i in self._stash_users:
            last_grad = max(j for j, s in enumerate(self.steps) if s.forward == i)
            if i in self._over:  # the gradient is its logits' buffer (counted as theirs)
                continue
            if self.steps[i].made_with is not None:  # the gradient itself, made early
                change[i] += nbytes[last_grad]
                change[last_grad] -= nbytes[last_grad]
                continue
            rows = self.order[i].inputs[0]  # q, or the logits
            lse = 4 * (rows.size // max(rows.shape[-1], 1))  # f32, one per row
            change[i] += lse
            change[last_grad + 1] -= lse
        transient = [self._transient(i) for i in range(n)]
        return simulate_peak(
            self.order,
            storage,
            nbytes,
            buffer_last,
            base=always,
            change=change,
            transient=transient,
        )

    def _transient(self, i: int) -> int:
        """Bytes step `i`'s kernels hold only while they run (`_temporary_bytes`)."""
        step = self.steps[i]
        if step.made_with is not None:  # one kernel, a row at a time
            return 0
        if step.node.op is Op.CROSS_ENTROPY and i not in self._stash_users and self._kernels:
            return 0  # alone: the kernel's one pass
        return _temporary_bytes(step.node)

    def constant(self, node: Node) -> torch.Tensor:
        """The tensor the plan made once for a CONSTANT or IOTA `node` of the graph."""
        return self._constants[self._pos[id(node)]]

    # ------------------------------------------------------------ run

    def __call__(
        self, feeds: Mapping[str, Any], after_step: Callable[[int], None] | None = None
    ) -> dict[str, torch.Tensor]:
        """Run the program; returns every output by name, as tensors on the device.

        Parameters
        ----------
        feeds
            A tensor or array for every INPUT and PARAM name of the graph, of
            the node's shape (converted to its dtype and moved to the device;
            bf16 feeds are rounded to nearest, ties to even).
        after_step
            Called with each schedule position once its value is computed
            (the tracer uses it to tell which IR node made which aten call).
        """
        values: list[torch.Tensor | None] = [None] * len(self.order)
        stash: dict[int, Any] = {}
        waiting = Counter(self._stash_users)
        with torch.no_grad():
            for i, step in enumerate(self.steps):
                values[i] = self._compute(i, step, values, feeds, stash, waiting)
                if after_step is not None:
                    after_step(i)
                for j in step.frees:
                    values[j] = None
            return {name: _whole(values[i]) for name, i in self._outputs.items()}

    def _compute(self, i, step, values, feeds, stash, waiting) -> torch.Tensor:
        node = step.node
        if node.op in FED:
            return feed_tensor(node, feeds, self.device)
        if node.op in _MADE_ONCE:
            return self._constants[i]
        if len(step.args) == 1 and isinstance(values[step.args[0]], _Pieces):
            piece = values[step.args[0]].read_by(node)
            if piece is not None:
                return piece
        for j in step.args:  # a reader that takes more than one part: stacked once
            values[j] = _whole(values[j])
        args = [values[j] for j in step.args]
        aux = None
        if step.forward is not None:
            aux = stash[step.forward]
            waiting[step.forward] -= 1
            if not waiting[step.forward]:
                del stash[step.forward]
        if node.op is Op.ATTENTION:
            out, aux = sdpa_forward(*args, **node.attrs, backend=self._backends[i])
            self._used[i] = (aux.backend, aux.fallback)
        elif node.op is Op.ATTENTION_GRAD:
            q, k, v, g = args
            backend = self._backends[i]
            parts = sdpa_backward(g, q, k, v, **node.attrs, aux=aux, backend=backend)
            out = _Pieces(parts, q.dim() - 3)
        elif node.op is Op.CROSS_ENTROPY and step.made_with is not None:
            grad = self.order[step.made_with]
            out, aux = cross_entropy_with_grad(node, grad, *args, over=i in self._over)
        elif node.op is Op.CROSS_ENTROPY and i in self._stash_users:
            out, aux = cross_entropy_and_lse(node, *args)
        elif node.op is Op.CROSS_ENTROPY_GRAD and step.made_with is not None:
            out = aux  # made by its forward
        elif node.op is Op.CROSS_ENTROPY_GRAD:  # aux: the forward's log-sum-exp, if kept
            out = cross_entropy_grad(node, *args, aux)
        else:
            out = LOWERINGS[node.op](node, *args)
        if i in self._stash_users:
            stash[i] = aux
        assert tuple(out.shape) == node.shape and out.dtype == torch_dtype(node.dtype), (node, out)
        return out

    # ------------------------------------------------------------ report

    def attention_backends(self) -> dict[str, str]:
        """Backend per attention node as planned, with what actually ran once run."""
        result = {}
        for i, planned in self._backends.items():
            ran, fallback = self._used.get(i, (planned, None))
            name = f"%{i} {self.order[i].op.label}"
            result[name] = ran if fallback is None else f"{ran} ({fallback})"
        return result

    def report(self) -> dict[str, Any]:
        """What the lowering uses: each op kind's torch call and count, the attention backend.

        Returns
        -------
        dict
            ``{"device": "cuda:0", "attention": "flash" | ... | None,
            "attention_nodes": {"%12 attention": "flash", ...},
            "stashed": <gradients taking what their forward stashed>,
            "with_grad": <cross-entropies made with their gradient>,
            "over": <those of them whose gradient is written over their logits>,
            "ops": {"matmul": {"call": "torch.matmul (cuBLAS on CUDA)", "count": 12}, ...},
            "planned_peak_bytes": int}``
        """
        counts = Counter(node.op for node in self.order if node.op not in FED)
        backends = sorted(set(self.attention_backends().values()))
        with_grad = sum(
            s.node.op is Op.CROSS_ENTROPY and s.made_with is not None for s in self.steps
        )
        return {
            "device": str(self.device),
            "attention": ", ".join(backends) if backends else None,
            "attention_nodes": self.attention_backends(),
            "stashed": sum(self._stash_users.values()),
            "with_grad": with_grad,
            "over": len(self._over),
            "ops": {
                op.label: {
                    "call": _torch_call(op, backends, with_grad, len(self._over)),
                    "count": count,
                }
                for op, count in sorted(counts.items(), key=lambda item: item[0].value)
            },
            "planned_peak_bytes": self.planned_peak_bytes,
        }

    def report_lines(self) -> list[str]:
        """`report` as log lines: ``lowering: matmul x12 -> torch.matmul (cuBLAS on CUDA)``."""
        info = self.report()
        lines = [f"lowering: device {info['device']}, attention {info['attention'] or 'none'}"]
        for label, entry in info["ops"].items():
            lines.append(f"lowering: {label} x{entry['count']} -> {entry['call']}")
        return lines


@dataclass(frozen=True)
class _Pieces:
    """``torch.cat(parts, axis)``, kept as its parts for readers that take one part."""

    parts: tuple[torch.Tensor, ...]
    axis: int

    @property
    def shape(self) -> torch.Size:
        first = self.parts[0].shape
        joined = sum(p.shape[self.axis] for p in self.parts)
        return torch.Size((*first[: self.axis], joined, *first[self.axis + 1 :]))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def read_by(self, node: Node) -> _Pieces | torch.Tensor | None:
        """`node`'s value on this one, without joining; None where it needs the whole."""
        if node.op is Op.SLICE and node.attrs["axis"] % len(self.shape) == self.axis:
            start = 0
            for part in self.parts:  # a slice that is exactly one part
                stop = start + part.shape[self.axis]
                if (node.attrs["start"], node.attrs["stop"]) == (start, stop):
                    return part
                start = stop
            return None
        if node.op is Op.TRANSPOSE:
            axes = node.attrs["axes"]
            return _Pieces(tuple(p.permute(axes) for p in self.parts), axes.index(self.axis))
        return None


def _pairs(order: list[Node]) -> dict[int, int]:
    """Paired gradient's position -> the position of its forward (same operands and attributes)."""
    forwards: dict[tuple, int] = {}
    pairs = {}
    for i, node in enumerate(order):
        forward = _PAIRED.get(node.op, node.op)
        if forward not in _FORWARD_ARITY:
            continue
        operands = (id(x) for x in node.inputs[: _FORWARD_ARITY[forward]])
        key = (forward, *operands, repr(sorted(node.attrs.items())))
        if node.op is forward:
            forwards.setdefault(key, i)
        elif key in forwards:
            pairs[i] = forwards[key]
    return pairs


def _weights_before_forwards(order: list[Node]) -> list[Node]:
    """`order` with each cross-entropy gradient's row weights made before its forward.

    The weights (``1/rows`` broadcast, for a mean) come from constants and
    feeds; the schedule makes them in the backward. Where none of their
    nodes depends on the forward, those after it move to just before it, in
    their order, so that one kernel can make the loss and its gradient.
    """
    pairs = [(order[i], order[j]) for j, i in _pairs(order).items()]
    for forward, grad in pairs:
        if grad.op is not Op.CROSS_ENTROPY_GRAD:
            continue
        pos = {id(n): k for k, n in enumerate(order)}
        i = pos[id(forward)]
        late: set[int] = set()  # positions after the forward that the weights need
        stack = [grad.inputs[2]]
        while stack:
            k = pos[id(stack.pop())]
            if k > i and k not in late:
                late.add(k)
                stack.extend(order[k].inputs)
        if any(x is forward for k in late for x in order[k].inputs):
            continue  # they depend on the forward
        moved = [order[k] for k in sorted(late)]
        rest = [n for k, n in enumerate(order[i:], i) if k not in late]
        order = [*order[:i], *moved, *rest]
    return order


def _whole(value: Any) -> Any:
    return torch.cat(value.parts, value.axis) if isinstance(value, _Pieces) else value


def _torch_call(op: Op, backends: list[str], with_grad: int, over: int) -> str:
    if op in (Op.ATTENTION, Op.ATTENTION_GRAD) and backends:
        return f"{TORCH_CALLS[op]} ({', '.join(backends)})"
    if op in (Op.CROSS_ENTROPY, Op.CROSS_ENTROPY_GRAD) and with_grad:
        written = f", the gradient over the logits for {over}" if over else ""
        return f"{XENT_CALL} for {with_grad}{written}; alone, {TORCH_CALLS[op]}"
    return TORCH_CALLS[op]


def _temporary_bytes(node: Node) -> int:
    """Bytes an op's torch kernels hold only while it runs, beyond its result.

    Op by op, cross-entropy and its gradient work on f32 rows: a copy of bf16
    logits, and the shifted logits or probabilities, each ``[rows vocab]``
    f32; the gradient also holds its one-hot rows, as f32, while it subtracts them.
    """
    if node.op in (Op.CROSS_ENTROPY, Op.CROSS_ENTROPY_GRAD):
        logits = node.inputs[0]
        copies = 1 if logits.dtype is DType.F32 else 2
        copies += node.op is Op.CROSS_ENTROPY_GRAD
        return copies * 4 * logits.size
    return 0


def _itemsize(dtype: DType) -> int:
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


def made_once_bytes(node: Node) -> int:
    """Bytes a CONSTANT or IOTA holds on the device (scalars and lines are expanded views)."""
    if node.op is Op.CONSTANT:
        value = node.attrs["value"]
        count = value.array.size if isinstance(value, ConstArray) else 1
    else:
        count = node.shape[node.attrs["axis"]]
    return count * _itemsize(node.dtype)


def feed_tensor(node: Node, feeds: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    """`node`'s feed as a tensor on `device` in the node's dtype (bf16 rounded through f32)."""
    if node.name not in feeds:
        raise ValueError(f"no feed for {node.op.label} {node.name!r}")
    value = feeds[node.name]
    if not isinstance(value, torch.Tensor):
        array = np.asarray(value)
        if not (array.flags.c_contiguous and array.flags.writeable):
            array = array.copy()  # (np.ascontiguousarray would make a scalar 1-D)
        value = torch.from_numpy(array)
    if tuple(value.shape) != node.shape:
        raise ValueError(
            f"feed {node.name!r} has shape {list(value.shape)}, the graph wants {list(node.shape)}"
        )
    if device.type == "cuda" and value.device.type == "cpu":
        # Through page-locked memory, queued: a pageable copy would wait for the
        # kernels already queued (the last step's update) before it returns.
        value = value.pin_memory().to(device, non_blocking=True)
    value = value.to(device)
    target = torch_dtype(node.dtype)
    if target == torch.bfloat16 and value.dtype != torch.bfloat16:
        value = value.to(torch.float32)  # as the interpreter: through f32, then rounded
    return value.to(target)
