"""A trained model: an experiment with the parameters of one of its checkpoints.

What ``sample``, ``eval`` and ``export`` start from. ``--resume latest|PATH``
names the checkpoint as for a resumed run (`sexpgpu.train.resume`): the
newest of this experiment in the run folder (``--out``, else the newest
``runs/RUN-NAME[-N]`` this experiment's run claimed), or a ``step-N`` folder.
Either must have been written by the same resolved experiment (file,
variant, ``--set`` values and run): E-CKPT-003 otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sexpgpu.train.checkpoint import Checkpoint, load_checkpoint
from sexpgpu.train.resume import check_identity, find_resume, run_folder
from sexpgpu.train.settings import RunSettings, experiment_identity, identity_hash

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
    folder
        The run folder ``--resume latest`` looked in.
    """

    experiment: Any
    run: Any
    compiled: Any
    settings: RunSettings
    checkpoint: Checkpoint
    folder: Path

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
        The run folder ``latest`` looks in (default: the newest
        ``runs/RUN-NAME[-N]`` this experiment's run claimed).
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
    identity = experiment_identity(experiment, rundef.name)
    mine = identity_hash(identity)
    shapes = {key: info.shape for key, info in compiled.params.items()}
    folder = run_folder(out, rundef.name, resume, mine)

    def load(where: str, **filters: Any) -> Checkpoint:
        return load_checkpoint(where, storage_options, expect=shapes, complete=True, **filters)

    ckpt = find_resume(resume, checkpoint_folder(folder, settings), folder, mine, load)
    check_identity(ckpt, mine, identity, experiment.sets)
    return Trained(experiment, rundef, compiled, settings, ckpt, folder)
