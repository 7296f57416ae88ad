"""`replace_whole`: a file written whole or not at all, by writers at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sexpgpu.runtime.files import remove_stale_partials, replace_whole


def test_text_and_bytes_replace_the_file_and_leave_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "new" / "status.json"
    replace_whole(path, "first\n", sync=True)
    replace_whole(path, b"second")
    assert path.read_bytes() == b"second"
    assert [p.name for p in path.parent.iterdir()] == ["status.json"]


def test_writers_at_once_each_leave_a_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    texts = [str(i) * 100_000 for i in range(8)]
    threads = [threading.Thread(target=replace_whole, args=(path, t)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]


def test_a_failed_write_raises_and_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "kept.txt"
    replace_whole(path, "old")
    with pytest.raises(OSError):
        replace_whole(tmp_path / "kept.txt" / "below", "x")  # a file where a folder should be
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


def test_the_partials_of_writers_killed_mid_write_are_removed_and_others_kept(
    tmp_path: Path,
) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead = int(ended.stdout)
    gone = tmp_path / f".entry.step.{dead}.7.tmp"
    alive = tmp_path / f".entry.step.{os.getpid()}.7.tmp"
    other = tmp_path / ".notes.tmp"  # not a partial of ours: left alone
    whole = tmp_path / "entry.step"
    for path in (gone, alive, other, whole):
        path.write_bytes(b"x")
    assert remove_stale_partials(tmp_path) == 1
    assert not gone.exists() and alive.exists() and other.exists() and whole.exists()
    assert remove_stale_partials(tmp_path / "absent") == 0
