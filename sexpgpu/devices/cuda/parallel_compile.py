"""Inductor's compile of a whole training step, split into parts compiled at once in workers.

Inductor lowers, schedules and generates the code of a graph on one thread:
for GPT-2 small's step that is most of the first step's wait. Its FX graph
cache lets a graph compiled in one process load in another, so the traced
step is cut at a few points into contiguous parts (`split`), each part is
compiled by a worker process (`sexpgpu.devices.cuda.compile_worker`) into
the cache this process reads, all at once, and each part is then compiled
here, where it is a cache hit. The workers start when a step misses the
compile cache (`sexpgpu.devices.cuda.compile_cache`), before its trace, so
that their imports overlap it, and stop once the plan is made.

A cut costs the fusions across it: the values that cross are materialized
(most are anyway: activations kept for the backward, gradients), so the
parts are few and cut between IR nodes. Each sum into the step's buffers
goes into the part that makes its value, so it fuses into the kernel that
makes it there as in the whole step (a bf16 gradient's cast to f32 writes
the buffer). A worker that fails or is missing leaves its part to this
process: slower, never different.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sexpgpu.devices.cuda.compile_worker import receive, send

__all__ = ["CompilePool", "PartedCall", "compile_workers", "split"]

log = logging.getLogger(__name__)

# Below this many aten calls a graph compiles in a few seconds: one part.
MIN_PART_NODES = 400
# More parts cut more fusions, and each worker's own start costs a core.
MAX_WORKERS = 6
# Seconds a worker may take over its part (its imports included) before it is stopped.
JOB_TIMEOUT = 600.0


def compile_workers(enabled: bool, nodes: int) -> int:
    """How many workers a plan starts for a training graph of `nodes` IR nodes.

    Half the host's cores, at most `MAX_WORKERS`, and none for a graph too
    small to split (each IR node lowers to one aten call or more).
    """
    if not enabled or nodes < 2 * MIN_PART_NODES:
        return 0
    count = min(MAX_WORKERS, (os.cpu_count() or 1) // 2)
    return count if count >= 2 else 0


class CompilePool:
    """Worker processes that compile graph parts; started when a step misses the cache,
    used once, then stopped.

    Parameters
    ----------
    workers
        How many processes (0: none; every part compiles here).
    """

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._procs: list[subprocess.Popen] = []
        self._started = False
        self._ready: set[int] = set()  # the workers whose "ready" has been read

    def start(self) -> None:
        """Start the workers (once): their imports then overlap the caller's trace."""
        if self._started:
            return
        self._started = True
        env = dict(os.environ)  # the compile cache's folders included (compile_cache.py)
        # Each worker's Triton compiles share the host's cores with the others'.
        threads = max(1, (os.cpu_count() or 1) // max(1, self._workers))
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
        for _ in range(self._workers):
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "sexpgpu.devices.cuda.compile_worker"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    env=env,
                )
            except OSError as error:
                log.debug("no compile worker: %s", error)
                break
            self._procs.append(proc)

    @property
    def size(self) -> int:
        """The workers asked for, until started; then those running."""
        return len(self._procs) if self._started else self._workers

    def compile(self, jobs: Sequence[dict[str, Any]]) -> Iterator[tuple[int, str | None]]:
        """Start each job in a worker of its own; ``(job, None or why it failed)`` as each ends.

        The workers start at the call, so the caller can work before it
        iterates, and load a part while the others still compile. A worker
        that takes longer than `JOB_TIMEOUT` is stopped, and its part is
        left to the caller, as are the jobs beyond the workers.
        """
        self.start()
        ended: queue.Queue[tuple[int, str | None]] = queue.Queue()

        def run(i: int, proc: subprocess.Popen) -> None:
            failed: str | None = None
            try:
                if proc.pid not in self._ready:
                    if receive(proc.stdout) is None:
                        raise EOFError("the worker stopped before it was ready")
                    self._ready.add(proc.pid)
                send(proc.stdin, jobs[i])
                reply = receive(proc.stdout)
                if reply is None:
                    raise EOFError("the worker stopped")
                kind, value = reply
                failed = None if kind == "done" else value
                log.debug("compile worker %d: part %d %s %s", proc.pid, i, kind, value)
            except (OSError, EOFError, ValueError) as error:
                failed = f"{type(error).__name__}: {error}"
            ended.put((i, failed))

        pairs = list(zip(range(len(jobs)), self._procs, strict=False))
        for pair in pairs:
            threading.Thread(target=run, args=pair, daemon=True).start()
        return self._ended(ended, dict(pairs), len(jobs), time.monotonic() + JOB_TIMEOUT)

    @staticmethod
    def _ended(
        ended: queue.Queue, waiting: dict[int, subprocess.Popen], jobs: int, deadline: float
    ) -> Iterator[tuple[int, str | None]]:
        """`compile`'s results as they come, until the last or the deadline."""
        for i in range(len(waiting), jobs):
            yield i, "no worker"
        while waiting:
            try:
                i, failed = ended.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:  # stopped: their parts compile in the caller
                for i, proc in waiting.items():
                    proc.kill()
                    yield i, f"no answer in {JOB_TIMEOUT:.0f} s"
                return
            del waiting[i]
            yield i, failed

    def close(self) -> None:
        """Stop every worker now: one still importing would otherwise finish first."""
        for proc in self._procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            proc.kill()
            proc.wait()
        self._procs = []
        self._started = True  # a closed pool starts no workers


