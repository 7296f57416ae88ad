"""Data files, checkpoints and run folders that lie, are damaged or belong to another run."""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from standin_program import defdata

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang import DataDef
from sexpgpu.train import data as data_module
from sexpgpu.train.checkpoint import (
    Checkpoint,
    Location,
    experiment_hashes,
    load_checkpoint,
    save_checkpoint,
)
from sexpgpu.train.data import make_loader
from sexpgpu.train.run_folder import RECORD, claim_run_folder


def _arrays(path: Path) -> DataDef:
    return defdata("d", f'(arrays "{path}" :fields [x y])')


def _error(fn) -> SexpgpuError:
    with pytest.raises(SexpgpuError) as info:
        fn()
    return info.value


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array)
    return buf.getvalue()


def test_an_npz_header_that_claims_more_than_it_holds(tmp_path) -> None:
    path = tmp_path / "lie.npz"
    x = _npy(np.zeros((4, 4), np.float32)).replace(b"(4, 4), }", b"(9999999, 4), }")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.npy", x)
        z.writestr("y.npy", _npy(np.zeros(4, np.float32)))
    err = _error(lambda: make_loader(_arrays(path), batch=2))
    assert err.code == "E-DATA-003"
    assert err.message == (
        f"data `d`: array `x.npy` of {path} claims [9999999, 4] float32 (159999984 bytes) "
        "but holds 70 bytes of data"
    )


def test_an_npz_bomb_is_refused_before_it_is_read(tmp_path, monkeypatch) -> None:
    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, x=np.zeros((1 << 20, 4), np.float32), y=np.zeros(1 << 20))
    monkeypatch.setattr(data_module, "_memory_bytes", lambda: 16 << 20)  # a 16 MiB machine
    err = _error(lambda: make_loader(_arrays(path), batch=2))
    assert err.code == "E-DATA-003"
    assert "expand to 24.0 MiB, more than half of this machine's 16.0 MiB of memory" in err.message


def test_nan_or_inf_in_float_data_is_refused_at_load(tmp_path) -> None:
    path = tmp_path / "nan.npz"
    x = np.ones((8, 3), np.float64)
    x[5, 1], x[6, 2] = np.nan, 1e300  # 1e300 is infinite in float32
    np.savez(path, x=x, y=np.zeros(8, np.int64))
    err = _error(lambda: make_loader(_arrays(path), batch=2))
    assert err.render().splitlines() == [
        f"error[E-DATA-007]: data set `d`: field x of {path} holds 2 NaN or infinite values, "
        "the first at index [5, 1] (nan)",
        f" --> {path}",
        "  = hint: clean the data (drop or fill those samples); floats beyond float32's range "
        "become infinite",
    ]


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
        (lambda p: os.symlink("/dev/zero", p), "is a device, not a regular file"),
    ],
)
def test_a_fifo_or_device_is_never_opened(tmp_path, make, said) -> None:
    path = tmp_path / "x.npz"
    make(path)
    err = _error(lambda: make_loader(_arrays(path), batch=2))
    assert (err.code, err.message) == ("E-DATA-001", f"data set `d`: {path} {said}")


def test_a_data_path_too_long_for_the_system(tmp_path) -> None:
    path = tmp_path / ("a" * 300) / "x.npz"
    err = _error(lambda: make_loader(_arrays(path), batch=2))
    assert err.code == "E-DATA-001" and err.hint == "use a shorter path"
    assert err.message.endswith("has a name longer than the system allows")


# ---------------------------------------------------------------- checkpoints


def _ckpt(step: int, experiment: str = "h", shape=(4, 3)) -> Checkpoint:
    params = {"m/w": np.full(shape, step, np.float32)}
    moments = {"exp_avg/m/w": np.zeros(shape, np.float32)}
    state = {"experiment_hash": experiment, "loaders": [{"position": step, "rank": 0, "ranks": 1}]}
    return Checkpoint(step, params, moments, state)


def _rewrite(folder: Path, name: str, blob: bytes) -> None:
    """Replace one file and fix the manifest's checksum, as a careful vandal would."""
    (folder / name).write_bytes(blob)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256(blob).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _state(folder: Path) -> dict:
    return json.loads((folder / "state.json").read_text())


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (
            lambda f: (f / "manifest.json").write_text('{"files": []}'),
            "manifest.json's `files` is [], not an object",
        ),
        (
            lambda f: (f / "manifest.json").write_text('{"files": null}'),
            "manifest.json's `files` is null, not an object",
        ),
        (
            lambda f: _rewrite(f, "state.json", json.dumps({"loaders": []}).encode()),
            "state.json's step is null, not 2",
        ),
        (
            lambda f: _rewrite(f, "state.json", json.dumps({**_state(f), "loaders": {}}).encode()),
            "state.json's `loaders` is {}",
        ),
        (
            lambda f: _rewrite(f, "params.safetensors", b"not safetensors"),
            "params.safetensors does not read as safetensors",
        ),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous(tmp_path, damage, problem):
    location = Location(tmp_path / "ck")
    save_checkpoint(location, _ckpt(1))
    save_checkpoint(location, _ckpt(2))
    damage(tmp_path / "ck" / "step-2")
    ckpt = load_checkpoint(tmp_path / "ck")
    assert ckpt.step == 1
    assert len(ckpt.skipped) == 1 and problem in ckpt.skipped[0]
    err = _error(lambda: load_checkpoint(tmp_path / "ck" / "step-2"))
    assert err.code == "E-CKPT-002" and problem in err.message


