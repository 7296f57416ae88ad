"""The ``cuda`` device: a `CompiledRun` lowered to PyTorch on one GPU per rank.

`CudaDevice.plan` decides for a run, before anything is allocated: the
stacking degree, the stacked and compiled training graph, the live sets
and the memory plan, all in one value (`CudaPlan`). `report` prints it and
`load` turns it into each rank's `sexpgpu.devices.cuda.step_graphs.TorchGraphs`
(the fused training step, the op-by-op evaluation) into a
`sexpgpu.devices.state.TrainState`: parameters, gradient buffers and
optimizer moments are float32 tensors on the GPU. The host sees the loss
once per step.

The same lowering runs on PyTorch's CPU device for the tests
(``CudaDevice(torch_device="cpu")``): an internal switch, not a device users
name. torch is imported when the device is made, never before.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING, Any

from sexpgpu.devices.cuda.parallel_compile import CompilePool, compile_workers
from sexpgpu.devices.cuda.planner import CudaPlan, Planner, fused_graph
from sexpgpu.devices.memory_fit import recompute_lines
from sexpgpu.devices.state import TrainState
from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.compile import CompiledRun
from sexpgpu.ir.node import Graph
from sexpgpu.ir.ops import FUSED
from sexpgpu.runtime.devices import Device as DeviceId
from sexpgpu.runtime.devices import require_capability

if TYPE_CHECKING:
    from sexpgpu.devices.cuda.fused import FusedGraph

__all__ = ["CUBLAS_WORKSPACE", "CudaDevice", "CudaPlan", "import_torch"]

# What cuBLAS takes from PyTorch's caching allocator per handle and stream, as
# PyTorch sizes it on Hopper: its workspace (CUBLAS_WORKSPACE_CONFIG :4096:8)
# and cuBLASLt's (measured on an H200: 32 MiB and 1 MiB, dev/memory_peak.py).
CUBLAS_WORKSPACE = 33 * 2**20


def import_torch() -> Any:
    """torch, or E-DEV-002 where it is not installed."""
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
    deterministic
        Whether runs repeat bit for bit (`sexpgpu.devices.cuda.process`);
        None reads ``SEXPGPU_DETERMINISTIC``, unset: the device's default.

    The compile cache (`sexpgpu.devices.cuda.compile_cache`) is the folder
    ``SEXPGPU_CACHE`` or ``XDG_CACHE_HOME`` names, read when it opens.
    """

    name = "cuda"

    def __init__(
        self,
        torch_device: str = "cuda",
        *,
        fuse: bool | None = None,
        deterministic: bool | None = None,
    ) -> None:
        from sexpgpu.devices.cuda.compile_cache import open_cache
        from sexpgpu.runtime.config import deterministic_setting

        self.torch = import_torch()
        self.kind = torch_device
        gpu = torch_device == "cuda" and self.torch.cuda.is_available()
        # Where the plan and the report look: the first GPU, or the CPU without one.
        self.first = "cuda:0" if gpu and self.torch.cuda.device_count() else "cpu"
        self.on_gpu = self.first != "cpu"
        self.fuse = torch_device == "cuda" if fuse is None else fuse
        setting = deterministic_setting(os.environ) if deterministic is None else deterministic
        self.chosen = setting is not None  # by SEXPGPU_DETERMINISTIC, or the default's
        if self.kind == "cuda":
            from sexpgpu.devices.cuda.process import BY_DEFAULT, open_settings

            self.deterministic = BY_DEFAULT if setting is None else setting
            open_settings(self.deterministic)
        else:  # PyTorch's CPU device sums in one order every run
            self.deterministic = True
        # Compiled steps kept between runs; Inductor's and Triton's caches go there too.
        self.cache = open_cache(os.environ) if self.fuse else None

    # -- plan and report ----------------------------------------------------------------

    def plan(
        self,
        compiled: CompiledRun,
        *,
        optimizer: str,
        ranks: int,
        memory: int | None,
        microbatches: int = 1,
        shards: int = 1,
    ) -> CudaPlan:
        """What one GPU holds at once, by part, from the graphs alone (nothing allocated).

        Parameters, optimizer moments and the gradient buffers are float32 for
        the whole run (op by op with one microbatch, the gradients are the
        graph's outputs); the largest graph's live set (its constants apart)
        comes from the executor's schedule, for the training graph at the
        stacking degree chosen here (`sexpgpu.devices.cuda.stacking`); the
        workspace is cuBLAS's (PyTorch takes it from its caching allocator)
        and the update rule's scratch (`UPDATE_SCRATCH`). With
        several ranks, NCCL sums packed copies of the gradients; sharded over
        `shards` ranks, a GPU keeps its shard's moments alone, and where it
        measures the step, the f32 of its shard's parameters alone among those
        the step reads as bf16 copies alone (docs/devices.md). Where the
        plan fits a GPU, a dry call of the compiled step on zeros replaces
        the schedule's live set by the one measured.
        """
        # Their imports overlap the trace; they stop once the plan is made, or fails.
        nodes = len(compiled.train_graph.nodes())
        pool = CompilePool(compile_workers(self.on_gpu and self.captures, nodes))
        try:
            return Planner(self, compiled, microbatches, pool).plan(
                optimizer, ranks, memory, shards
            )
        finally:
            pool.close()  # later graphs (other GPUs', a resume's) compile in-process

    def library_workspace(self, cublaslt: bool = True) -> int:
        """What cuBLAS and cuBLASLt take from PyTorch's allocator, in bytes.

        PyTorch keeps a cuBLAS workspace per (thread, stream) pair: the rank's
        thread computes on its stream; where steps are captured, the
        capture's stream is a second, and the thread that plans (its trace and
        dry call run the step) holds a third. Captured steps whose products
        run through `sexpgpu.devices.cuda.cublaslt` (`cublaslt`) have its
        workspace too.
        """
        from sexpgpu.devices.cuda.cublaslt import WORKSPACE

        if self.captures:
            return 3 * CUBLAS_WORKSPACE + (WORKSPACE if cublaslt else 0)
        return CUBLAS_WORKSPACE

    @property
    def captures(self) -> bool:
        """Whether training calls are replayed as CUDA graphs (fused, on a GPU)."""
        return self.fuse and self.kind == "cuda"

    def device_name(self) -> str:
        """The GPU's name and torch's version: the key of remembered stacking choices."""
        if not self.on_gpu:
            return f"torch-cpu/{self.torch.__version__}"
        return f"{self.torch.cuda.get_device_name(0)}/torch {self.torch.__version__}"

    def report(self, plan: CudaPlan) -> list[str]:
        """Device and capability, patterns matched and where, kernels, attention, the plan."""
        lines = [self._device_line(), self._determinism_line()]
        lines += _pattern_lines(plan.compiled.train_graph)
        lines += plan.lowering
        lines += self._fused_lines(plan)
        lines.append(plan.memory.line())
        lines += recompute_lines(plan)
        live, node = plan.live
        if isinstance(node, str):  # measured by a dry call
            kept = getattr(plan.fused, "peak_kept", False)  # measured by an earlier run
            when = "by an earlier run on this GPU (kept in the compile cache)"
            when = when if kept else "before the first step"
            lines.append(
                f"memory: the live set ({live / 2**20:.1f} MiB) is the {node}'s own, "
                f"measured over calls on zeros {when}"
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

    def _determinism_line(self) -> str:
        if self.kind != "cuda":
            return "determinism: on (PyTorch's CPU device sums in one order)"
        why = "SEXPGPU_DETERMINISTIC" if self.chosen else "the default"
        if self.deterministic:
            return (
                f"determinism: on ({why}): ordered embedding-gradient sums, flash attention's "
                "deterministic backward, Inductor's kernels chosen without timing, stacking by "
                "the cost model: the same bits every run on this GPU (docs/devices.md, Determinism)"
            )
        return (
            f"determinism: off ({why}): the fastest kernels, whose sums may differ in the last "
            "bits from run to run; SEXPGPU_DETERMINISTIC=1 gives the same bits every run"
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
        return fused_graph(
            plan.stacked,
            device,
            self.torch,
            whole_step=plan.choice.degree == plan.microbatches,
            cache=self.cache,
            recomputes=plan.recompute is not None,  # as the planner compiled it
        )

    # -- load -----------------------------------------------------------------------------

    def load(self, plan: CudaPlan, where: DeviceId) -> TrainState:
        """A rank's program on GPU `where` (refused below compute capability 8.0)."""
        from sexpgpu.devices.cuda.arrays import TorchOps
        from sexpgpu.devices.cuda.param_copies import ParamCopies
        from sexpgpu.devices.cuda.step_graphs import TorchGraphs
        from sexpgpu.devices.cuda.stream import TorchStream

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
            fused = (
                planned.for_caller()
                if same and planned.device == device
                else self._compile(plan, device)
            )
            if isinstance(planned, str) or isinstance(fused, str):
                fused = None  # the report said why: op by op
            else:
                degree = plan.choice.degree
        # The update writes the bf16 copies of the parameters that the fused call reads.
        copies = ParamCopies()
        graphs = TorchGraphs(
            plan.compiled, device, where, fused=fused, degree=degree, copies=copies
        )
        return TrainState(graphs, TorchOps(device, copies), TorchStream(device), plan=plan.memory)


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
