"""What ``--resume latest|PATH`` names: one answer for ``run``, ``sample``, ``eval`` and ``export``.

``latest`` looks in the run folder: ``--out``, else the newest of
``runs/RUN-NAME``, ``runs/RUN-NAME-2``... that this experiment's run claimed
(a fresh run is given ``runs/RUN-NAME-N`` when ``runs/RUN-NAME`` holds another
run). There it takes the newest sound checkpoint of this experiment; a
branched run with none of its own yet takes its parent's. A PATH is a
``step-N`` folder or checkpoint location that must exist. Either must have been
written by the same experiment: E-CKPT-003, naming the first setting that
differs, otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.train.checkpoint import Checkpoint
from sexpgpu.train.run_folder import claimed_folder, free_run_folder, read_parent
from sexpgpu.train.settings import changed_sets, first_difference

__all__ = ["check_identity", "claimed_note", "find_resume", "run_folder"]

Load = Callable[..., Checkpoint]  # (where, **filters of load_checkpoint) -> a checkpoint


def run_folder(out: str | Path | None, name: str, resume: str | None, experiment_hash: str) -> Path:
    """``--out``, else ``runs/RUN-NAME`` or ``runs/RUN-NAME-N``.

    A fresh run takes the first free one; a resume the newest this
    experiment's run claimed (a fresh run may have been given ``runs/train-3``).
    """
    if out is not None:
        if not str(out).strip():
            raise SexpgpuError(
                "E-CLI-001",
                "--out is empty",
                "--out",
                hint="name the run directory, e.g. --out runs/try-1 (or leave --out out)",
            )
        return Path(out)
    base = Path("runs") / name
    if resume is None:
        return free_run_folder(base)
    return claimed_folder(base, experiment_hash, name) or base


def claimed_note(folder: Path, name: str, out: object, resume: object) -> str | None:
    """The line saying which folder ``--resume`` without ``--out`` took, when not ``runs/NAME``."""
    if out is None and resume is not None and folder.name != name:
        return f"run folder: {folder} (the newest this experiment's run claimed)"
    return None


def find_resume(
    resume: str, where: str | None, folder: Path, experiment_hash: str, load: Load
) -> Checkpoint:
    """The checkpoint `resume` names, its identity not yet checked (`check_identity`).

    `where` is the run's checkpoint location (None without ``:checkpoint``),
    `folder` its run folder, `load` reads a checkpoint that fits the model.
    When this experiment has no checkpoint in `where`, the newest of any is
    returned, so that `check_identity` says whose it is.
    """
    if resume != "latest":
        if "://" not in resume and not Path(resume).exists():
            raise SexpgpuError(
                "E-CKPT-001",
                f"--resume {resume}: no such checkpoint folder or location",
                "--resume",
                hint="name an existing step-N folder or checkpoint location, or give "
                "--resume latest to continue the run's own",
            )
        return load(resume)
    if where is None:
        raise SexpgpuError(
            "E-CKPT-001",
            "--resume latest, but the run has no :checkpoint location",
            "--resume",
            hint='add :checkpoint (every N "checkpoints") or name a folder: --resume PATH',
        )
    try:
        newest = load(where)
    except SexpgpuError as err:
        parent = read_parent(folder) if err.code == "E-CKPT-001" else None
        if parent is None:
            raise
        return load(parent["checkpoint"])
    if newest.state.get("experiment_hash") == experiment_hash:
        return newest
    try:
        return load(where, experiment_hash=experiment_hash)
    except SexpgpuError as err:
        if err.code != "E-CKPT-001":
            raise
        return newest


def check_identity(
    ckpt: Checkpoint,
    experiment_hash: str,
    identity: Mapping[str, str],
    sets: Mapping[str, Any],
) -> None:
    """E-CKPT-003 when the checkpoint is of another experiment, naming the first setting."""
    state = ckpt.state
    if state.get("experiment_hash") == experiment_hash:
        return
    theirs = state.get("experiment")
    known = isinstance(theirs, dict) and identity
    key = first_difference(identity, theirs) if known else None
    if key is not None:
        what = (
            f"`{key}` differs: {_shown(theirs.get(key))} in the checkpoint, "
            f"{_shown(identity.get(key))} here"
        )
    else:
        what = (
            f"it was written by experiment {str(state.get('experiment_hash'))[:12]}, "
            f"this is {experiment_hash[:12]}"
        )
    raise SexpgpuError(
        "E-CKPT-003",
        f"checkpoint {ckpt.where} is of another experiment: {what}",
        ckpt.where,
        hint=changed_sets(state.get("sets"), sets)
        or "resume with the same settings (comments, layout and other variants do not "
        "matter); change only --steps to extend a run, or start a new run with --out",
    )


def _shown(text: str | None) -> str:
    return "nothing" if text is None else (text if len(text) <= 60 else text[:57] + "...")
