"""The ``cuda`` device: a `CompiledRun` lowered to PyTorch on one GPU per rank.

`CudaDevice.plan` decides for a run, before anything is allocated: the
stacking degree, the stacked and compiled training graph, the live sets
and the memory plan, all in one value (`CudaPlan`). `report` prints it and
`load` turns it into each rank's `sexpgpu.devices.cuda.kernels.TorchKernels`
(the fused training step, the op-by-op evaluation) into a
`sexpgpu.devices.state.TrainState`: parameters, gradient buffers and
optimizer moments are float32 tensors on the GPU. The host sees the loss
once per step.

The same lowering runs on PyTorch's CPU device for the tests
(``CudaDevice(torch_device="cpu")``): an internal switch, not a device users
name. torch is imported when the device is made, never before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sexpgpu.devices.cuda.parallel_compile import CompilePool, compile_workers
from sexpgpu.devices.state import TrainState
from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.compile import CompiledRun, matmul_flops
from sexpgpu.ir.dtypes import DType, numpy_dtype
from sexpgpu.ir.node import Graph
from sexpgpu.ir.ops import FUSED, Op
from sexpgpu.runtime.devices import Device as DeviceId
from sexpgpu.runtime.devices import require_capability
from sexpgpu.runtime.memory import MemoryPlan, call_peak_bytes, detect_budget

if TYPE_CHECKING:
    from sexpgpu.devices.cuda.fused import FusedGraph
    from sexpgpu.devices.cuda.stacking import Choice

__all__ = ["CUBLAS_WORKSPACE", "CudaDevice", "CudaPlan"]

# What cuBLAS takes from PyTorch's caching allocator per handle and stream, as
# PyTorch sizes it on Hopper: its workspace (CUBLAS_WORKSPACE_CONFIG :4096:8)
# and cuBLASLt's (measured on an H200: 32 MiB and 1 MiB, dev/memory_peak.py).
CUBLAS_WORKSPACE = 33 * 2**20


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise SexpgpuError(
            "E-DEV-002",
            "the cuda device needs PyTorch, which is not installed",
            "--device",
            hint="pip install 'sexpgpu[cuda]' (a CUDA build of PyTorch), or use --device cpu",
        ) from None
    return torch


@dataclass(frozen=True)
class CudaPlan:
    """What `CudaDevice.plan` decided for a run; `report` and `load` take it.

    Attributes
    ----------
    compiled
        The run.
    memory
        The most one GPU holds at once, by part.
    microbatches
        Microbatches per rank and step.
    choice
        The stacking degree and why.
    stacked
        The training graph at that degree (the graph itself at 1).
    fused
        `stacked` compiled for the first device (`FusedGraph`), why it cannot
        be (a string), or None where nothing was compiled (op by op, or no
        GPU to compile for: a run compiles it when it loads).
    live
        (bytes, where) of the larger live set: the schedule's node at the
        peak, or the name of the call a dry call measured.
    copy_bytes
        The fused step's bf16 parameter copies (`sexpgpu.devices.cuda.param_copies`).
    lowering
        The lowering report's lines of the training graph's schedule.
    """

    compiled: CompiledRun
    memory: MemoryPlan
    microbatches: int
    choice: Choice
    stacked: Graph
    fused: FusedGraph | str | None
    live: tuple[int, Any]
    copy_bytes: int
    lowering: tuple[str, ...]


class CudaDevice:
    """The ``cuda`` device (see the module docstring).

    Opening it on a GPU makes the process-wide settings once
    (`sexpgpu.devices.cuda.process`).

    Parameters
    ----------
    torch_device
        ``"cuda"`` (the default), or ``"cpu"`` to run the same lowering on
        PyTorch's CPU device (tests).
    fuse
        Whether the training graph is compiled (`FusedGraph`); by default on
        a GPU only (Inductor's C++ compile takes seconds per graph).
    """

    name = "cuda"

    def __init__(self, torch_device: str = "cuda", *, fuse: bool | None = None) -> None:
        self.torch = _torch()
        self.kind = torch_device
        gpu = torch_device == "cuda" and self.torch.cuda.is_available()
        # Where the plan and the report look: the first GPU, or the CPU without one.
        self.first = "cuda:0" if gpu and self.torch.cuda.device_count() else "cpu"
        self.on_gpu = self.first != "cpu"
        self.fuse = torch_device == "cuda" if fuse is None else fuse
        if self.kind == "cuda":
            from sexpgpu.devices.cuda.process import open_settings

            open_settings()

    # -- plan and report ----------------------------------------------------------------

    def plan(
        self,
        compiled: CompiledRun,
        *,
        moments: int,
        ranks: int,
        memory: int | None,
        microbatches: int = 1,
    ) -> CudaPlan:
        """What one GPU holds at once, by part, from the graphs alone (nothing allocated).

        Parameters, optimizer moments and the gradient buffers are float32 for
        the whole run (op by op with one microbatch, the gradients are the
        graph's outputs); the largest graph's live set (its constants apart)
        comes from the executor's schedule, for the training graph at the
        stacking degree chosen here (`sexpgpu.devices.cuda.stacking`); the
        workspace is cuBLAS's (PyTorch takes it from its caching allocator)
        and the optimizer's temporaries, a few of the largest parameter. With
        several ranks, NCCL sums packed copies of the gradients. Where the
        plan fits a GPU, a dry call of the compiled step on zeros replaces
        the schedule's live set by the one measured.
        """
        # Their imports overlap the trace; they stop once the plan is made, or fails.
        nodes = len(compiled.train_graph.nodes())
        pool = CompilePool(compile_workers(self.on_gpu and self._captures(), nodes))
        try:
            return _Planner(self, compiled, microbatches, pool).plan(moments, ranks, memory)
        finally:
            pool.close()  # later graphs (other GPUs', a resume's) compile in-process

    def _blas_streams(self) -> int:
        """How many (thread, stream) pairs hold a cuBLAS workspace: PyTorch keeps one per pair.

        The rank's thread computes on its stream; where steps are captured,
        the capture's stream is a second, and the thread that plans (its
        trace and dry call run the step) holds a third.
        """
        return 3 if self._captures() else 1

    def _epilogues(self) -> int:
        """The workspace of the products with gelu in their epilogues (fused steps on a GPU)."""
        from sexpgpu.devices.cuda.cublaslt import WORKSPACE

        return WORKSPACE if self._captures() else 0

    def _captures(self) -> bool:
        """Whether training calls are replayed as CUDA graphs (fused, on a GPU)."""
        return self.fuse and self.kind == "cuda"

    def _device_name(self) -> str:
        if not self.on_gpu:
            return f"torch-cpu/{self.torch.__version__}"
        return f"{self.torch.cuda.get_device_name(0)}/torch {self.torch.__version__}"

    def report(self, plan: CudaPlan) -> list[str]:
        """Device and capability, patterns matched and where, kernels, attention, the plan."""
        lines = [self._device_line()]
        lines += _pattern_lines(plan.compiled.train_graph)
        lines += plan.lowering
        lines += self._fused_lines(plan)
        lines.append(plan.memory.line())
        live, node = plan.live
        if isinstance(node, str):  # measured by a dry call
            lines.append(
                f"memory: the live set ({live / 2**20:.1f} MiB) is the {node}'s own, "
                "measured over calls on zeros before the first step"
            )
        elif node is not None:
            where = f" at {node.span}" if node.span is not None else ""
            lines.append(f"memory: the live set peaks at {node.op.label}{where}")
        return lines

    def _device_line(self) -> str:
        torch = self.torch
        if not self.on_gpu:
            where = "PyTorch's CPU device" if self.kind == "cpu" else "no GPU visible"
            return f"device: cuda lowering on {where} (torch {torch.__version__})"
        major, minor = torch.cuda.get_device_capability(0)
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return (
            f"device: cuda:0 {torch.cuda.get_device_name(0)}, compute capability "
            f"{major}.{minor}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"cuDNN {cudnn or 'none'}"
        )

    def _fused_lines(self, plan: CudaPlan) -> list[str]:
        lines = [plan.choice.line()]
        if not self.fuse:
            return [*lines, "fused: off (op by op)"]
        if plan.fused is None:
            return [*lines, "fused: the training graph is compiled on the GPU when a run loads it"]
        if isinstance(plan.fused, str):
            return [*lines, f"fused: off, op by op: {plan.fused}"]
        return lines + plan.fused.report_lines()

    def _compile(self, plan: CudaPlan, device: Any) -> FusedGraph | str:
        """`plan.stacked` compiled for `device`, or why it cannot be."""
        return _fused_graph(
            plan.stacked, device, self.torch, overwrite=plan.choice.degree == plan.microbatches
        )

    # -- load -----------------------------------------------------------------------------

    def load(self, plan: CudaPlan, where: DeviceId) -> TrainState:
        """A rank's program on GPU `where` (refused below compute capability 8.0)."""
        from sexpgpu.devices.cuda.arrays import TorchOps
        from sexpgpu.devices.cuda.kernels import TorchKernels
        from sexpgpu.devices.cuda.param_copies import ParamCopies

        torch = self.torch
        if self.kind == "cuda":
            require_capability([where])
            device = torch.device("cuda", where.index)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        fused, degree = None, 1
        if self.fuse:
            planned = plan.fused
            same = planned is not None and not isinstance(planned, str)
            fused = planned if same and planned.device == device else self._compile(plan, device)
            if isinstance(planned, str) or isinstance(fused, str):
                fused = None  # the report said why: op by op
            else:
                degree = plan.choice.degree
        # The update writes the bf16 copies of the parameters that the fused call reads.
        copies = ParamCopies()
        kernels = TorchKernels(
            plan.compiled, device, where, fused=fused, degree=degree, copies=copies
        )
        return TrainState(kernels, TorchOps(device, copies), plan=plan.memory)


class _Planner:
    """One `CudaDevice.plan` call's work: each candidate degree's graphs, made once.

    It lives for the call; what it decides goes into the `CudaPlan` it returns.
    """

    def __init__(
        self, device: CudaDevice, compiled: CompiledRun, per_rank: int, pool: CompilePool
    ) -> None:
        self.device, self.compiled, self.per_rank, self.pool = device, compiled, per_rank, pool
        self.torch = device.torch
        self.first = self.torch.device(device.first)
        self._stacks: dict[int, Graph] = {}
        self._live: dict[int, tuple[int, Any]] = {}
        self._fused: dict[int, FusedGraph | str] = {}
        self._eval: tuple[int, Any] | None = None

    def plan(self, moments: int, ranks: int, memory: int | None) -> CudaPlan:
        device = self.device
        budget = detect_budget(device.first, memory)

        def plan_at(degree: int, live: tuple[int, Any], copy_bytes: int = 0) -> MemoryPlan:
            parts = self._parts(degree, moments, ranks, live[0], copy_bytes)
            return MemoryPlan(budget, parts)

        choice = self._choose(lambda d: plan_at(d, self._live_set(d)).fits)
        degree = choice.degree
        live, copy_bytes = self._live_set(degree), 0
        memory_plan = plan_at(degree, live)
        # Only a plan that fits is worth a compile and a dry call (E-MEM-001 comes next otherwise).
        if device._captures() and device.on_gpu and memory_plan.fits:
            measured = self._dry_call(degree)
            if measured is not None:
                live, copy_bytes = measured
                memory_plan = plan_at(degree, live, copy_bytes)
        # Compiled here where a device can run it; without a GPU, the run's load compiles it.
        compiles = device.fuse and (device.on_gpu or device.kind == "cpu")
        schedule = _lowering_lines(self.compiled.train_graph, self.first)
        return CudaPlan(
            compiled=self.compiled,
            memory=memory_plan,
            microbatches=self.per_rank,
            choice=choice,
            stacked=self._stacked(degree),
            fused=self._fused_graph(degree) if compiles else None,
            live=live,
            copy_bytes=copy_bytes,
            lowering=tuple(schedule),
        )

    def _parts(
        self, degree: int, moments: int, ranks: int, live: int, copy_bytes: int
    ) -> dict[str, int]:
        device, compiled = self.device, self.compiled
        params = 4 * compiled.param_count
        constants = _constant_bytes(compiled.train_graph)
        fed = _fed_param_bytes(compiled.train_graph)
        largest = max((4 * info.size for info in compiled.params.values()), default=0)
        return {
            "parameters": params,
            # The fused call's bf16 copies (param_copies.py): measured calls leave them out.
            "parameter copies": copy_bytes,
            "optimizer": moments * params,
            "gradients": params if device.fuse or self.per_rank > 1 else 0,
            "constants": constants,
            "activations": max(0, live - fed - constants),
            "workspace": CUBLAS_WORKSPACE * device._blas_streams()
            + 3 * largest
            + device._epilogues(),
            # NCCL sums packed copies of the gradients (devices/cuda/collectives.py).
            "collectives": params if ranks > 1 else 0,
        }

    def _stacked(self, degree: int) -> Graph:
        """The training graph running `degree` microbatches per call (1: the graph itself)."""
        from sexpgpu.ir.stack import stack_microbatches

        if degree == 1:
            return self.compiled.train_graph
        if degree not in self._stacks:
            self._stacks[degree] = stack_microbatches(self.compiled.train_graph, degree)
        return self._stacks[degree]

    def _live_set(self, degree: int) -> tuple[int, Any]:
        """(bytes, node at the peak) of the larger of the training and evaluation schedules."""
        if degree not in self._live:
            train = _schedule_peak(self._stacked(degree), self.torch)
            self._live[degree] = max(train, self._eval_live(), key=_bytes)
        return self._live[degree]

    def _eval_live(self) -> tuple[int, Any]:
        if self._eval is None:
            self._eval = _schedule_peak(self.compiled.eval_graph, self.torch)
        return self._eval

    def _fused_graph(self, degree: int) -> FusedGraph | str:
        """The training graph at `degree` compiled for the first device, or why it cannot be.

        Kept for the call: the measurement, the dry call and the plan share it.
        """
        if degree not in self._fused:
            self._fused[degree] = _fused_graph(
                self._stacked(degree),
                self.first,
                self.torch,
                # A step of one call writes its sums (nothing to zero, nothing read back).
                overwrite=degree == self.per_rank,
                pool=self.pool,
            )
        return self._fused[degree]

    def _dry_call(self, degree: int) -> tuple[tuple[int, Any], int] | None:
        """The live set and copy bytes measured over calls on zeros, or None where it cannot be.

        The training side is the fused call's; the evaluation graph, which
        runs op by op, is called on zeros too (its schedule's estimate counts
        every f32 row cross-entropy may hold).
        """
        from sexpgpu.devices.cuda.executor import TorchGraph

        fused = self._fused_graph(degree)
        if isinstance(fused, str):
            return None
        peak = fused.call_peak_bytes(_zero_feeds(fused.graph, self.torch, fused.device))
        if peak is None:
            return None
        compiled = self.compiled
        evaluation = self._eval_live()
        graph = TorchGraph(compiled.eval_graph, self.first)
        feeds = _zero_feeds(compiled.eval_graph, self.torch, self.first)
        measured = call_peak_bytes(self.first, lambda: graph(feeds))
        if measured is not None:
            evaluation = (measured + _leaf_bytes(compiled.eval_graph), "evaluation graph")
        train = (peak + _leaf_bytes(fused.graph), "fused training call")
        return max(train, evaluation, key=_bytes), fused.copy_bytes

    def _choose(self, fits: Callable[[int], bool]) -> Choice:
        """The stacking degree (see `sexpgpu.devices.cuda.stacking`)."""
        from sexpgpu.devices.cuda.stacking import (
            Choice,
            CostModel,
            choices_path,
            choose,
            degrees,
            graph_key,
        )
        from sexpgpu.ir.printer import format_graph

        device, compiled, per_rank = self.device, self.compiled, self.per_rank
        if not device.fuse:
            return Choice(1, "op by op, one microbatch per call")
        fitting = [d for d in degrees(per_rank) if d == 1 or fits(d)]
        bf16 = any(n.dtype is DType.BF16 for n in compiled.train_graph.nodes() if n.op is Op.MATMUL)
        model = CostModel.for_dtype("bf16" if bf16 else "f32")
        model_ms = {}
        for d in fitting:
            graph = self._stacked(d)
            moved = 3 * 4 * compiled.param_count + self._live_set(d)[0]
            calls, nodes = per_rank // d, len(graph.nodes())
            model_ms[d] = model.step_ms(calls, matmul_flops(graph), moved, nodes)
        text = format_graph(compiled.train_graph, spans=False)
        return choose(
            fitting,
            model_ms,
            key=graph_key(text, device._device_name(), per_rank),
            path=choices_path(),
            measure=self._measure if device.on_gpu else None,
        )

    def _measure(self, degree: int) -> float:
        """Milliseconds of one step's calls at `degree` on the first GPU (zeros fed)."""
        torch = self.torch
        fused = self._fused_graph(degree)
        if isinstance(fused, str):
            return float("inf")
        feeds = _zero_feeds(fused.graph, torch, fused.device)
        buffers = fused.zero_buffers()
        for _ in range(3):  # a plain call, the capture, a replay
            fused(feeds, buffers, zeros=True)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 5
        start.record()
        for _ in range(reps):
            fused(feeds, buffers, zeros=True)
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / reps * (self.per_rank // degree)


def _fused_graph(
    graph: Graph,
    device: Any,
    torch: Any,
    *,
    overwrite: bool,
    pool: CompilePool | None = None,
) -> FusedGraph | str:
    """`graph` compiled for `device` summing into its buffers, or why it cannot be."""
    from sexpgpu.devices.cuda.fused import FusedGraph, NotFusable

    try:
        return FusedGraph(
            graph,
            device,
            sums=list(graph.outputs),
            examples=_zero_feeds(graph, torch, device),
            overwrite=overwrite,
            pool=pool,
        )
    except NotFusable as why:
        return str(why)


def _lowering_lines(graph: Graph, device: Any) -> list[str]:
    """The lowering report of `graph`'s op-by-op schedule on `device`."""
    from sexpgpu.devices.cuda.executor import TorchGraph

    return TorchGraph(graph, device).report_lines()


def _pattern_lines(graph: Graph) -> list[str]:
    """``pattern attention x12 at gpt.lisp:31:14 (fused kernel)``: each fused op and where."""
    seen: Counter = Counter()
    for node in graph.nodes():
        if node.op in FUSED:
            line = f"{node.span.source.name}:{node.span.line}" if node.span else "?"
            seen[(node.op, line)] += 1
    return [
        f"pattern: {op.label} x{count} from {where}"
        for (op, where), count in sorted(seen.items(), key=lambda kv: (kv[0][0].value, kv[0][1]))
    ]


def _schedule_peak(graph: Graph, torch: Any) -> tuple[int, Any]:
    """(bytes, node at the peak) of `graph`'s op-by-op schedule, planned on the CPU."""
    from sexpgpu.devices.cuda.executor import TorchGraph

    plan = TorchGraph(graph, torch.device("cpu"))  # planning allocates only small constants
    return plan.planned_peak_bytes, plan.peak_node


def _bytes(live: tuple[int, Any]) -> int:
    return live[0]


def _zero_feeds(graph: Graph, torch: Any, device: Any) -> dict[str, Any]:
    """Zeros for every fed leaf: the trace runs once on them (0 is a valid id)."""
    feeds: dict[str, Any] = {}
    for node in graph.nodes():
        if node.op is Op.INPUT:
            feeds[node.name] = np.zeros(node.shape, numpy_dtype(node.dtype))
        elif node.op is Op.PARAM:
            feeds[node.name] = torch.zeros(node.shape, dtype=torch.float32, device=device)
    return feeds


def _constant_bytes(graph: Graph) -> int:
    from sexpgpu.devices.cuda.executor import made_once_bytes

    return sum(made_once_bytes(n) for n in graph.nodes() if n.op in (Op.CONSTANT, Op.IOTA))


def _leaf_bytes(graph: Graph) -> int:
    """What a dry call's live set leaves out: the fed parameters and the constants."""
    return _fed_param_bytes(graph) + _constant_bytes(graph)


def _fed_param_bytes(graph: Graph) -> int:
    return sum(4 * n.size for n in graph.nodes() if n.op is Op.PARAM)
