"""The ``cuda`` device: a `CompiledRun` lowered to PyTorch on one GPU per rank.

`TorchKernels` runs the training, evaluation and activation graphs through
`sexpgpu.devices.cuda.executor.TorchGraph` (cuBLAS products, SDPA attention,
fused normalizations and cross-entropy); the rank's parameters, gradient
buffers and optimizer moments are float32 tensors on the GPU inside a
`sexpgpu.devices.state.TrainState`. The host sees the loss once per step.

The same lowering runs on PyTorch's CPU device for the tests
(``CudaDevice(torch_device="cpu")``): an internal switch, not a device users
name. torch is imported when the device is made, never before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

from sexpgpu.devices.state import SummingKernels, Sums, TrainState
from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.compile import GRAD_PREFIX, CompiledRun
from sexpgpu.ir.dtypes import numpy_dtype
from sexpgpu.ir.node import Graph
from sexpgpu.ir.ops import FUSED, Op
from sexpgpu.runtime.devices import Device as DeviceId
from sexpgpu.runtime.devices import require_capability
from sexpgpu.runtime.memory import MemoryPlan, PeakTracker, detect_budget

__all__ = ["CUBLAS_WORKSPACE", "CudaDevice", "TorchKernels"]

# cuBLAS's workspace on Hopper as PyTorch sizes it (CUBLAS_WORKSPACE_CONFIG :4096:8).
CUBLAS_WORKSPACE = 32 * 2**20


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


class TorchKernels(SummingKernels):
    """A run's graphs lowered to PyTorch on one device (the `Kernels` of cuda).

    With `fused`, the training graph runs as a `FusedGraph` (Inductor's
    kernels, summing into buffers this object owns, a CUDA graph on a GPU);
    without it, or where the graph is `NotFusable`, op by op.
    """

    has_activations = True

    def __init__(
        self, compiled: CompiledRun, device: Any, where: DeviceId, *, fused: Any = None
    ) -> None:
        from sexpgpu.devices.cuda.executor import TorchGraph

        self.compiled = compiled
        self.params = compiled.params
        self.device = device
        self._train = TorchGraph(compiled.train_graph, device)
        self._eval = TorchGraph(compiled.eval_graph, device)
        self._activations: Any = None
        self._graph = TorchGraph
        self._tracker = PeakTracker(where)
        self.fused = fused
        self._buffers: Sums | None = None

    @property
    def last_peak_bytes(self) -> int:
        """The allocator's high-water mark on a GPU; the planned live set on the CPU."""
        if not self._tracker.device.is_cuda:
            self._tracker.observe(self._train.planned_peak_bytes)
        return self._tracker.peak

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        return self.compiled.init_params(seed)

    def train_step(self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray]) -> Any:
        out = self._train({**batch, **params})
        return out["loss"], {name: out[GRAD_PREFIX + name] for name in self.params}

    def accumulate(
        self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray], sums: Sums | None
    ) -> Sums:
        if self.fused is None:
            return super().accumulate(params, batch, sums)
        if sums is None:
            sums = self._zeroed()
        buffers = {"loss": sums.loss, **{GRAD_PREFIX + k: g for k, g in sums.grads.items()}}
        self.fused({**batch, **params}, buffers)
        sums.count += 1
        return sums

    def _zeroed(self) -> Sums:
        """The step's sums at zero, in buffers kept for the whole run (a CUDA graph reads them)."""
        import torch

        if self._buffers is None:
            zeros = {
                k: torch.zeros(info.shape, dtype=torch.float32, device=self.device)
                for k, info in self.params.items()
            }
            self._buffers = Sums(torch.zeros((), dtype=torch.float32, device=self.device), zeros, 0)
        buffers = self._buffers
        torch._foreach_zero_([buffers.loss, *buffers.grads.values()])
        return Sums(buffers.loss, dict(buffers.grads), 0)

    def eval_step(self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray]) -> Any:
        out = self._eval({**batch, **params})
        return out["loss"], out.get("output")

    def activation_rms(
        self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray]
    ) -> dict[str, float]:
        if self._activations is None:
            self._activations = self._graph(self.compiled.activation_graph, self.device)
        out = self._activations({**batch, **params})
        return {path: float(value) for path, value in out.items()}

    def report_lines(self) -> list[str]:
        lines = self._train.report_lines()
        return lines + (self.fused.report_lines() if self.fused is not None else [])


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
        self._live: tuple[CompiledRun, tuple[int, Any]] | None = None
        # Fused on a GPU; on PyTorch's CPU device only when a test asks (Inductor's
        # C++ compile takes seconds per graph).
        self.fuse = torch_device == "cuda" if fuse is None else fuse
        self._fused: dict[tuple[int, str], Any] = {}

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

        Parameters, optimizer moments and (with several microbatches) the
        gradient buffers are float32 for the whole run; the largest graph's
        live set (its constants apart) comes from the executor's schedule;
        the workspace is cuBLAS's (PyTorch takes it from its caching allocator)
        and the optimizer's temporaries, a few of the largest parameter. With
        several ranks, NCCL sums packed copies of the gradients.
        """
        budget = detect_budget(self.first, memory)
        live, _ = self._live_set(compiled)
        params = 4 * compiled.param_count
        constants = _constant_bytes(compiled.train_graph)
        fed = _fed_param_bytes(compiled.train_graph)
        largest = max((4 * info.size for info in compiled.params.values()), default=0)
        parts = {
            "parameters": params,
            "optimizer": moments * params,
            "gradients": params if microbatches > 1 else 0,
            "constants": constants,
            "activations": max(0, live - fed - constants),
            "workspace": CUBLAS_WORKSPACE + 3 * largest,
            # NCCL sums packed copies of the gradients (devices/cuda/collectives.py).
            "collectives": params if ranks > 1 else 0,
        }
        return MemoryPlan(budget, parts)

    def _live_set(self, compiled: CompiledRun) -> tuple[int, Any]:
        """(bytes, node at the peak) of the larger of the training and evaluation graphs.

        Kept for the run last asked about: the plan and the report both need it.
        """
        from sexpgpu.devices.cuda.executor import TorchGraph

        if self._live is None or self._live[0] is not compiled:
            where = self.torch.device("cpu")  # planning allocates only small constants
            plans = [TorchGraph(g, where) for g in (compiled.train_graph, compiled.eval_graph)]
            biggest = max(plans, key=lambda p: p.planned_peak_bytes)
            self._live = (compiled, (biggest.planned_peak_bytes, biggest.peak_node))
        return self._live[1]

    def report(self, compiled: CompiledRun, plan: MemoryPlan) -> list[str]:
        """Device and capability, patterns matched and where, kernels, attention, the plan."""
        from sexpgpu.devices.cuda.executor import TorchGraph

        lines = [self._device_line()]
        lines += _pattern_lines(compiled.train_graph)
        graph = TorchGraph(compiled.train_graph, self.torch.device(self.first))
        lines += graph.report_lines()
        lines += self._fused_lines(compiled)
        lines.append(plan.line())
        _, node = self._live_set(compiled)
        if node is not None:
            where = f" at {node.span}" if node.span is not None else ""
            lines.append(f"memory: the live set peaks at {node.op.label}{where}")
        return lines

    def _device_line(self) -> str:
        torch = self.torch
        if self.first == "cpu":
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
        if not self.fuse:
            return ["fused: off (op by op)"]
        if self.kind == "cuda" and self.first == "cpu":
            return ["fused: the training graph is compiled on the GPU when the run loads it"]
        fused = self._fused_graph(compiled, self.torch.device(self.first))
        if isinstance(fused, str):
            return [f"fused: off, op by op: {fused}"]
        return fused.report_lines()

    def _fused_graph(self, compiled: CompiledRun, device: Any) -> Any:
        """The training graph compiled for `device` (kept: the report and the load share it),
        or why it cannot be."""
        from sexpgpu.devices.cuda.fused import FusedGraph, NotFusable

        key = (id(compiled), str(device))
        if key not in self._fused:
            graph = compiled.train_graph
            examples = _zero_feeds(graph, self.torch, device)
            try:
                self._fused[key] = FusedGraph(
                    graph, device, sums=list(graph.outputs), examples=examples
                )
            except NotFusable as why:
                self._fused[key] = str(why)
        return self._fused[key]

    # -- load -----------------------------------------------------------------------------

    def load(self, compiled: CompiledRun, where: DeviceId) -> TrainState:
        """A rank's program on GPU `where` (refused below compute capability 8.0)."""
        from sexpgpu.devices.cuda.arrays import TorchOps

        torch = self.torch
        if self.kind == "cuda":
            require_capability([where])
            device = torch.device("cuda", where.index)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        fused = self._fused_graph(compiled, device) if self.fuse else None
        if isinstance(fused, str):
            fused = None  # the report said why
        kernels = TorchKernels(compiled, device, where, fused=fused)
        return TrainState(kernels, TorchOps(device))


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


def _fed_param_bytes(graph: Graph) -> int:
    return sum(4 * n.size for n in graph.nodes() if n.op is Op.PARAM)
