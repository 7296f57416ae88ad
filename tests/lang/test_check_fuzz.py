"""Mutated experiment files through `sexpgpu check`: a report or a SexpgpuError, soon.

A CI-sized run of the tester's approach (issue 13: 100,000 generated files
through the checker). The generator is seeded, so a failure reproduces; the
failing file is in the assertion message.
"""

from __future__ import annotations

import random
import signal
import time

import pytest
from check_fuzz import SEEDS, mutate

from sexpgpu.cli import main

FILES = 1500
SECONDS_PER_FILE = 10


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


@pytest.mark.timeout(120)
def test_mutated_files_check_to_a_report_or_a_user_error(tmp_path, capsys) -> None:
    rng = random.Random(13)
    path = tmp_path / "f.lisp"
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(FILES):
            text = mutate(rng.choice(SEEDS), rng)
            path.write_text(text)
            start = time.monotonic()
            signal.alarm(SECONDS_PER_FILE)
            try:
                status = main(["check", str(path)])
            except _Timeout:
                status = "no answer"
            finally:
                signal.alarm(0)
            err = capsys.readouterr().err
            took = time.monotonic() - start
            assert status in (0, 1) and "internal error" not in err, (i, status, err, text)
            assert took < SECONDS_PER_FILE, (i, took, text)
    finally:
        signal.signal(signal.SIGALRM, previous)
