"""The cpu device: the IR interpreter, the executable meaning of a graph.

`CpuProgram` plans a graph once and then runs it on NumPy feeds:

* the schedule is the graph's topological order; each value is freed right
  after its last use (outputs live to the end);
* an elementwise or fused op whose operand dies at it, and whose buffer is
  owned by the program (not a feed or constant, not shared by another live
  view), writes its result into that buffer (``out=``);
* values stored as ``bf16`` are rounded to bf16 in float32 arrays;
* with several cores, large ops are cut into one block per core and run in
  threads (`sexpgpu.devices.cpu_split`); BLAS is then held to one thread
  per call (through threadpoolctl, when installed), since its own threads
  would compete with these and, on a busy host, spin in hand-offs;
* `planned_peak_bytes` is the schedule's largest live set, computed without
  running; `last_peak_bytes` is measured while running (distinct buffers
  alive after each op, feeds included). Temporaries inside one op are not
  counted by either.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from sexpgpu.devices.cpu_split import evaluate_split, split_axis
from sexpgpu.devices.schedule import free_lists, last_uses, simulate_peak
from sexpgpu.ir.dtypes import DType, numpy_dtype, round_bf16
from sexpgpu.ir.node import ConstArray, Graph, Node
from sexpgpu.ir.numpy_impl import evaluate
from sexpgpu.ir.ops import BINARY, COMPARISON, FED, LEAF, UNARY, VIEW, Op

__all__ = ["CpuProgram", "run"]

log = logging.getLogger(__name__)

# Operand positions whose dying buffer an op may write its result into.
_DONORS: dict[Op, tuple[int, ...]] = {
    **{op: (0,) for op in UNARY - {Op.CAST}},
    **{op: (0, 1) for op in BINARY - COMPARISON},
    Op.WHERE: (1, 2),
    Op.SOFTMAX: (0,),
    Op.LAYERNORM: (0,),
    Op.LAYERNORM_GRAD: (1,),
    Op.GELU_GRAD: (1,),
    Op.LOG_SOFTMAX: (0,),
    Op.SOFTMAX_GRAD: (1,),
    Op.CROSS_ENTROPY_GRAD: (0,),
}


@dataclass(frozen=True)
class _Step:
    node: Node
    args: tuple[int, ...]  # schedule positions of the operands
    donor: int | None  # schedule position whose buffer receives the result
    frees: tuple[int, ...]  # schedule positions that die after this step
    split: int | None  # the axis cut over the threads, if any


class CpuProgram:
    """A graph planned for the interpreter; call it with feeds to run it.

    Parameters
    ----------
    graph
        The program. Its INPUT and PARAM nodes are fed by name.
    threads
        Threads that share a large op (see `sexpgpu.devices.cpu_split`);
        default: the cores this process may use, at most 8. With 1, ops run
        whole and BLAS keeps its own threading.
    """

    def __init__(self, graph: Graph, threads: int | None = None) -> None:
        self.graph = graph
        self.threads = threads or min(8, _usable_cores())
        self.order = graph.nodes()
        self._pos = {id(n): i for i, n in enumerate(self.order)}
        self._outputs = {name: self._pos[id(n)] for name, n in graph.outputs.items()}
        self.steps, self.planned_peak_bytes = self._plan()
        self.last_peak_bytes = 0

    def _plan(self) -> tuple[list[_Step], int]:
        n = len(self.order)
        last = last_uses(self.order, self._outputs.values())
        storage = list(range(n))  # which buffer each value lives in
        owned = [False] * n  # per buffer: written by us, may be reused
        writable = [False] * n  # per value: a buffer of its own shape, no broadcast
        buffer_last = [-1] * n  # per buffer: last use of any value in it
        nbytes = [0] * n  # per buffer
        steps = []
        for i, node in enumerate(self.order):
            args = tuple(self._pos[id(x)] for x in node.inputs)
            donor = self._donor(node, args, storage, owned, writable, buffer_last, i)
            axis = split_axis(node, self.threads)
            if node.op in VIEW:
                storage[i] = storage[args[0]]
                writable[i] = node.op is not Op.BROADCAST_TO and writable[args[0]]
            elif donor is not None:
                storage[i] = storage[donor]
                writable[i] = True
            else:
                owned[i] = node.op not in LEAF
                writable[i] = owned[i]
                nbytes[i] = _buffer_bytes(node)
            buffer_last[storage[i]] = max(buffer_last[storage[i]], last[i])
            steps.append(_Step(node, args, donor, (), axis))
        frees = free_lists(last)
        steps = [_Step(s.node, s.args, s.donor, frees[i], s.split) for i, s in enumerate(steps)]
        return steps, simulate_peak(self.order, storage, nbytes, buffer_last)[0]

    @staticmethod
    def _donor(node, args, storage, owned, writable, buffer_last, i) -> int | None:
        for k in _DONORS.get(node.op, ()):
            j = args[k]
            x = node.inputs[k]
            # Another operand viewing the same buffer differently would be overwritten.
            exclusive = all(a == j or storage[a] != storage[j] for a in args)
            if (
                exclusive
                and owned[storage[j]]
                and writable[j]
                and buffer_last[storage[j]] == i
                and x.shape == node.shape
                and numpy_dtype(x.dtype) == numpy_dtype(node.dtype)
            ):
                return j
        return None

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the program; returns every output by name.

        Parameters
        ----------
        feeds
            An array for every INPUT and PARAM name of the graph, of the
            node's shape (converted to its dtype; bf16 feeds are rounded).
        """
        values: list[np.ndarray | None] = [None] * len(self.order)
        live = _LiveSet()
        fed_roots = set()
        splits = any(step.split is not None for step in self.steps)
        pool = ThreadPoolExecutor(self.threads) if splits else nullcontext()
        with np.errstate(all="ignore"), pool, _one_blas_thread(splits):
            for i, step in enumerate(self.steps):
                if step.node.op in FED:
                    value = _feed(step.node, feeds)
                    fed_roots.add(id(_root(value)))
                else:
                    value = self._compute(step, values, pool)
                values[i] = value
                live.add(value)
                for j in step.frees:
                    live.remove(values[j])
                    values[j] = None
        self.last_peak_bytes = live.peak
        result = {}
        for name, i in self._outputs.items():
            value = values[i]
            if not value.flags.writeable or id(_root(value)) in fed_roots:
                value = np.array(value)
            result[name] = value
        return result

    def _compute(self, step: _Step, values: list, pool) -> np.ndarray:
        out = values[step.donor] if step.donor is not None else None
        if out is not None and not out.flags.writeable:
            out = None
        args = tuple(values[j] for j in step.args)
        if step.split is None:
            return evaluate(step.node, *args, out=out)
        return evaluate_split(step.node, args, out, pool, self.threads, step.split)


