"""Tests written in the language: a folder of ``.lisp`` cases, each stating its outcome.

A case file starts with ``;;`` lines saying what it should give; the test
module that collects a folder says what those lines mean. Imported by name
from the test modules (tests/conftest.py puts this folder on the path).
"""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["case_files", "each_case", "header"]


def case_files(folder: Path) -> list[Path]:
    """The ``.lisp`` cases in `folder`, sorted by name."""
    return sorted(folder.glob("*.lisp"))


def each_case(folder: Path) -> pytest.MarkDecorator:
    """Parametrize a test's ``path`` argument over the cases in `folder`, named by stem."""
    paths = case_files(folder)
    return pytest.mark.parametrize("path", paths, ids=[p.stem for p in paths])


def header(text: str) -> list[str]:
    """The leading ``;;`` lines of a case, without the ``;;`` and one following space."""
    lines = []
    for line in text.splitlines():
        if not line.startswith(";;"):
            break
        lines.append(line[3:] if line.startswith(";; ") else line[2:])
    return lines
