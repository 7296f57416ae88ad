"""The ``cuda`` device: a `CompiledRun` lowered to PyTorch on one GPU per rank.

`CudaDevice` plans a GPU (memory, the stacking degree), reports the
lowering, and loads each rank's `sexpgpu.devices.cuda.kernels.TorchKernels`
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
    from sexpgpu.devices.cuda.stacking import Choice

__all__ = ["CUBLAS_WORKSPACE", "CudaDevice"]

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


class CudaDevice:
    """The ``cuda`` device (see the module docstring).

    Parameters
    ----------
    torch_device
        ``"cuda"`` (the default), or ``"cpu"`` to run the same lowering on
        PyTorch's CPU device (tests).
    """

    name = "cuda"

    def __init__(self, torch_device: str = "cuda", *, fuse: bool | None = None) -> None:
        self.torch = _torch()
        self.kind = torch_device
        gpu = torch_device == "cuda" and self.torch.cuda.is_available()
        # Where the plan and the report look: the first GPU, or the CPU without one.
        self.first = "cuda:0" if gpu and self.torch.cuda.device_count() else "cpu"
        self.on_gpu = self.first != "cpu"
        # Fused on a GPU; on PyTorch's CPU device only when a test asks (Inductor's
        # C++ compile takes seconds per graph).
        self.fuse = torch_device == "cuda" if fuse is None else fuse
        # Per run (`id` of its CompiledRun, which the caller keeps alive) and degree.
        self._live: dict[tuple[int, int], tuple[int, Any]] = {}
        self._copy_bytes: dict[tuple[int, int], int] = {}  # the fused call's parameter copies
        self._stacks: dict[tuple[int, int], Graph] = {}
        self._fused: dict[tuple[int, str, int], Any] = {}
        self._per_rank: dict[int, int] = {}  # microbatches per rank and step, per run
        self._choices: dict[int, Any] = {}
        self._pool = CompilePool(0)  # compile workers, while a plan is made

    # -- plan and report ----------------------------------------------------------------

    def plan(
        self,
        compiled: CompiledRun,
        *,
        moments: int,
        ranks: int,
        memory: int | None,
        microbatches: int = 1,
    ) -> MemoryPlan:
        """What one GPU holds at once, by part, from the graphs alone (nothing allocated).

        Parameters, optimizer moments and the gradient buffers are float32 for
        the whole run (op by op with one microbatch, the gradients are the
        graph's outputs); the largest graph's live set (its constants apart)
        comes from the executor's schedule, for the training graph at the
        stacking degree chosen here (`sexpgpu.devices.cuda.stacking`); the
        workspace is cuBLAS's (PyTorch takes it from its caching allocator)
        and the optimizer's temporaries, a few of the largest parameter. With
        several ranks, NCCL sums packed copies of the gradients.
        """
        # Their imports overlap the trace; they stop once the plan is made, or fails.
        nodes = len(compiled.train_graph.nodes())
        self._pool = CompilePool(compile_workers(self.on_gpu and self._captures(), nodes))
        try:
            return self._plan(compiled, moments, ranks, memory, microbatches)
        finally:
            self._pool.close()  # later graphs (a resume's, say) compile here

    def _plan(
        self, compiled: CompiledRun, moments: int, ranks: int, memory: int | None, microbatches: int
    ) -> MemoryPlan:
        budget = detect_budget(self.first, memory)
        per_rank = microbatches  # already this rank's share (`sexpgpu.train`)
        self._per_rank[id(compiled)] = per_rank

        def plan_at(degree: int) -> MemoryPlan:
            return MemoryPlan(budget, self._parts(compiled, degree, moments, ranks, per_rank))

        choice = self._choose(compiled, per_rank, lambda d: plan_at(d).fits)
        self._choices[id(compiled)] = choice
        plan = plan_at(choice.degree)
        # Only a plan that fits is worth a compile and a dry call (E-MEM-001 comes next otherwise).
        if self._captures() and self.on_gpu and plan.fits:
            self._dry_call(compiled, choice.degree)
            plan = plan_at(choice.degree)
        return plan

    def _dry_call(self, compiled: CompiledRun, degree: int) -> None:
        """Replace the schedules' estimates of the live sets by the calls' own, measured.

        The training side is the fused call's; the evaluation graph, which
        runs op by op, is called on zeros too (its schedule's estimate counts
        every f32 row cross-entropy may hold).
        """
        from sexpgpu.devices.cuda.executor import TorchGraph

        device = self.torch.device(self.first)
        fused = self._fused_graph(compiled, device, degree)
        if isinstance(fused, str):
            return
        peak = fused.call_peak_bytes(_zero_feeds(fused.graph, self.torch, fused.device))
        if peak is None:
            return
        evaluation = self._eval_live(compiled)
        graph = TorchGraph(compiled.eval_graph, device)
        feeds = _zero_feeds(compiled.eval_graph, self.torch, device)
        measured = call_peak_bytes(device, lambda: graph(feeds))
        if measured is not None:
            evaluation = (measured + _leaf_bytes(compiled.eval_graph), "evaluation graph")
        train = (peak + _leaf_bytes(fused.graph), "fused training call")
        self._live[(id(compiled), degree)] = max(train, evaluation, key=_bytes)
        self._copy_bytes[(id(compiled), degree)] = fused.copy_bytes

    def _parts(
        self, compiled: CompiledRun, degree: int, moments: int, ranks: int, per_rank: int
    ) -> dict[str, int]:
        live, _ = self._live_set(compiled, degree)
        params = 4 * compiled.param_count
        constants = _constant_bytes(compiled.train_graph)
        fed = _fed_param_bytes(compiled.train_graph)
        largest = max((4 * info.size for info in compiled.params.values()), default=0)
        return {
            "parameters": params,
            # The fused call's bf16 copies (param_copies.py): measured calls leave them out.
            "parameter copies": self._copy_bytes.get((id(compiled), degree), 0),
            "optimizer": moments * params,
            "gradients": params if self.fuse or per_rank > 1 else 0,
            "constants": constants,
            "activations": max(0, live - fed - constants),
            "workspace": CUBLAS_WORKSPACE * self._blas_streams() + 3 * largest + self._epilogues(),
            # NCCL sums packed copies of the gradients (devices/cuda/collectives.py).
            "collectives": params if ranks > 1 else 0,
        }

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

    def _stacked(self, compiled: CompiledRun, degree: int) -> Graph:
        """The training graph running `degree` microbatches per call (1: the graph itself)."""
        from sexpgpu.ir.stack import stack_microbatches

        if degree == 1:
            return compiled.train_graph
        key = (id(compiled), degree)
        if key not in self._stacks:
            self._stacks[key] = stack_microbatches(compiled.train_graph, degree)
        return self._stacks[key]

    def _live_set(self, compiled: CompiledRun, degree: int = 1) -> tuple[int, Any]:
        """(bytes, where) of the larger of the training and evaluation graphs' live sets.

        From the op-by-op schedules (``where``: the node at the peak), until
        the dry calls' measures replace them (`_dry_call`; ``where``: which
        call). Kept per run and degree: the plan and the report both need it.
        """
        key = (id(compiled), degree)
        if key not in self._live:
            train = _schedule_peak(self._stacked(compiled, degree), self.torch)
            self._live[key] = max(train, self._eval_live(compiled), key=_bytes)
        return self._live[key]

    def _eval_live(self, compiled: CompiledRun) -> tuple[int, Any]:
        """The evaluation graph's (bytes, node at the peak), kept per run."""
        key = (id(compiled), 0)  # degree 0: the evaluation graph
        if key not in self._live:
            self._live[key] = _schedule_peak(compiled.eval_graph, self.torch)
        return self._live[key]

    def _choose(self, compiled: CompiledRun, per_rank: int, fits: Callable[[int], bool]) -> Choice:
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

        if not self.fuse:
            return Choice(1, "op by op, one microbatch per call")
        fitting = [d for d in degrees(per_rank) if d == 1 or fits(d)]
        bf16 = any(n.dtype is DType.BF16 for n in compiled.train_graph.nodes() if n.op is Op.MATMUL)
        model = CostModel.for_dtype("bf16" if bf16 else "f32")
        model_ms = {}
        for d in fitting:
            graph = self._stacked(compiled, d)
            moved = 3 * 4 * compiled.param_count + self._live_set(compiled, d)[0]
            calls, nodes = per_rank // d, len(graph.nodes())
            model_ms[d] = model.step_ms(calls, matmul_flops(graph), moved, nodes)
        text = format_graph(compiled.train_graph, spans=False)
        return choose(
            fitting,
            model_ms,
            key=graph_key(text, self._device_name(), per_rank),
            path=choices_path(),
            measure=(lambda d: self._measure(compiled, d, per_rank)) if self.on_gpu else None,
        )

    def _device_name(self) -> str:
        if not self.on_gpu:
            return f"torch-cpu/{self.torch.__version__}"
        return f"{self.torch.cuda.get_device_name(0)}/torch {self.torch.__version__}"

    def _measure(self, compiled: CompiledRun, degree: int, per_rank: int) -> float:
        """Milliseconds of one step's calls at `degree` on the first GPU (zeros fed)."""
        torch = self.torch
        device = torch.device(self.first)
        fused = self._fused_graph(compiled, device, degree)
        if isinstance(fused, str):
            return float("inf")
        feeds = _zero_feeds(fused.graph, torch, device)
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
        return start.elapsed_time(stop) / reps * (per_rank // degree)

    def report(self, compiled: CompiledRun, plan: MemoryPlan) -> list[str]:
        """Device and capability, patterns matched and where, kernels, attention, the plan."""
        from sexpgpu.devices.cuda.executor import TorchGraph

        lines = [self._device_line()]
        lines += _pattern_lines(compiled.train_graph)
        graph = TorchGraph(compiled.train_graph, self.torch.device(self.first))
        lines += graph.report_lines()
        lines += self._fused_lines(compiled)
        lines.append(plan.line())
        live, node = self._live_set(compiled, self._choice(compiled).degree)
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

    def _fused_lines(self, compiled: CompiledRun) -> list[str]:
        choice = self._choice(compiled)
        lines = [choice.line()]
        if not self.fuse:
            return [*lines, "fused: off (op by op)"]
        if self.kind == "cuda" and not self.on_gpu:
            return [*lines, "fused: the training graph is compiled on the GPU when a run loads it"]
        fused = self._fused_graph(compiled, self.torch.device(self.first), choice.degree)
        if isinstance(fused, str):
            return [*lines, f"fused: off, op by op: {fused}"]
        return lines + fused.report_lines()

    def _choice(self, compiled: CompiledRun) -> Choice:
        from sexpgpu.devices.cuda.stacking import Choice

        return self._choices.get(id(compiled), Choice(1, "one microbatch per call (not planned)"))

    def _fused_graph(self, compiled: CompiledRun, device: Any, degree: int) -> Any:
        """The training graph at `degree` compiled for `device`, or why it cannot be.

        Kept: the measurement, the report and the load share it.
        """
        from sexpgpu.devices.cuda.fused import FusedGraph, NotFusable

        key = (id(compiled), str(device), degree)
        if key not in self._fused:
            graph = self._stacked(compiled, degree)
            examples = _zero_feeds(graph, self.torch, device)
            # A step of one call writes its sums (nothing to zero, nothing read back).
            overwrite = degree == self._per_rank.get(id(compiled), 1)
            try:
                self._fused[key] = FusedGraph(
                    graph,
                    device,
                    sums=list(graph.outputs),
                    examples=examples,
                    overwrite=overwrite,
                    pool=self._pool,
                )
            except NotFusable as why:
                self._fused[key] = str(why)
        return self._fused[key]

    # -- load -----------------------------------------------------------------------------

    def load(self, compiled: CompiledRun, where: DeviceId) -> TrainState:
        """A rank's program on GPU `where` (refused below compute capability 8.0)."""
        from sexpgpu.devices.cuda.arrays import TorchOps
        from sexpgpu.devices.cuda.kernels import TorchKernels

        torch = self.torch
        if self.kind == "cuda":
            require_capability([where])
            device = torch.device("cuda", where.index)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        degree = self._choice(compiled).degree
        fused = self._fused_graph(compiled, device, degree) if self.fuse else None
        if isinstance(fused, str):
            fused, degree = None, 1  # the report said why
        # Candidates measured and not chosen give their memory back.
        for key in [k for k in self._fused if k[0] == id(compiled) and k[2] != degree]:
            del self._fused[key]
        kernels = TorchKernels(compiled, device, where, fused=fused, degree=degree)
        # The update writes the copies of the parameters the fused call reads.
        return TrainState(kernels, TorchOps(device, fused.copies if fused is not None else None))


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
    from sexpgpu.devices.cuda.executor import _made_once_bytes

    return sum(_made_once_bytes(n) for n in graph.nodes() if n.op in (Op.CONSTANT, Op.IOTA))


def _leaf_bytes(graph: Graph) -> int:
    """What a dry call's live set leaves out: the fed parameters and the constants."""
    return _fed_param_bytes(graph) + _constant_bytes(graph)


def _fed_param_bytes(graph: Graph) -> int:
    return sum(4 * n.size for n in graph.nodes() if n.op is Op.PARAM)