def run(graph: Graph, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run `graph` once on the interpreter (see `CpuProgram`)."""
    return CpuProgram(graph)(feeds)


def _usable_cores() -> int:
    """Cores this process may run on (its affinity where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def _one_blas_thread(active: bool):
    """Hold BLAS to one thread while our own threads split the ops (no-op without threadpoolctl)."""
    if not active:
        return nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # optional: BLAS keeps its threads, ops are still split
        return nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _feed(node: Node, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
    if node.name not in feeds:
        raise ValueError(f"no feed for {node.op.label} {node.name!r}")
    value = np.asarray(feeds[node.name])
    if value.shape != node.shape:
        raise ValueError(
            f"feed {node.name!r} has shape {list(value.shape)}, the graph wants {list(node.shape)}"
        )
    if node.dtype is DType.BF16:
        return round_bf16(value.astype(np.float32))
    return value.astype(numpy_dtype(node.dtype), copy=False)


def _buffer_bytes(node: Node) -> int:
    """Bytes of a new buffer for `node` on the CPU (constants are broadcast views)."""
    if node.op is Op.CONSTANT:
        value = node.attrs["value"]
        return (
            value.array.nbytes
            if isinstance(value, ConstArray)
            else numpy_dtype(node.dtype).itemsize
        )
    if node.op is Op.IOTA:
        return node.shape[node.attrs["axis"]] * numpy_dtype(node.dtype).itemsize
    return node.size * numpy_dtype(node.dtype).itemsize


def _root(array: np.ndarray) -> np.ndarray:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


class _LiveSet:
    """Distinct buffers in use and their bytes, with the high-water mark."""

    def __init__(self) -> None:
        self._count: dict[int, tuple[np.ndarray, int]] = {}
        self.bytes = 0
        self.peak = 0

    def add(self, value: np.ndarray) -> None:
        root = _root(value)
        held, count = self._count.get(id(root), (root, 0))
        if count == 0:
            self.bytes += root.nbytes
            self.peak = max(self.peak, self.bytes)
        self._count[id(root)] = (held, count + 1)

    def remove(self, value: np.ndarray) -> None:
        root = _root(value)
        held, count = self._count[id(root)]
        if count == 1:
            del self._count[id(root)]
            self.bytes -= root.nbytes
        else:
            self._count[id(root)] = (held, count - 1)
