"""benches/memory_cuda.py runs its --smoke size on the CPU (no GPU, seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def test_memory_bench_smoke():
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "memory_cuda.py"), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 2x64 |")]
    assert len(rows) == 2, done.stdout
    sexpgpu, peer = rows
    assert "| sexpgpu | yes |" in sexpgpu and "recompute:" in sexpgpu, done.stdout
    assert "| torch | yes |" in peer, done.stdout
    assert "largest trained: sexpgpu 2x64, torch 2x64" in done.stdout
    assert "flops at 60% of the plan (2x64, batch 2):" in done.stdout
