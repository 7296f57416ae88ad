"""A run killed with SIGKILL between checkpoints resumes to the uninterrupted result."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from standin_program import Data, Mlp, Spec

from sexpgpu.train.loop import Trainer
from sexpgpu.train.metrics import read_metrics
from sexpgpu.train.settings import RunSettings

HERE = Path(__file__).resolve().parent

SCRIPT = """
import sys, time
sys.path.insert(0, {here!r})
from pathlib import Path
from standin_program import Data, Mlp, Spec
from sexpgpu.train.loop import Trainer
from sexpgpu.train.settings import RunSettings

settings = RunSettings(
    steps=30, batch=16, microbatches=2, seed=5,
    optimizer=Spec("adamw", {{"lr": 1e-2}}), schedule=Spec("cosine", {{"warmup": 5}}),
    clip=1.0, checkpoint_every=10, checkpoint_location="checkpoints",
)
Trainer(lambda r: Mlp(batch=16), Data("digits", "digits", options={{"split": 0.9}}), settings,
        Path({run_dir!r}), experiment_hash="h", resume={resume!r},
        on_step=lambda report: time.sleep(0.1)).run()
"""


def _settings():
    return RunSettings(
        steps=30,
        batch=16,
        microbatches=2,
        seed=5,
        optimizer=Spec("adamw", {"lr": 1e-2}),
        schedule=Spec("cosine", {"warmup": 5}),
        clip=1.0,
        checkpoint_every=10,
        checkpoint_location="checkpoints",
    )


def _losses(run_dir):
    return {
        r["step"]: r["value"]
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r["name"] == "train/loss"
    }


def _last_step(run_dir):
    return max(_losses(run_dir), default=0)


def test_sigkill_between_checkpoints_then_resume(tmp_path):
    run_dir = tmp_path / "killed"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(here=str(HERE), run_dir=str(run_dir), resume=None))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while _last_step(run_dir) < 13:  # past the checkpoint of step 10, before that of 20
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = _last_step(run_dir)
    assert killed_at < 30

    resumed = Trainer(
        lambda r: Mlp(batch=16),
        Data("digits", "digits", options={"split": 0.9}),
        _settings(),
        run_dir,
        experiment_hash="h",
        resume="latest",
    ).run()
    whole = Trainer(
        lambda r: Mlp(batch=16),
        Data("digits", "digits", options={"split": 0.9}),
        _settings(),
        tmp_path / "whole",
        experiment_hash="h",
    ).run()
    assert resumed.resumed_from in (10, 20) and resumed.resumed_from < killed_at  # steps lost
    for k in whole.params:
        assert np.array_equal(whole.params[k], resumed.params[k])
    assert _losses(run_dir) == _losses(tmp_path / "whole")  # killed steps 11.. were rewritten
