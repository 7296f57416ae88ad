"""The ``cpu`` device: a `CompiledRun` on the IR interpreter, state in NumPy arrays.

`CpuGraphs` plans the training, evaluation and (on first use) activation
graphs on the interpreter (`sexpgpu.devices.cpu.CpuProgram`); `CpuDevice`
plans memory against the host and hands each rank a
`sexpgpu.devices.state.TrainState` over them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from sexpgpu.devices.cpu import CpuProgram
from sexpgpu.devices.memory_fit import recompute_lines
from sexpgpu.devices.optim import moment_count
from sexpgpu.devices.shard import largest_shard
from sexpgpu.devices.state import SummingGraphs, TrainState
from sexpgpu.ir.compile import GRAD_PREFIX, CompiledRun, matmul_flops
from sexpgpu.ir.node import Graph
from sexpgpu.ir.recompute import Recomputation, fit
from sexpgpu.runtime.devices import Device as DeviceId
from sexpgpu.runtime.memory import MemoryBudget, MemoryPlan, detect_budget

__all__ = ["CpuDevice", "CpuGraphs", "CpuPlan"]


class CpuGraphs(SummingGraphs):
    """A run's graphs planned on the interpreter (the `StepGraphs` of the cpu device)."""

    has_activations = True

    def __init__(self, compiled: CompiledRun) -> None:
        self.compiled = compiled
        self.params = compiled.params
        self._train = CpuProgram(compiled.train_graph)
        self._eval = CpuProgram(compiled.eval_graph)
        self._activations: CpuProgram | None = None
        self.planned_peak_bytes = self._train.planned_peak_bytes
        self.last_peak_bytes = 0

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        return self.compiled.init_params(seed)

    def pieces(self, parts: int) -> CpuGraphs | None:
        smaller = self.compiled.pieces(parts)
        return None if smaller is None else CpuGraphs(smaller)

    def train_step(
        self, params: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]
    ) -> tuple[float, dict[str, np.ndarray]]:
        out = self._run(self._train, params, batch)
        grads = {name: _f32(out[GRAD_PREFIX + name]) for name in self.params}
        return float(out["loss"]), grads

    def eval_step(
        self, params: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]
    ) -> tuple[float, np.ndarray]:
        out = self._run(self._eval, params, batch)
        return float(out["loss"]), out.get("output", np.zeros(0, np.float32))

    def activation_rms(
        self, params: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]
    ) -> dict[str, float]:
        if self._activations is None:
            self._activations = CpuProgram(self.compiled.activation_graph)
        out = self._run(self._activations, params, batch)
        return {path: float(value) for path, value in out.items()}

    def _run(
        self, program: CpuProgram, params: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        feeds = dict(batch)
        feeds.update(params)
        out = program(feeds)
        self.last_peak_bytes = program.last_peak_bytes
        return out


def _f32(array: np.ndarray) -> np.ndarray:
    return array if array.dtype == np.float32 else array.astype(np.float32)


@dataclass(frozen=True)
class CpuPlan:
    """The cpu device's plan: the run, its memory, and what it recomputes to fit."""

    compiled: CompiledRun
    memory: MemoryPlan
    recompute: Recomputation | None = None


class CpuDevice:
    """The ``cpu`` device (see the module docstring)."""

    name = "cpu"

    def plan(
        self,
        compiled: CompiledRun,
        *,
        optimizer: str,
        ranks: int,
        memory: int | None,
        microbatches: int = 1,
        shards: int = 1,
    ) -> CpuPlan:
        """Parameters, optimizer moments and the training graph's live set, per rank.

        The simulated ranks of a cpu run share the host, so each gets its
        share of the host's memory unless ``SEXPGPU_MEMORY`` sets the budget
        per rank. The live set includes the gradients (graph outputs); the
        buffers they are summed into over `microbatches` are not counted,
        as before the device interface. Sharded over `shards` ranks, a rank
        keeps the moments of its shard alone (the largest shard counted).
        """
        del microbatches
        budget = detect_budget("cpu", memory)
        if memory is None and ranks > 1:
            budget = MemoryBudget(budget.device, budget.nbytes // ranks, f"host memory / {ranks}")
        params = 4 * compiled.param_count
        moments = moment_count(optimizer) * 4 * largest_shard(compiled, shards)

        def memory_of(graph: Graph) -> MemoryPlan:
            live = CpuProgram(graph).planned_peak_bytes
            parts = {"parameters": params, "optimizer": moments, "activations": live}
            return MemoryPlan(budget, parts)

        # Where the run does not fit, the least recomputation that does (docs/ir.md).
        recompute = fit(compiled.train_graph, lambda g: memory_of(g).fits, matmul_flops)
        if recompute is not None:
            compiled = compiled.with_train_graph(recompute.graph)
        return CpuPlan(compiled, memory_of(compiled.train_graph), recompute)

    def report(self, plan: CpuPlan) -> list[str]:
        """The device, and the plan: the interpreter matches no patterns."""
        nodes = len(plan.compiled.train_graph.nodes())
        return [
            f"device: cpu (the IR interpreter, {nodes} nodes in the training graph)",
            plan.memory.line(),
            *recompute_lines(plan),
        ]

    def load(self, plan: CpuPlan, where: DeviceId) -> TrainState:
        return TrainState(CpuGraphs(plan.compiled), plan=plan.memory)
