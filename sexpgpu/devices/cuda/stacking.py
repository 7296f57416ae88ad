"""Stacking: how many microbatches one call of the training graph runs.

A degree ``d`` runs `sexpgpu.ir.stack.stack_microbatches` of the training
graph, so a rank's ``n`` microbatches take ``n / d`` calls (``d`` divides
``n``). The degree is chosen among those whose plan fits, in this order:

1. the only one that fits;
2. an earlier measurement of the same graph on the same device, remembered
   in ``choices.json`` in the cache's folder (``$XDG_CACHE_HOME/sexpgpu``,
   ``~/.cache/sexpgpu`` by default, or ``SEXPGPU_CACHE``; delete the file to
   measure again);
3. the cost model's pick, when its best prediction beats every other by
   more than 5%;
4. otherwise a measurement at the first step of the degrees the model could
   not separate, remembered for next time.

Deterministic runs (`sexpgpu.devices.cuda.process`) take the cost model's
pick and neither measure nor remember: a measurement may differ from one
run to the next, and with it the sums' order.

The cost model is a roofline per call: the products' FLOPs at the dtype's
matmul rate, the parameters and live set moved once at the memory's
bandwidth, and a launch per graph node. It knows the shapes, not the
kernels, so it is trusted only where it sees a clear difference.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sexpgpu.runtime.config import cache_dir
from sexpgpu.runtime.files import replace_whole

__all__ = ["MARGIN", "Choice", "CostModel", "choices_path", "choose", "degrees", "graph_key"]

# Predictions closer than this cannot tell two degrees apart.
MARGIN = 0.05


@dataclass(frozen=True)
class Choice:
    """The chosen degree and why (the report's ``stacking`` line)."""

    degree: int
    reason: str

    def line(self) -> str:
        return f"stacking {self.degree}: {self.reason}"


@dataclass(frozen=True)
class CostModel:
    """A roofline per call; rates of a Hopper GPU unless told otherwise.

    Attributes
    ----------
    flops_per_s
        Products' rate: bf16 tensor cores, or f32 without TF32.
    bytes_per_s
        Memory bandwidth.
    launch_s
        One kernel's launch inside a CUDA graph.
    """

    flops_per_s: float
    bytes_per_s: float = 4.0e12
    launch_s: float = 2e-6

    @classmethod
    def for_dtype(cls, dtype: str) -> CostModel:
        return cls(flops_per_s=6.0e14 if dtype == "bf16" else 5.0e13)

    def step_ms(self, calls: int, flops: int, moved_bytes: int, nodes: int) -> float:
        """Predicted milliseconds of a step of `calls` calls of one stacked graph."""
        per_call = flops / self.flops_per_s + moved_bytes / self.bytes_per_s
        return 1e3 * calls * (per_call + nodes * self.launch_s)


def degrees(per_rank: int) -> list[int]:
    """Every degree that divides a rank's microbatches, largest first."""
    return [d for d in range(per_rank, 0, -1) if per_rank % d == 0]


def choices_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where measured choices are remembered: the cache's folder (`cache_dir`).

    With the cache off (``SEXPGPU_CACHE=0``) the choices stay in the default folder.
    """
    env = os.environ if environ is None else environ
    folder = cache_dir(env) or cache_dir({k: v for k, v in env.items() if k != "SEXPGPU_CACHE"})
    return folder / "choices.json"


def graph_key(graph_text: str, device: str, per_rank: int) -> str:
    """The memory's key: the graph's text, the device and the microbatches per rank."""
    digest = hashlib.sha256(graph_text.encode()).hexdigest()[:32]
    return f"stacking/{digest}/{device}/{per_rank}"


def _remembered(path: Path, key: str) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None  # no file, or one damaged: measure again
    return entry if isinstance(entry, dict) and isinstance(entry.get("degree"), int) else None


def _remember(path: Path, key: str, entry: dict[str, Any]) -> None:
    try:
        table = json.loads(path.read_text())
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    table[key] = entry
    # A cache that cannot be written costs a measurement next time, nothing else.
    with contextlib.suppress(OSError):
        replace_whole(path, json.dumps(table, indent=1, sort_keys=True))


def _numbers(ms: Mapping[int, float], model: Mapping[int, float]) -> str:
    return "; ".join(f"{d} {ms[d]:.1f} ms, model {model[d]:.1f} ms" for d in ms)


def choose(
    fitting: Sequence[int],
    model_ms: Mapping[int, float],
    *,
    key: str,
    path: Path | None,
    measure: Callable[[int], float] | None,
) -> Choice:
    """The degree to run (see the module docstring for the order).

    Parameters
    ----------
    fitting
        Degrees whose plan fits, largest first (never empty: 1 always runs).
    model_ms
        The cost model's step time per fitting degree.
    key, path
        Where an earlier measurement is remembered; path None: a deterministic
        run, which takes the model's pick (nothing remembered or measured).
    measure
        Times one step at a degree (ms), or None where nothing can run yet
        (planning without a GPU).
    """
    if len(fitting) == 1:
        return Choice(fitting[0], "the only degree that fits the plan")
    if path is None:
        best = min(fitting, key=lambda d: (model_ms[d], -d))
        others = ", ".join(f"{d} {model_ms[d]:.1f} ms" for d in fitting if d != best)
        return Choice(
            best,
            f"the cost model's pick ({model_ms[best]:.1f} ms; {others}), deterministic: "
            "nothing measured",
        )
    entry = _remembered(path, key)
    if entry is not None and entry["degree"] in fitting:
        ms = {int(d): float(t) for d, t in entry.get("measured", {}).items()}
        shown = _numbers(ms, {d: model_ms.get(d, float("nan")) for d in ms}) if ms else ""
        return Choice(entry["degree"], f"measured earlier on this device ({shown}), {path}")
    best = min(fitting, key=lambda d: model_ms[d])
    close = [d for d in fitting if model_ms[d] <= model_ms[best] * (1 + MARGIN)]
    if len(close) == 1:
        others = ", ".join(f"{d} {model_ms[d]:.1f} ms" for d in fitting if d != best)
        return Choice(best, f"the cost model's pick ({model_ms[best]:.1f} ms; {others})")
    if measure is None:
        return Choice(best, f"the model's best of {close} until measured on the GPU")
    measured = {d: measure(d) for d in close}
    pick = min(close, key=lambda d: measured[d])
    _remember(path, key, {"degree": pick, "measured": {str(d): t for d, t in measured.items()}})
    return Choice(
        pick,
        f"measured at the first step, the model within {MARGIN:.0%} could not separate them "
        f"({_numbers(measured, model_ms)})",
    )
