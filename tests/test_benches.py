"""Every benchmark script runs at its ``--smoke`` size, on the CPU, so none rots unnoticed.

A script added to benches/ without a ``--smoke`` size fails here. The GPU
scripts run their smoke on the cpu device and PyTorch's CPU device (each
says so in its docstring). A few are run by a test of their own that also
checks what they print (`ELSEWHERE`). The ``.sh`` files
are not benchmarks but drivers of a GPU session (they call nvidia-smi and
the GPU tests), so they are left out.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# script -> the test that runs its --smoke and checks its output
ELSEWHERE = {
    "memory_cuda.py": "tests/devices/test_memory_bench.py",
    "tn_cpu.py": "tests/tn/test_tn_benches.py",
    "tn_gpu.py": "tests/tn/test_tn_benches.py",
}
SCRIPTS = sorted(p for p in (ROOT / "benches").glob("*.py") if p.name not in ELSEWHERE)


def test_the_benches_are_found():
    assert {p.name for p in SCRIPTS} >= {"cpu_interpreter.py", "gpt2_cuda.py", "reader.py"}
    for script, test in ELSEWHERE.items():
        assert (ROOT / "benches" / script).exists(), script
        assert script in (ROOT / test).read_text(), (script, test)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_bench_runs_at_its_smoke_size(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    env["HOME"] = str(tmp_path)  # the stacking choices file and caches stay in the test's folder
    done = subprocess.run(
        [sys.executable, str(script), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard, not a speed check
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip(), done.stderr[-2000:]  # it reported something
