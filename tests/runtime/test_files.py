"""`replace_whole`: a file written whole or not at all, by writers at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sexpgpu.runtime.files import replace_whole


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