def test_missing_or_mis_shaped_parameters_are_damage(tmp_path) -> None:
    location = Location(tmp_path / "ck")
    save_checkpoint(location, _ckpt(1))
    save_checkpoint(location, _ckpt(2, shape=(4, 5)))
    assert load_checkpoint(tmp_path / "ck", expect={"m/w": (4, 3)}).step == 1
    err = _error(lambda: load_checkpoint(tmp_path / "ck" / "step-2", expect={"m/w": (4, 3)}))
    assert err.message.endswith("is damaged: parameter m/w is [4, 5], the model's [4, 3]")
    err = _error(lambda: load_checkpoint(tmp_path / "ck" / "step-1", expect={"m/v": (2,)}))
    assert err.message.endswith("is damaged: parameter m/v is missing (1 in all)")


def test_the_loader_picks_this_experiment_at_or_below_a_step(tmp_path) -> None:
    location = Location(tmp_path / "ck")
    for step, experiment in [(1, "mine"), (2, "mine"), (3, "other"), (5, "mine")]:
        save_checkpoint(location, _ckpt(step, experiment))
    assert load_checkpoint(tmp_path / "ck").step == 5  # the default is unchanged
    assert load_checkpoint(tmp_path / "ck", max_step=4).step == 3
    assert load_checkpoint(tmp_path / "ck", experiment_hash="mine", max_step=4).step == 2
    assert experiment_hashes(location) == {"mine", "other"}
    err = _error(lambda: load_checkpoint(tmp_path / "ck", experiment_hash="new"))
    assert err.code == "E-CKPT-001"
    assert err.message.startswith(f"no complete checkpoint in {tmp_path / 'ck'} of this run (")


# ---------------------------------------------------------------- run folders


def test_a_fresh_folder_is_claimed_and_a_resume_continues(tmp_path) -> None:
    folder = tmp_path / "runs" / "train"
    claim = claim_run_folder(folder, "a" * 64, "train", resume=False)
    assert (claim.fresh, claim.note) == (True, None)
    record = json.loads((folder / RECORD).read_text())
    assert isinstance(record.pop("created"), float)  # when: the newest claim is resumed
    assert record == {"format": 1, "experiment_hash": "a" * 64, "run": "train"}
    claim = claim_run_folder(folder, "a" * 64, "train", resume=True, checkpoint_hashes=["a" * 64])
    assert (claim.fresh, claim.note) == (False, None)


def test_another_experiment_in_the_folder_refuses(tmp_path) -> None:
    folder = tmp_path / "train"
    claim_run_folder(folder, "a" * 64, "train", resume=False)
    for resume in (False, True):
        err = _error(lambda r=resume: claim_run_folder(folder, "b" * 64, "train", resume=r))
        assert err.render().splitlines() == [
            f"error[E-CKPT-005]: run folder {folder} belongs to run `train` of experiment "
            "aaaaaaaaaaaa; this is run `train` of experiment bbbbbbbbbbbb",
            f" --> {folder}",
            "  = hint: give this run its own folder with --out, or remove the old one",
        ]


def test_checkpoints_of_another_experiment_without_run_json_refuse(tmp_path) -> None:
    err = _error(
        lambda: claim_run_folder(tmp_path, "a" * 64, "r", resume=True, checkpoint_hashes=["c" * 9])
    )
    assert err.message == (
        f"run folder {tmp_path} holds checkpoints of experiment ccccccccc; this is aaaaaaaaaaaa"
    )


def test_a_fresh_run_over_its_own_records_says_it_starts_anew(tmp_path) -> None:
    claim_run_folder(tmp_path, "a" * 64, "r", resume=False)
    (tmp_path / "metrics.jsonl").write_text("")
    claim = claim_run_folder(tmp_path, "a" * 64, "r", resume=False)
    assert claim.note == (
        f"run folder {tmp_path}: starting anew; the earlier records are kept apart "
        "in metrics.superseded.jsonl"
    )
    err = _error(
        lambda: claim_run_folder(
            tmp_path, "a" * 64, "r", resume=False, checkpoint_hashes=["a" * 64]
        )
    )
    assert err.code == "E-CKPT-005" and err.hint == (
        "continue it with --resume latest, or remove its checkpoints to start anew"
    )
