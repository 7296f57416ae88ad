"""What a device's plan says of recomputation, and E-MEM-001 when nothing fits.

Each device's `plan` applies `sexpgpu.ir.recompute.fit` where the run does
not fit as compiled, judging each candidate graph by its own live-set
estimate (the cpu device by the interpreter's schedule, the cuda device by
the op-by-op schedule at each stacking degree), and keeps the result in its
plan (``plan.recompute``). These helpers turn that into the report's line
and the error.
"""

from __future__ import annotations

from sexpgpu.devices.base import Plan
from sexpgpu.runtime.units import format_bytes

__all__ = ["check_plan", "recompute_lines"]


def recompute_lines(plan: Plan) -> list[str]:
    """``recompute: 412 values, +18% FLOPs, plan 31.2 of 40.0 GiB``, where the plan recomputes."""
    recompute = plan.recompute
    if recompute is None:
        return []
    memory = plan.memory
    line = recompute.line(
        f"plan {format_bytes(memory.total)} of {format_bytes(memory.budget.nbytes)}"
    )
    if not recompute.fits:
        line += " (the cheapest full recomputation: it does not fit)"
    return [line]


def check_plan(plan: Plan, hint: str) -> None:
    """E-MEM-001 where the plan does not fit, even recomputing what it could."""
    if plan.recompute is not None:
        hint = (
            f"{hint} (even recomputing {plan.recompute.values} forward values "
            "in the backward does not fit)"
        )
    plan.memory.check(hint=hint)
