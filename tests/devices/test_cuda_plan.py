"""The memory plan against the measured peak of a whole run on the GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "args",
    [
        # At 100 MiB the cuBLAS workspaces are most of the plan, so each one counts.
        ["examples/mlp.lisp", "--steps", "30"],
        # Attention: what the trace ran must not stay allocated into the run.
        ["examples/gpt.lisp", "--variant", "smoke", "--steps", "5"],
    ],
    ids=["mlp", "gpt-smoke"],
)
def test_an_example_peaks_within_five_percent_of_its_plan(tmp_path: Path, args) -> None:
    # Its own process: the peak is the allocator's, which other tests' tensors would raise.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "SEXPGPU_DEVICE": "cuda", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "sexpgpu", "run", *args]
    done = subprocess.run(
        [*cmd, "--out", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = re.search(r"memory: peak .* planned \(([+-]\d+)%\)", done.stdout + done.stderr)
    assert line is not None, done.stdout[-2000:]
    assert abs(int(line.group(1))) <= 5, line.group(0)
