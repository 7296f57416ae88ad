"""SIGKILL a training process at a chosen step, without racing it.

The child pauses right after it records ``train/loss`` of the chosen step and
drops a marker file; the test waits for the marker (with a generous deadline,
so a slow or loaded machine only makes it slower) and then kills it. The kill
therefore always lands at that step, however fast or slow the run goes.

As a script it is the child: ``python sigkill_helpers.py MARKER STEP TARGET
ARGS...`` installs the pause, then runs TARGET (a ``.py`` file, or a module
such as ``sexpgpu``) with ARGS as its command line.
"""

import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()

# Far longer than any run needs to reach its step; a hang fails, never blocks.
DEADLINE_S = 300.0


def kill_at_step(step: int, target: str, *args: str, workdir: Path, env=None) -> None:
    """Run ``TARGET ARGS`` in a child, SIGKILL it once it has recorded `step`."""
    marker = workdir / f"paused-at-{step}"
    log = workdir / f"child-{step}.log"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(HERE), str(marker), str(step), target, *args],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
        )
        try:
            deadline = time.monotonic() + DEADLINE_S
            while not marker.exists():
                assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()}"
                assert time.monotonic() < deadline, f"no step {step} in {DEADLINE_S:g} s"
                time.sleep(0.05)
        finally:
            proc.kill()  # SIGKILL; nothing if it has already exited
            proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _pause_at(step: int, marker: Path) -> None:
    from sexpgpu.train.metrics import MetricsLog

    write = MetricsLog.write

    def write_then_pause(self, at, name, value):
        write(self, at, name, value)
        if at == step and name == "train/loss":
            marker.write_text(str(step))
            time.sleep(DEADLINE_S)  # the test kills us here

    MetricsLog.write = write_then_pause


if __name__ == "__main__":
    marker, step, target, *rest = sys.argv[1:]
    _pause_at(int(step), Path(marker))
    sys.argv = [target, *rest]
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
