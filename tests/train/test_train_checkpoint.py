import json
import logging
import os

import numpy as np
import pytest

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang.runs import optimizer_spec
from sexpgpu.train.checkpoint import Checkpoint, Location, load_checkpoint, save_checkpoint


def _ckpt(step, seed=0):
    rng = np.random.default_rng(seed + step)
    params = {"gpt/wte": rng.standard_normal((4, 3)).astype(np.float32)}
    moments = {"exp_avg/gpt/wte": rng.standard_normal((4, 3)).astype(np.float32)}
    state = {"experiment_hash": "h", "loaders": [{"position": step, "rank": 0, "ranks": 1}]}
    return Checkpoint(step, params, moments, state)


def _same(a, b):
    assert a.step == b.step
    for k in a.params:
        assert np.array_equal(a.params[k], b.params[k])
    for k in a.optimizer:
        assert np.array_equal(a.optimizer[k], b.optimizer[k])
    assert b.state["loaders"] == a.state["loaders"]


def test_round_trip_is_exact_and_holds_no_pickle(tmp_path):
    where = save_checkpoint(Location(tmp_path / "ck"), _ckpt(10))
    assert sorted(os.listdir(where)) == [
        "manifest.json",
        "optimizer.safetensors",
        "params.safetensors",
        "state.json",
    ]
    manifest = json.loads((tmp_path / "ck" / "step-10" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"optimizer.safetensors", "params.safetensors", "state.json"}
    _same(_ckpt(10), load_checkpoint(tmp_path / "ck"))
    _same(_ckpt(10), load_checkpoint(where))
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(".")]  # no leftovers


def test_latest_skips_a_damaged_newest_and_says_so(tmp_path, caplog):
    loc = Location(tmp_path / "ck")
    for step in (5, 10, 15):
        save_checkpoint(loc, _ckpt(step))
    blob = bytearray((tmp_path / "ck/step-15/params.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (tmp_path / "ck/step-15/params.safetensors").write_bytes(bytes(blob))
    os.remove(tmp_path / "ck/step-10/manifest.json")  # cut off before its manifest
    with caplog.at_level(logging.WARNING):
        got = load_checkpoint(tmp_path / "ck")
    _same(_ckpt(5), got)
    assert len(got.skipped) == 2
    assert "does not match the checksum" in got.skipped[0]
    assert "step-15" in caplog.text and "step-10" in caplog.text


def test_a_damaged_checkpoint_named_directly_is_an_error(tmp_path):
    save_checkpoint(Location(tmp_path), _ckpt(3))
    state = tmp_path / "step-3" / "state.json"
    state.write_text(state.read_text().replace('"h"', '"g"'))
    with pytest.raises(SexpgpuError) as info:
        load_checkpoint(tmp_path / "step-3")
    assert info.value.code == "E-CKPT-002"
    assert "state.json does not match" in info.value.message


def test_no_checkpoint_is_e_ckpt_001(tmp_path):
    with pytest.raises(SexpgpuError) as info:
        load_checkpoint(tmp_path / "nothing")
    assert info.value.code == "E-CKPT-001"


def test_rewriting_a_step_replaces_it_whole(tmp_path):
    loc = Location(tmp_path)
    save_checkpoint(loc, _ckpt(4, seed=1))
    save_checkpoint(loc, _ckpt(4, seed=2))
    _same(_ckpt(4, seed=2), load_checkpoint(tmp_path))


@pytest.fixture(scope="module")
def s3_endpoint():
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    env |= {"AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="sexpgpu-ckpt")
    yield url
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_s3_locations_round_trip_and_fall_back(s3_endpoint):
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True}
    loc = Location("s3://sexpgpu-ckpt/runs/a", options)
    save_checkpoint(loc, _ckpt(2))
    save_checkpoint(loc, _ckpt(4))
    assert loc.steps() == [4, 2]
    _same(_ckpt(4), load_checkpoint("s3://sexpgpu-ckpt/runs/a", options))
    loc.fs.rm("sexpgpu-ckpt/runs/a/step-4/manifest.json")
    got = load_checkpoint("s3://sexpgpu-ckpt/runs/a", options)
    _same(_ckpt(2), got)
    assert got.skipped
    _same(_ckpt(2), load_checkpoint("s3://sexpgpu-ckpt/runs/a/step-2", options))


def test_a_run_checkpoints_to_s3_and_resumes_from_it(s3_endpoint, tmp_path):
    from standin_program import Mlp, defdata, on_cpu

    from sexpgpu.train.loop import Trainer
    from sexpgpu.train.settings import RunSettings

    options = {"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True}

    def trainer(steps, resume=None, out="run"):
        s = RunSettings(
            steps=steps,
            batch=8,
            microbatches=1,
            seed=0,
            optimizer=optimizer_spec("adamw", lr=1e-2),
            checkpoint_every=3,
            checkpoint_location=f"s3://sexpgpu-ckpt/{out}",
        )
        return Trainer(
            lambda r: on_cpu(Mlp(batch=8)),
            defdata("d", "(digits)"),
            s,
            tmp_path / out,
            experiment_hash="h",
            resume=resume,
            storage_options=options,
        )

    trainer(3).run()
    resumed = trainer(6, resume="latest").run()
    whole = trainer(6, out="whole").run()
    assert resumed.resumed_from == 3
    for k in whole.params:
        assert np.array_equal(whole.params[k], resumed.params[k])
    assert Location("s3://sexpgpu-ckpt/run", options).steps() == [6, 3]


def test_a_full_local_disk_says_so_not_buckets(tmp_path, monkeypatch):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(SexpgpuError) as info:
        save_checkpoint(Location(tmp_path / "ck"), Checkpoint(1, {}, {}, {"x": 1}))
    assert info.value.code == "E-CKPT-004"
    assert info.value.hint.startswith("the disk is full: free space there")
    assert "bucket" not in info.value.hint
    assert not any((tmp_path / "ck").iterdir())  # no half folder left taking the space
