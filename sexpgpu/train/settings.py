"""A run's settings as plain values, and the experiment hash checkpoints carry."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang.definitions import OptimizerSpec, ScheduleSpec
from sexpgpu.lang.runs import RUN_KEYS
from sexpgpu.lang.syntax import Keyword, ListNode, Literal, Symbol, Vector, unparse

__all__ = [
    "RunSettings",
    "changed_sets",
    "experiment_hash",
    "experiment_identity",
    "first_difference",
    "identity_hash",
    "microbatches_per_rank",
]


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
    """sha256 of the run's `experiment_identity`: what checkpoints and ``run.json`` carry.

    ``--steps`` is not part of it, so a run can be extended by resuming with a
    larger ``--steps``; a changed setting (``--set`` among them) makes another
    experiment, a comment or another variant does not.
    """
    return identity_hash(experiment_identity(experiment, run_name))


def identity_hash(identity: Mapping[str, str]) -> str:
    """sha256 of an `experiment_identity`."""
    blob = json.dumps(sorted(identity.items()))
    return hashlib.sha256(blob.encode()).hexdigest()


def experiment_identity(experiment: Any, run_name: str) -> dict[str, str]:
    """What makes a run the same experiment: every resolved setting, by name, as text.

    The parameters after the variant and ``--set``, the run's data, functions,
    models and every setting of the run except its steps (a run is extended
    with ``--steps``). Comments, layout, the order of forms and variants the
    run does not use leave it unchanged; any changed setting changes it, and
    `first_difference` names the first that differs.
    """
    identity = {f"parameter {k}": _text(v) for k, v in experiment.params.items()}
    run = experiment.runs[run_name]
    data = experiment.data[run.data]
    path = None if data.path is None else str(Path(data.path).resolve())
    identity[f"data {data.name}"] = _text([data.kind, path, dict(data.options)])
    for fn in experiment.functions.values():
        identity[f"defn {fn.name}"] = _text([[a.name for a in fn.args], unparse(fn.body)])
    for model in experiment.models.values():
        identity[f"model {model.name}"] = _text(
            [[a.name for a in model.inputs], unparse(model.body)]
        )
    for name in (f.name for f in fields(run)):
        if name not in ("span", "steps"):
            identity[f"run {run_name} :{name}"] = _text(getattr(run, name))
    return identity


def first_difference(ours: Mapping[str, str], theirs: Mapping[str, str]) -> str | None:
    """The first setting (in `ours`' order, then `theirs`') whose text differs; None if none."""
    for key in [*ours, *(k for k in theirs if k not in ours)]:
        if ours.get(key) != theirs.get(key):
            return key
    return None


def _text(value: Any) -> str:
    """A setting as canonical text: syntax unparsed, dataclasses by field, spans left out."""
    return json.dumps(_plain(value), sort_keys=True)


def _plain(value: Any) -> Any:
    if isinstance(value, Symbol | Keyword | Literal | ListNode | Vector):
        return unparse(value)
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value) if f.name != "span"}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


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
