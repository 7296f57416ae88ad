"""Checkpoints: write atomically, verify on load, fall back past damaged ones.

A checkpoint of step N is a folder ``step-N/`` under a location (a local
folder or an fsspec URL such as ``s3://bucket/prefix``) holding::

    params.safetensors      the parameters, by their path names
    optimizer.safetensors   the optimizer's moments, "<moment>/<param>"
    state.json              step, optimizer scalars, loader position, RNG,
                            experiment hash, device and node counts
    manifest.json           sha256 of each file above; written last

Nothing is pickled. Locally the files are written into a temporary folder,
each fsynced, and the folder renamed into place; on an object store, where
each object appears whole, the manifest is the last object written. A folder
without a manifest, or whose checksums differ, is incomplete: ``latest``
skips it (with a warning the run loop also records as an annotation) and
takes the newest complete one before it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sexpgpu.errors import SexpgpuError

__all__ = [
    "Checkpoint",
    "Location",
    "experiment_hashes",
    "load_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT = 1
_STEP = re.compile(r"^step-(\d+)$")
_FILES = ("params.safetensors", "optimizer.safetensors", "state.json")


@dataclass
class Checkpoint:
    """What a checkpoint holds: tensors for safetensors, the rest JSON-able."""

    step: int
    params: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    state: dict[str, Any]
    where: str = ""
    skipped: list[str] = field(default_factory=list)  # damaged newer checkpoints passed over


def _is_url(text: str) -> bool:
    return "://" in text and not text.startswith("file://")


class Location:
    """A folder of ``step-N/`` checkpoints, local or behind fsspec.

    Parameters
    ----------
    where
        A local path or a URL (``s3://bucket/prefix``).
    storage_options
        Passed to fsspec (e.g. ``{"client_kwargs": {"endpoint_url": ...}}``);
        by default s3fs reads the usual ``AWS_*`` variables, including
        ``AWS_ENDPOINT_URL`` for an S3-compatible server.
    """

    def __init__(self, where: str | Path, storage_options: Mapping[str, Any] | None = None):
        self.where = str(where).rstrip("/")
        self.remote = _is_url(self.where)
        self.fs: Any = None
        if self.remote:
            self.fs, self.root = _filesystem(self.where, storage_options or {})
        else:
            self.root = self.where.removeprefix("file://")

    def __str__(self) -> str:
        return self.where

    def _join(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def steps(self) -> list[int]:
        """The steps that have a folder here, newest first (complete or not)."""
        try:
            if self.remote:
                self.fs.invalidate_cache(self.root)  # another process may have written here
                names = [n.rstrip("/").rsplit("/", 1)[-1] for n in self.fs.ls(self.root)]
            else:
                names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except Exception as err:
            raise self._unusable(err) from None
        return sorted((int(m[1]) for n in names if (m := _STEP.match(n))), reverse=True)

    def read(self, step: int, name: str) -> bytes:
        path = self._join(f"step-{step}", name)
        if self.remote:
            try:
                with self.fs.open(path, "rb") as f:
                    return f.read()
            except OSError:
                raise  # a missing or cut-off file: the caller calls the checkpoint damaged
            except Exception as err:
                raise self._unusable(err) from None
        return Path(path).read_bytes()

    def write(self, step: int, files: Mapping[str, bytes]) -> str:
        """Write the files of one step, `files` last-written-last; return the folder."""
        final = self._join(f"step-{step}")
        try:
            if self.remote:
                self._write_remote(final, files)
            else:
                self._write_local(final, files)
        except Exception as err:
            raise self._unusable(err) from None
        return final

    def _unusable(self, err: Exception) -> Exception:
        # fsspec's backends raise their own errors (botocore's NoCredentialsError, say):
        # any failure there is the location's; locally only an OSError is.
        if self.remote or isinstance(err, OSError):
            return _unusable(self.where, err, self.remote)
        return err

    def _write_remote(self, final: str, files: Mapping[str, bytes]) -> None:
        if self.fs.exists(final):  # a stale folder of this step: retire its manifest first
            self.fs.rm(final, recursive=True)
        for name, blob in files.items():
            with self.fs.open(f"{final}/{name}", "wb") as f:
                f.write(blob)

    def _write_local(self, final: str, files: Mapping[str, bytes]) -> None:
        os.makedirs(self.root, exist_ok=True)
        tmp = self._join(f".tmp-{uuid.uuid4().hex}")
        os.makedirs(tmp)
        try:
            for name, blob in files.items():
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
            _fsync_dir(tmp)
        except BaseException:
            # A full disk or a Ctrl-C mid-write: leave no half folder taking up the space.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if os.path.exists(final):  # left by a run that died after writing it
            old = self._join(f".old-{uuid.uuid4().hex}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)


def _filesystem(url: str, options: Mapping[str, Any]) -> tuple[Any, str]:
    try:
        import fsspec

        return fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as err:
        raise SexpgpuError(
            "E-CKPT-004",
            f"checkpoint location {url} cannot be opened: {err}",
            url,
            hint="s3:// needs `pip install 'sexpgpu[s3]'`; other schemes need their fsspec package",
        ) from None


def _unusable(where: str, err: Exception, remote: bool = True) -> SexpgpuError:
    if not remote and getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        hint = "the disk is full: free space there, or point :checkpoint at a larger disk"
    elif not remote:
        hint = "check that the folder exists or can be made, and that you may write there"
    else:
        hint = "check the bucket, its permissions, and the endpoint variables"
    return SexpgpuError(
        "E-CKPT-004", f"checkpoint location {where} cannot be used: {err}", where, hint=hint
    )


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def save_checkpoint(location: Location, ckpt: Checkpoint) -> str:
    """Write `ckpt` as ``step-N/`` under `location`, atomically; return its folder."""
    from safetensors.numpy import save

    files = {
        "params.safetensors": save({k: np.ascontiguousarray(v) for k, v in ckpt.params.items()}),
        "optimizer.safetensors": save(
            {k: np.ascontiguousarray(v) for k, v in ckpt.optimizer.items()}
        ),
        "state.json": json.dumps({**ckpt.state, "step": ckpt.step}, indent=1).encode(),
    }
    manifest = {
        "format": FORMAT,
        "step": ckpt.step,
        "files": {n: _sha256(b) for n, b in files.items()},
    }
    files["manifest.json"] = json.dumps(manifest, indent=1).encode()
    where = location.write(ckpt.step, files)
    log.info("checkpoint: wrote %s", where)
    return where


def _damaged(where: str, problem: str) -> SexpgpuError:
    return SexpgpuError(
        "E-CKPT-002",
        f"checkpoint {where} is damaged: {problem}",
        where,
        hint="it was altered or cut off; resume from an earlier checkpoint",
    )


# Keys of state.json that the run loop reads, and the JSON types they must have.
_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "experiment_hash": str,
    "devices": int,
    "nodes": int,
    "optimizer": dict,
    "loaders": list,
}
Shapes = Mapping[str, tuple[int, ...]]


def _read_verified(
    location: Location, step: int, expect: Shapes | None = None, complete: bool = False
) -> Checkpoint:
    """Read and check one step; raise E-CKPT-002 on anything missing, altered or malformed.

    The checksums only show that the files are the ones the manifest names;
    their contents are checked too (a state or safetensors file edited and
    the manifest rewritten to match), and against `expect` (parameter name ->
    shape) when given.
    """
    where = f"{location.where}/step-{step}"
    try:
        manifest = json.loads(location.read(step, "manifest.json"))
        if not isinstance(manifest, dict):
            raise ValueError("manifest.json is not a JSON object")
        blobs = {n: location.read(step, n) for n in _FILES}
    except (OSError, ValueError) as err:
        raise SexpgpuError(
            "E-CKPT-002",
            f"checkpoint {where} is incomplete: {err}",
            where,
            hint="it was perhaps cut off while being written; resume from an earlier one",
        ) from None
    sums = manifest.get("files")
    if not isinstance(sums, dict):
        raise _damaged(where, f"manifest.json's `files` is {json.dumps(sums)}, not an object")
    for name, blob in blobs.items():
        if sums.get(name) != _sha256(blob):
            raise SexpgpuError(
                "E-CKPT-002",
                f"checkpoint {where}: {name} does not match the checksum in its manifest",
                where,
                hint="the file was altered or damaged; resume from an earlier checkpoint",
            )
    state = _state(blobs["state.json"], step, where, complete)
    params = _tensors(blobs["params.safetensors"], "params.safetensors", where)
    optimizer = _tensors(blobs["optimizer.safetensors"], "optimizer.safetensors", where)
    _check_shapes(params, optimizer, expect, where)
    return Checkpoint(step=step, params=params, optimizer=optimizer, state=state, where=where)


def _state(blob: bytes, step: int, where: str, complete: bool) -> dict[str, Any]:
    """state.json, checked: an object of the folder's step whose keys have their types.

    With `complete` (a run resuming, which knows its model) every key a resume
    reads must be there.
    """
    try:
        state = json.loads(blob)
    except ValueError as err:
        raise _damaged(where, f"state.json is not JSON ({err})") from None
    if not isinstance(state, dict):
        raise _damaged(where, "state.json is not a JSON object")
    if type(state.get("step")) is not int or state["step"] != step:
        raise _damaged(where, f"state.json's step is {json.dumps(state.get('step'))}, not {step}")
    missing = [key for key in _STATE_TYPES if key not in state] if complete else []
    if missing:
        raise _damaged(where, f"state.json has no `{missing[0]}`")
    for key, kind in _STATE_TYPES.items():
        if key in state and (not isinstance(state[key], kind) or isinstance(state[key], bool)):
            raise _damaged(where, f"state.json's `{key}` is {json.dumps(state[key])[:60]}")
    for loader in state.get("loaders", []):
        if not isinstance(loader, dict) or not all(
            type(loader.get(k)) is int for k in ("position", "rank", "ranks")
        ):
            raise _damaged(where, f"state.json's loader {json.dumps(loader)[:60]} is malformed")
    return state


def _tensors(blob: bytes, name: str, where: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    try:
        return dict(load(blob))
    except Exception as err:  # safetensors raises its own SafetensorError, among others
        raise _damaged(where, f"{name} does not read as safetensors ({err})") from None


def _check_shapes(
    params: Mapping[str, np.ndarray],
    optimizer: Mapping[str, np.ndarray],
    expect: Shapes | None,
    where: str,
) -> None:
    """Moments ("<moment>/<param>") fit their parameters; parameters fit `expect`."""
    for key, moment in optimizer.items():
        of = key.split("/", 1)[-1]
        if of in params and moment.shape != params[of].shape:
            shapes = f"{list(moment.shape)}, its parameter {list(params[of].shape)}"
            raise _damaged(where, f"moment {key} is {shapes}")
    if expect is None:
        return
    missing = [n for n in expect if n not in params]
    if missing:
        raise _damaged(where, f"parameter {missing[0]} is missing ({len(missing)} in all)")
    for name, shape in expect.items():
        if tuple(params[name].shape) != tuple(shape):
            shapes = f"{list(params[name].shape)}, the model's {list(shape)}"
            raise _damaged(where, f"parameter {name} is {shapes}")
    extra = [n for n in params if n not in expect]
    if extra:
        raise _damaged(where, f"parameter {extra[0]} is not in the model")


def load_checkpoint(
    where: str | Path,
    storage_options: Mapping[str, Any] | None = None,
    *,
    experiment_hash: str | None = None,
    max_step: int | None = None,
    expect: Shapes | None = None,
    complete: bool = False,
) -> Checkpoint:
    """Load a checkpoint: a ``step-N`` folder, or the newest complete one of a location.

    A damaged or incomplete ``step-N`` named directly is an error
    (E-CKPT-002); in a location, damaged ones are skipped with a warning and
    listed in `Checkpoint.skipped`. No complete checkpoint is E-CKPT-001.

    Parameters
    ----------
    where
        A ``step-N`` folder, or a location holding them.
    storage_options
        Passed to fsspec for remote locations.
    experiment_hash
        In a location, take only checkpoints of this experiment: others (a
        run folder shared by two experiments) are passed over with a note.
        None takes any (the caller compares the hash, E-CKPT-003).
    max_step
        In a location, take only checkpoints at or below this step (an older,
        longer run's later ones are passed over). None takes any.
    expect
        Parameter name -> shape of the model: a checkpoint whose parameters
        are missing, extra or of another shape is damaged (skipped in a
        location, E-CKPT-002 when named directly).
    complete
        A state without every key a resume reads (devices, nodes, optimizer,
        loaders) is damaged too.
    """
    text = str(where).rstrip("/")
    parent, _, leaf = text.rpartition("/")
    if (m := _STEP.match(leaf)) and parent:
        return _read_verified(Location(parent, storage_options), int(m[1]), expect, complete)
    location = Location(text, storage_options)
    skipped: list[str] = []
    passed: list[str] = []  # sound checkpoints that are not this run's
    for step in location.steps():
        if max_step is not None and step > max_step:
            passed.append(f"step-{step} is past step {max_step}")
            continue
        try:
            ckpt = _read_verified(location, step, expect, complete)
        except SexpgpuError as err:
            log.warning("checkpoint: skipping %s/step-%d: %s", text, step, err.message)
            skipped.append(err.message)
            continue
        other = ckpt.state.get("experiment_hash")
        if experiment_hash is not None and other != experiment_hash:
            log.info("checkpoint: passing over %s: experiment %s", ckpt.where, str(other)[:12])
            passed.append(f"step-{step} is of experiment {str(other)[:12]}")
            continue
        ckpt.skipped = skipped
        return ckpt
    others = f" of this run ({'; '.join(passed[:3])}{'...' if len(passed) > 3 else ''})"
    raise SexpgpuError(
        "E-CKPT-001",
        f"no complete checkpoint in {text}" + (others if passed else ""),
        text,
        hint="run without --resume to start afresh, or name a checkpoint folder step-N",
    )


def experiment_hashes(location: Location) -> set[str]:
    """The experiment hashes of the checkpoints in `location` (read from each state.json).

    A folder whose state cannot be read adds nothing: it is damaged, and
    `load_checkpoint` skips it anyway.
    """
    hashes = set()
    for step in location.steps():
        try:
            state = json.loads(location.read(step, "state.json"))
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and isinstance(state.get("experiment_hash"), str):
            hashes.add(state["experiment_hash"])
    return hashes
