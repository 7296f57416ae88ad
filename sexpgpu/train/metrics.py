"""The run's record: ``metrics.jsonl``, ``status.json`` and diagnostic reducers.

``metrics.jsonl`` holds one JSON object per line, ``{"step", "name",
"value"}``; docs/metrics.md lists the names. Each line is flushed as it is
written, so a run killed at any moment leaves whole lines (at most the last
one cut, which readers skip). ``status.json`` is replaced atomically (write a
temporary file, fsync, rename) so a reader never sees half of it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["REDUCERS", "MetricsLog", "read_metrics", "read_series", "write_status"]

# name as users type it in `:reduce` -> fold of the ranks' values
REDUCERS: dict[str, Callable[[Sequence[float]], float]] = {
    "mean": statistics.fmean,
    "max": max,
    "min": min,
    "sum": math.fsum,
}


class MetricsLog:
    """Appends ``{"step", "name", "value"}`` lines to ``metrics.jsonl``.

    Parameters
    ----------
    path
        The file.
    keep_through
        On a resume, the step of the checkpoint: lines of later steps (written
        by the run after its last checkpoint) are dropped first, so the file
        reads as one uninterrupted run. None starts a new file.
    """

    def __init__(self, path: Path, keep_through: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if keep_through is not None:
            kept = [r for r in read_metrics(self.path) if r["step"] <= keep_through]
        _atomic_write(self.path, "".join(_line(r) for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - lives with the run

    def write(self, step: int, name: str, value: Any) -> None:
        """Append one record and flush it."""
        self._file.write(_line({"step": step, "name": name, "value": value}))
        self._file.flush()

    def annotate(self, step: int, text: str) -> None:
        """Append a free-text annotation (memory plan, skipped checkpoint, ...)."""
        self.write(step, "annotation", text)

    def close(self) -> None:
        self._file.close()


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, allow_nan=True) + "\n"


def read_metrics(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a ``metrics.jsonl``, skipping a line cut off by a crash."""
    path = Path(path)
    if not path.exists():
        return
    # Undecodable bytes (a damaged file) become lines that fail to parse and are skipped.
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and {"step", "name", "value"} <= record.keys():
                yield record


def read_series(run_dir: Path, name: str) -> dict[int, float]:
    """``step -> value`` of the records called `name` in a run directory's ``metrics.jsonl``."""
    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    return {r["step"]: r["value"] for r in records if r["name"] == name}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_status(
    path: Path,
    *,
    step: int,
    steps: int,
    loss: float | None,
    tokens_per_s: float,
    eta_s: float | None,
    state: str,
) -> None:
    """Replace ``status.json`` atomically with the run's current state."""
    status = {
        "step": step,
        "steps": steps,
        "loss": loss,
        "tokens_per_s": tokens_per_s,
        "eta_s": eta_s,
        "state": state,  # "running", "done", "failed" or "interrupted"
        "updated": time.time(),
    }
    _atomic_write(Path(path), json.dumps(status, indent=1) + "\n")
