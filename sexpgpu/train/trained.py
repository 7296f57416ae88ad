"""A trained model: an experiment with the parameters of one of its checkpoints.

What ``sample``, ``eval`` and ``export`` start from. ``--resume latest`` is
the newest complete checkpoint of this experiment in the run folder
(``--out``, default ``runs/RUN-NAME``), as a resumed run takes it; a PATH is a
``step-N`` folder. Either must have been written by the same resolved
experiment (file, variant, ``--set`` values and run): E-CKPT-003 otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sexpgpu.errors import SexpgpuError
from sexpgpu.train.checkpoint import Checkpoint, load_checkpoint
from sexpgpu.train.settings import RunSettings, changed_sets, experiment_hash

__all__ = ["Trained", "checkpoint_folder", "load_trained"]


@dataclass(frozen=True)
class Trained:
    """An experiment's run and the checkpoint whose parameters it uses.

    Attributes
    ----------
    experiment, run
        The loaded experiment (variant and ``--set`` applied) and its `RunDef`.
    compiled
        The run compiled (`sexpgpu.ir.compile.CompiledRun`).
    settings
        The run's settings.
    checkpoint
        The checkpoint loaded (parameters float32 on the host).
    """

    experiment: Any
    run: Any
    compiled: Any
    settings: RunSettings
    checkpoint: Checkpoint

    @property
    def params(self) -> dict[str, np.ndarray]:
        """Parameter name -> float32 array."""
        return self.checkpoint.params


def checkpoint_folder(run_dir: Path, settings: RunSettings) -> str | None:
    """Where a run folder's checkpoints lie (``:checkpoint``'s location), or None."""
    where = settings.checkpoint_location
    if where is None:
        return None
    if "://" not in where and not Path(where).is_absolute():
        where = str(run_dir / where)
    return where


def load_trained(
    path: str | Path,
    *,
    resume: str,
    variant: str | None = None,
    sets: Sequence[str] = (),
    run: str | None = None,
    out: str | Path | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Trained:
    """Load the experiment at `path` and the parameters `resume` names.

    Parameters
    ----------
    path
        The experiment file.
    resume
        ``"latest"`` or a ``step-N`` checkpoint folder.
    variant, sets, run
        ``--variant``, ``--set`` and ``--run``, as the run was trained.
    out
        The run folder ``latest`` looks in (default ``runs/RUN-NAME``).
    storage_options
        fsspec options for remote checkpoint locations.

    Raises
    ------
    SexpgpuError
        E-CKPT-001 when there is no checkpoint, E-CKPT-002 when it is
        damaged or of another model, E-CKPT-003 when another experiment
        wrote it.
    """
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment

    experiment = load_experiment(path, variant, sets)
    rundef = experiment.run(run)
    settings = RunSettings.from_run(rundef)
    compiled = compile_run(experiment, rundef)
    mine = experiment_hash(experiment, rundef.name)
    shapes = {key: info.shape for key, info in compiled.params.items()}
    if resume == "latest":
        run_dir = Path(out) if out is not None else Path("runs") / rundef.name
        where = checkpoint_folder(run_dir, settings)
        if where is None:
            raise SexpgpuError(
                "E-CKPT-001",
                f"--resume latest, but run `{rundef.name}` has no :checkpoint location",
                "--resume",
                hint="name a checkpoint folder: --resume runs/NAME/checkpoints/step-N",
            )
        try:
            ckpt = load_checkpoint(
                where, storage_options, experiment_hash=mine, expect=shapes, complete=True
            )
        except SexpgpuError as err:
            if err.code != "E-CKPT-001":
                raise
            # None of this experiment's: the newest of another says what differs (E-CKPT-003).
            try:
                ckpt = load_checkpoint(where, storage_options, expect=shapes, complete=True)
            except SexpgpuError:
                raise err from None
    else:
        ckpt = load_checkpoint(resume, storage_options, expect=shapes, complete=True)
    if ckpt.state.get("experiment_hash") != mine:
        raise SexpgpuError(
            "E-CKPT-003",
            f"checkpoint {ckpt.where} was written by experiment "
            f"{str(ckpt.state.get('experiment_hash'))[:12]}, this is {mine[:12]}",
            ckpt.where,
            hint=changed_sets(ckpt.state.get("sets"), experiment.sets)
            or "give the file, --variant, --set values and --run the run was trained with",
        )
    return Trained(experiment, rundef, compiled, settings, ckpt)