def _sums_in_layout(gm: Any) -> list[Any]:
    """The sums into the step's buffers (``sums__`` copies and adds into operands),
    each made to read its value in its buffer's layout (`_in_layout_of`).

    A part that writes into an operand has it changed in place by
    AOTAutograd's wrappers, strides included: a value of other strides (a
    transposed gradient) would leave its buffer with them.
    """
    import torch

    kinds = (torch.ops.aten.copy_.default, torch.ops.aten.add_.Tensor)
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    sums = [
        n
        for n in gm.graph.nodes
        if n.name.startswith("sums__")
        and n.target in kinds
        and n.args[0] in placeholders
        and not n.kwargs
    ]
    for node in sums:
        node.args = (node.args[0], _in_layout_of(gm.graph, node.args[1], node.args[0]))
    gm.recompile()
    return sums


def _in_layout_of(graph: Any, value: Any, buffer: Any) -> Any:
    """`value`, or its contiguous copy where `buffer` is contiguous and `value` is not.

    The copy fuses into the kernel that makes the value (a transposed
    gradient, the tied embedding's, comes out of its product so), which
    then writes it in the buffer's layout; copied later, between layouts,
    it took 0.28 ms of an H200's step.
    """
    import torch

    want, have = buffer.meta["val"], value.meta["val"]
    if not want.is_contiguous() or have.is_contiguous():
        return value
    with graph.inserting_after(value):
        copy = graph.call_function(
            torch.ops.aten.clone.default, (value,), {"memory_format": torch.contiguous_format}
        )
    copy.meta["val"] = have.clone(memory_format=torch.contiguous_format)
    copy._rename(f"sums__{copy.name}")
    return copy


