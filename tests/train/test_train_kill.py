"""A run killed with SIGKILL between checkpoints resumes to the uninterrupted result."""

from pathlib import Path

import numpy as np
from run_reference import series
from sigkill_helpers import kill_at_step
from standin_program import Mlp, defdata, on_cpu

from sexpgpu.lang.runs import optimizer_spec, schedule_spec
from sexpgpu.train.loop import Trainer
from sexpgpu.train.settings import RunSettings

HERE = Path(__file__).resolve().parent

# The child process: the same trainer as the test's, on its own.
SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {here!r})
from test_train_kill import trainer
trainer(Path({run_dir!r})).run()
"""


def trainer(run_dir: Path, resume: str | None = None) -> Trainer:
    settings = RunSettings(
        steps=30,
        batch=16,
        microbatches=2,
        seed=5,
        optimizer=optimizer_spec("adamw", lr=1e-2),
        schedule=schedule_spec("cosine", warmup=5),
        clip=1.0,
        checkpoint_every=10,
        checkpoint_location="checkpoints",
    )
    data = defdata("digits", "(digits)")
    return Trainer(
        lambda r: on_cpu(Mlp(batch=16)), data, settings, run_dir, experiment_hash="h", resume=resume
    )


def _losses(run_dir):
    return series(run_dir, "train/loss")


def test_sigkill_between_checkpoints_then_resume(tmp_path):
    run_dir = tmp_path / "killed"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(here=str(HERE), run_dir=str(run_dir)))
    # killed after step 13: past the checkpoint of step 10, before that of 20
    kill_at_step(13, str(script), workdir=tmp_path)
    killed_at = max(_losses(run_dir))
    assert killed_at < 30

    resumed = trainer(run_dir, resume="latest").run()
    whole = trainer(tmp_path / "whole").run()
    assert resumed.resumed_from in (10, 20) and resumed.resumed_from < killed_at  # steps lost
    for k in whole.params:
        assert np.array_equal(whole.params[k], resumed.params[k])
    assert _losses(run_dir) == _losses(tmp_path / "whole")  # killed steps 11.. were rewritten
