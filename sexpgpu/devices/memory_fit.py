"""The memory plan with recomputation: the device's plan, made to fit where it can.

`plan_run` asks the device for its plan of the run as compiled; where that
does not fit, it asks again for graphs that recompute forward values in the
backward (`sexpgpu.ir.recompute.fit`), each judged by the device's own plan
(its live sets at the stacking degree it picks for that graph), and keeps
the one with the least recomputation that fits. Where even the cheapest
full recomputation does not fit, the plan returned is that one's, and
`FittedPlan.check` raises E-MEM-001.
"""

from __future__ import annotations

from dataclasses import dataclass

from sexpgpu.devices.base import Device, Plan
from sexpgpu.ir.compile import CompiledRun, matmul_flops
from sexpgpu.ir.node import Graph
from sexpgpu.ir.recompute import Recomputation, fit
from sexpgpu.runtime.units import format_bytes

__all__ = ["FittedPlan", "plan_run"]


@dataclass(frozen=True)
class FittedPlan:
    """What a run loads (`compiled`, its training graph perhaps rewritten) and its plan.

    Attributes
    ----------
    compiled
        The run to load on the device.
    plan
        The device's plan of `compiled` (its memory: ``plan.memory``).
    recompute
        The recomputation chosen, or None where the run fits without.
    """

    compiled: CompiledRun
    plan: Plan
    recompute: Recomputation | None = None

    def lines(self) -> list[str]:
        """``recompute: 412 values, +18% FLOPs, plan 31.2 of 40.0 GiB``, where it recomputes."""
        if self.recompute is None:
            return []
        plan = self.plan.memory
        total = f"plan {format_bytes(plan.total)} of {format_bytes(plan.budget.nbytes)}"
        line = self.recompute.line(total)
        if not self.recompute.fits:
            line += " (the cheapest full recomputation: it does not fit)"
        return [line]

    def check(self, hint: str) -> None:
        """E-MEM-001 where even the cheapest full recomputation does not fit."""
        if self.recompute is not None:
            hint = (
                f"{hint} (even recomputing {self.recompute.values} forward values "
                "in the backward does not fit)"
            )
        self.plan.memory.check(hint=hint)


def plan_run(
    backend: Device,
    compiled: CompiledRun,
    *,
    moments: int,
    ranks: int,
    memory: int | None,
    microbatches: int = 1,
) -> FittedPlan:
    """The device's plan of `compiled`, with the least recomputation that makes it fit.

    The arguments after `compiled` are `Device.plan`'s.
    """
    # Each graph planned once (a plan may compile and measure the step).
    planned: dict[int, tuple[CompiledRun, Plan]] = {}

    def plan_of(graph: Graph) -> tuple[CompiledRun, Plan]:
        if id(graph) not in planned:
            run = compiled if graph is compiled.train_graph else compiled.with_train_graph(graph)
            plan = backend.plan(
                run, moments=moments, ranks=ranks, memory=memory, microbatches=microbatches
            )
            planned[id(graph)] = (run, plan)
        return planned[id(graph)]

    recompute = fit(compiled.train_graph, lambda g: plan_of(g)[1].memory.fits, matmul_flops)
    graph = compiled.train_graph if recompute is None else recompute.graph
    return FittedPlan(*plan_of(graph), recompute)