def split(gm: Any, parts: int) -> Any | None:
    """``gm`` cut into `parts` parts (``torch.fx`` split_module), or None.

    The calls are dealt out in graph order, equal counts per part, each cut
    moved on to the next IR node's first call: inside one node's calls (a
    layernorm gradient's statistics and its backward, say) a cut would
    materialize what Inductor fuses. Each sum into the step's buffers goes
    to its value's part (`_sums_in_layout`), and an output of a call of
    several to that call's part (only tensors cross). None where the graph
    is too small to split.
    """
    from torch.fx.passes.split_module import split_module

    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    parts = min(parts, len(calls) // MIN_PART_NODES)
    if parts < 2:
        return None
    sums = _sums_in_layout(gm)
    summing = {*sums, *(s.args[1] for s in sums if s.args[1].name.startswith("sums__"))}
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    dealt = [n for n in calls if n not in summing]
    part_of, made_by = {}, None
    for i, node in enumerate(dealt):  # a cut only between IR nodes, never inside one's calls
        head = node.name.split("__", 1)[0]  # "ir<position>", after the node that made it
        part_of[node] = part_of[dealt[i - 1]] if head == made_by else i * parts // len(dealt)
        made_by = head
    for node in calls:  # a call of several outputs (attention's) is read in its own part
        if node.target is operator.getitem and node.args[0] in part_of:
            part_of[node] = part_of[node.args[0]]
    for node in calls:  # in graph order: a layout copy before the sum that reads it
        if node in summing:
            value = node.args[1] if node in sums else node.args[0]
            part_of[node] = part_of.get(value, parts - 1)  # a fed value: the last part
    for node in calls:
        node.meta["sexpgpu_name"] = node.name
    parent = split_module(gm, gm, lambda node: part_of[node], keep_original_order=True)
    # split_module names its calls after their targets; the kernel report needs the IR's.
    for part in parent.children():
        for node in part.graph.nodes:
            if node.op == "call_function" and "sexpgpu_name" in node.meta:
                node._rename(node.meta["sexpgpu_name"])
        part.recompile()
    return parent


def boxed(compiled: Callable) -> Callable[[list], Any]:
    """`compiled` (``torch._inductor.compile``'s) called on a list of its inputs, which it empties.

    Called as ``compiled(*inputs)``, the caller's frame holds every input
    until the call returns. Called boxed, the list is the only holder, and
    Inductor's code frees each input after its last use inside: a part of
    the backward then frees the activations it reads as it goes, as the
    schedule the plan counted does. The boxed function is AOTAutograd's
    inner one, behind the wrappers ``torch._inductor.compile`` returns; where
    a version of PyTorch hides it, the call holds its inputs (the test of
    `PartedCall`'s memory says so). Code loaded by its AOTAutograd key
    (`sexpgpu.devices.cuda.inductor_keys.KeyedCall`) is called boxed as it is.
    """
    call_boxed = getattr(compiled, "call_boxed", None)
    if call_boxed is not None:
        return call_boxed
    fn: Any = compiled
    while fn is not None:
        code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
        if (
            code is not None
            and closure
            and {"compiled_fn", "params_buffers_flat"} <= {*code.co_freevars}
        ):
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure), strict=True))
            return functools.partial(
                _call_boxed, cells["compiled_fn"], list(cells["params_buffers_flat"])
            )
        fn = getattr(fn, "__wrapped__", None)
    return lambda inputs: compiled(*inputs)


def _call_boxed(inner: Callable[[list], Any], params: list, inputs: list) -> Any:
    full = [*params, *inputs]
    inputs.clear()
    return inner(full)


class PartedCall:
    """The split step: its compiled parts called in order, each value freed after its last use.

    A value read last by a part is handed to it alone (`boxed`), so the part
    frees it at its last use inside, not when the part returns.
    """

    def __init__(self, parent: Any, compiled: dict[str, Callable]) -> None:
        self.compiled = compiled
        self._boxed = {name: boxed(fn) for name, fn in compiled.items()}
        self._parent = parent  # its constants (get_attr)
        self._nodes = list(parent.graph.nodes)
        last: dict[Any, int] = {}
        for i, node in enumerate(self._nodes):
            for arg in node.all_input_nodes:
                last[arg] = i
        self._free = [[] for _ in self._nodes]
        for node, i in last.items():
            self._free[i].append(node)

    def __call__(self, *flat: Any) -> Any:
        env: dict[Any, Any] = {}
        args = iter(flat)
        for i, node in enumerate(self._nodes):
            if node.op == "placeholder":
                env[node] = next(args)
            elif node.op == "get_attr":
                env[node] = functools.reduce(getattr, node.target.split("."), self._parent)
            elif node.op == "call_module":
                inputs = [env[a] for a in node.args]
                for dead in self._free[i]:  # read last here: the part's list holds it alone
                    env.pop(dead, None)
                env[node] = self._boxed[node.target](inputs)
                continue
            elif node.op == "call_function" and node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]
            elif node.op == "output":
                return _load(node.args[0], env)
            else:
                raise AssertionError(f"unexpected node in the split step: {node.format_node()}")
            for dead in self._free[i]:
                env.pop(dead, None)
        raise AssertionError("the split step has no output")


def _load(value: Any, env: dict[Any, Any]) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_load(v, env) for v in value)
    return env.get(value, value) if hasattr(value, "op") else value
