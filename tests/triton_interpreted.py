"""Running a test module's Triton kernels under Triton's interpreter, on the CPU.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so a module's
interpreted cases run in a pytest of their own with it set: the module's
driver test calls `run_interpreted(__file__)`, and its cases are marked
`interpreted_only` (they skip in the ordinary run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="runs under TRITON_INTERPRET=1 (the module's driver test starts it)"
)


def run_interpreted(path: str) -> None:
    """Run the test module at `path` under the interpreter; fail with its output if it fails."""
    if INTERPRETED:
        pytest.skip("this is the interpreter's run")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
        cwd=Path(path).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" in run.stdout  # the driver itself skips
