"""A run's settings as plain values, and the experiment hash checkpoints carry."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang.definitions import OptimizerSpec, ScheduleSpec
from sexpgpu.lang.runs import RUN_KEYS

__all__ = ["RunSettings", "changed_sets", "experiment_hash", "microbatches_per_rank"]


@dataclass(frozen=True)
class RunSettings:
    """What the run loop needs of a `RunDef`, with ``--steps`` applied.

    `optimizer` and `schedule` are the language's `OptimizerSpec` and
    `ScheduleSpec` (every option filled in: `sexpgpu.lang.runs.optimizer_spec`
    makes one in Python); `diagnostics` its `DiagnosticSpec` tuple.
    """

    steps: int
    batch: int
    microbatches: int
    seed: int
    optimizer: OptimizerSpec
    schedule: ScheduleSpec = RUN_KEYS["schedule"].default
    clip: float | None = None
    eval_every: int = 0
    eval_batches: int = 0
    checkpoint_every: int = 0
    checkpoint_location: str | None = None
    diagnostics: tuple[Any, ...] = ()
    log: tuple[str, ...] = ()  # loggers mirroring the metrics (`sexpgpu.train.loggers`)

    @classmethod
    def from_run(cls, run: Any, steps: int | None = None) -> RunSettings:
        """The settings of `run` (a `RunDef`); `steps` overrides ``:steps``."""
        return cls(
            steps=run.steps if steps is None else steps,
            batch=run.batch,
            microbatches=run.microbatches,
            seed=run.seed,
            optimizer=run.optimizer,
            schedule=run.schedule,
            clip=run.clip,
            eval_every=run.eval.every if run.eval else 0,
            eval_batches=run.eval.batches if run.eval else 0,
            checkpoint_every=run.checkpoint.every if run.checkpoint else 0,
            checkpoint_location=run.checkpoint.location if run.checkpoint else None,
            diagnostics=tuple(run.diagnostics),
            log=tuple(run.log),
        )


def microbatches_per_rank(microbatches: int, ranks: int) -> int:
    """A step's microbatches on each of `ranks` ranks (E-DP-003 where they do not divide).

    The one place this is computed: the plan, the report and the loaders all take it.
    """
    if microbatches % ranks:
        raise SexpgpuError(
            "E-DP-003",
            f"{microbatches} microbatches do not divide over {ranks} ranks",
            "SEXPGPU_DEVICES",
            hint="choose :microbatches a multiple of the rank count (devices per node times "
            "nodes), or fewer devices",
        )
    return microbatches // ranks


def experiment_hash(experiment: Any, run_name: str) -> str:
    """sha256 of the experiment's text, its variant, its ``--set`` values and the run's name.

    ``--steps`` is not part of it, so a run can be extended by resuming with a
    larger ``--steps``; any edit of the file, or another ``--set``, makes
    another experiment.
    """
    source = getattr(experiment, "source", None)
    text = getattr(source, "text", source)
    if not isinstance(text, str):
        text = Path(experiment.path).read_text(encoding="utf-8")
    parts: list[Any] = [text, getattr(experiment, "variant", None), run_name]
    sets = dict(getattr(experiment, "sets", {}) or {})
    if sets:  # runs without --set keep the hash they always had
        parts.append(sorted(sets.items()))
    blob = json.dumps(parts)
    return hashlib.sha256(blob.encode()).hexdigest()


def changed_sets(then: Any, now: Mapping[str, Any]) -> str | None:
    """A hint naming the ``--set`` values that differ from a checkpoint's, when any do."""
    then = then if isinstance(then, dict) else {}
    names = sorted(k for k in {*then, *now} if then.get(k) != now.get(k))
    if not names:
        return None

    def show(sets: Mapping[str, Any], name: str) -> str:
        return f"--set {name}={json.dumps(sets[name])}" if name in sets else f"no --set {name}"

    changes = "; ".join(f"{show(now, n)} here, {show(then, n)} in the checkpoint" for n in names)
    return f"a changed experiment: {changes}; give the checkpoint's values"
