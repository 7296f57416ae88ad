"""Who a run folder belongs to: ``run.json``, claimed before a run writes anything.

A run folder (``runs/RUN-NAME`` or ``--out``) holds one experiment's run:
its ``metrics.jsonl``, ``status.json`` and (by default) its checkpoints. Two
experiments with the same run name would otherwise share one folder, and a
resume would continue from the other's checkpoint and join the two metrics
files. `claim_run_folder` writes ``run.json`` (the experiment hash and run
name) on a fresh start and checks it on every later start:

=====================================  =========================================
the folder holds                       outcome
=====================================  =========================================
nothing                                claimed, fresh
this experiment's run.json, resume     continue (the loader then takes only
                                       this experiment's checkpoints)
this experiment's run.json, fresh,     start anew, said in `RunClaim.note`
no checkpoints                         (the old records are superseded)
this experiment's checkpoints, fresh   E-CKPT-005: resume it or clear them
another experiment's or run's          E-CKPT-005, naming both
records (run.json or checkpoints)
records without run.json (older        adopted when no checkpoint says
sexpgpu), none of another experiment   otherwise, said in the note
=====================================  =========================================

A run branched from another run's checkpoint (``--out NEW --resume PATH``)
records its parent in ``run.json``: the parent's folder, the checkpoint and
its step. Nothing is copied; `sexpgpu.train.metrics.read_series` reads the
parent's records up to that step before the branch's own.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.files import replace_whole

__all__ = [
    "RECORD",
    "RunClaim",
    "claim_run_folder",
    "claimed_folder",
    "free_run_folder",
    "read_parent",
]

RECORD = "run.json"
_FORMAT = 1
_RECORDS = ("metrics.jsonl", "status.json")


@dataclass(frozen=True)
class RunClaim:
    """The outcome of `claim_run_folder`.

    Attributes
    ----------
    folder
        The run folder.
    fresh
        True when the run starts from step 0 (nothing to resume).
    note
        A sentence to log and annotate when earlier records are replaced or
        adopted; None when there is nothing to say.
    """

    folder: Path
    fresh: bool
    note: str | None = None


def free_run_folder(base: Path) -> Path:
    """`base`, or the first of ``base-2``, ``base-3``... that holds no run's records.

    The default run folder (``runs/RUN-NAME``) of a fresh run: running the same
    command twice gives two runs side by side, never one on top of the other.
    """
    candidate, n = base, 1
    while any((candidate / name).exists() for name in (RECORD, *_RECORDS, "checkpoints")):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def claimed_folder(base: Path, experiment_hash: str, run_name: str) -> Path | None:
    """The newest of `base`, ``base-2``, ``base-3``... claimed by this experiment's run.

    What ``--resume latest`` without ``--out`` continues: `free_run_folder`
    may have given the run ``runs/train-3`` because ``runs/train`` held
    another experiment. None when no folder is this run's.
    """
    pattern = re.compile(re.escape(base.name) + r"(-[0-9]+)?")
    found = []
    if base.parent.is_dir():
        for folder in base.parent.iterdir():
            if not pattern.fullmatch(folder.name) or not (folder / RECORD).is_file():
                continue
            try:
                record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError):
                continue  # not this run's to judge here; claiming it says what is wrong
            mine = isinstance(record, dict) and record.get("experiment_hash") == experiment_hash
            if mine and record.get("run") == run_name:
                created = record.get("created")
                when = (
                    created
                    if isinstance(created, int | float)
                    else (folder / RECORD).stat().st_mtime
                )
                found.append((when, folder.name, folder))
    return max(found)[2] if found else None


def read_parent(folder: Path) -> dict[str, Any] | None:
    """What a branched run started from (its ``run.json``): ``folder``, ``checkpoint``, ``step``.

    ``folder`` is the parent's run folder, or None when the checkpoint lies in
    no run folder (a bucket, say). None for a run that is no branch.
    """
    try:
        record = json.loads((Path(folder) / RECORD).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    parent = record.get("parent") if isinstance(record, dict) else None
    if not isinstance(parent, dict) or not isinstance(parent.get("checkpoint"), str):
        return None
    if type(parent.get("step")) is not int or not isinstance(parent.get("folder"), str | None):
        return None
    return parent


def _owner_error(folder: Path, what: str, hint: str) -> SexpgpuError:
    return SexpgpuError("E-CKPT-005", f"run folder {folder} {what}", str(folder), hint)


def claim_run_folder(
    folder: str | os.PathLike[str],
    experiment_hash: str,
    run_name: str,
    *,
    resume: bool,
    checkpoint_hashes: Iterable[str] = (),
    record: Mapping[str, Any] | None = None,
) -> RunClaim:
    """Claim `folder` for the run `run_name` of the experiment `experiment_hash`.

    Parameters
    ----------
    folder
        The run folder (created when missing).
    experiment_hash, run_name
        Whose run this is.
    resume
        Whether the run resumes (``--resume``) rather than starts fresh.
    checkpoint_hashes
        The experiment hashes of the checkpoints already in the run's
        checkpoint location (empty when it has none or none is set).
    record
        More of the run to write into a new ``run.json``: its ``--set``
        values, and a branch's parent (the folder, checkpoint and step it
        resumed from).

    Returns
    -------
    RunClaim

    Raises
    ------
    SexpgpuError
        E-CKPT-005 when the folder holds another experiment's or run's
        records, or a fresh run would start over this experiment's
        checkpoints; E-CLI-001 when the folder cannot be written.
    """
    path = Path(folder)
    owner = _read_owner(path)
    hashes = set(checkpoint_hashes)
    mine = {"experiment_hash": experiment_hash, "run": run_name}
    if owner is not None and owner != mine:
        raise _owner_error(
            path,
            f"belongs to run `{owner['run']}` of experiment {owner['experiment_hash'][:12]}; "
            f"this is run `{run_name}` of experiment {experiment_hash[:12]}",
            "give this run its own folder with --out, or remove the old one",
        )
    strangers = sorted(h[:12] for h in hashes - {experiment_hash})
    if strangers:
        raise _owner_error(
            path,
            f"holds checkpoints of experiment {', '.join(strangers)}; "
            f"this is {experiment_hash[:12]}",
            "give this run its own folder with --out, or remove the old checkpoints",
        )
    if not resume and hashes:
        raise _owner_error(
            path,
            "already holds checkpoints of this experiment; a fresh run would mix with them",
            "continue it with --resume latest, or remove its checkpoints to start anew",
        )
    note = None
    old = [name for name in _RECORDS if (path / name).exists()]
    if owner is None and old:
        note = f"run folder {path}: adopting records written without {RECORD}"
    if not resume and old:
        note = (
            f"run folder {path}: starting anew; the earlier records are kept apart "
            "in metrics.superseded.jsonl"
        )
    if owner is None:
        _write_owner(path, {**mine, "created": time.time(), **(record or {})})
    return RunClaim(path, fresh=not resume, note=note)


def _read_owner(path: Path) -> dict[str, str] | None:
    record = path / RECORD
    if not record.exists():
        return None
    try:
        owner = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise _owner_error(
            path, f"has an unreadable {RECORD} ({err})", f"remove {record}"
        ) from None
    if not (
        isinstance(owner, dict)
        and isinstance(owner.get("experiment_hash"), str)
        and isinstance(owner.get("run"), str)
    ):
        raise _owner_error(path, f"has a malformed {RECORD}", f"remove {record}")
    return {"experiment_hash": owner["experiment_hash"], "run": owner["run"]}


def _write_owner(path: Path, owner: Mapping[str, Any]) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        replace_whole(path / RECORD, json.dumps({"format": _FORMAT, **owner}, indent=1) + "\n")
    except OSError as err:
        raise SexpgpuError(
            "E-CLI-001",
            f"cannot use {path} as the run directory: {err.strerror or err}",
            str(path),
            hint="point --out at a new or existing folder you can write to",
        ) from None
