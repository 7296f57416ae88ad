"""Every tn benchmark runs its --smoke size on the CPU (no GPU, seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("script", "rows"), [("tn_cpu.py", 3 * 5), ("tn_gpu.py", 2)])
def test_tn_bench_smoke(script, rows):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benches" / script), "--smoke", "--threads", "1"]
        if script == "tn_cpu.py"
        else [sys.executable, str(ROOT / "benches" / script), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # tn_cpu: one table row per case and peer; tn_gpu: one line per case
    table = [line for line in lines if line.endswith("x |") or "ratio:" in line]
    assert len(table) >= rows, done.stdout
