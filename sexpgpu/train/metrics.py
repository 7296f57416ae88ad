"""The run's record: ``metrics.jsonl``, ``status.json`` and diagnostic reducers.

``metrics.jsonl`` holds one JSON object per line, ``{"step", "name",
"value"}``; docs/metrics.md lists the names. Each line is flushed as it is
written, so a run killed at any moment leaves whole lines (at most the last
one cut, which readers skip); no record is ever deleted (`MetricsLog` says
where superseded ones go). ``status.json`` is replaced atomically (write a
temporary file, fsync, rename) so a reader never sees half of it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sexpgpu.runtime.files import replace_whole

__all__ = [
    "REDUCERS",
    "SUPERSEDED",
    "MetricsLog",
    "read_metrics",
    "read_series",
    "write_status",
]

SUPERSEDED = "metrics.superseded.jsonl"  # records a resume or a fresh start set aside

# name as users type it in `:reduce` -> fold of the ranks' values
REDUCERS: dict[str, Callable[[Sequence[float]], float]] = {
    "mean": statistics.fmean,
    "max": max,
    "min": min,
    "sum": math.fsum,
}


class MetricsLog:
    """Appends ``{"step", "name", "value"}`` lines to ``metrics.jsonl``.

    No record is ever deleted. On a resume from step `keep_through`, the
    records of later steps (written after the last checkpoint by a run that
    then crashed) are moved to ``metrics.superseded.jsonl`` beside it, each
    with a ``superseded`` field saying why, so that ``metrics.jsonl`` reads
    as one trajectory; a fresh start moves every earlier record there.

    Parameters
    ----------
    path
        The file.
    keep_through
        On a resume, the step of the checkpoint; None starts the trajectory anew.
    """

    def __init__(self, path: Path, keep_through: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept, moved = [], []
        for record in read_metrics(self.path):
            keep = keep_through is not None and record["step"] <= keep_through
            (kept if keep else moved).append(record)
        if moved:
            why = "a fresh start" if keep_through is None else f"a resume from step {keep_through}"
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            _append(
                self.path.with_name(SUPERSEDED),
                [r | {"superseded": f"{why}, {stamp}"} for r in moved],
            )
        replace_whole(self.path, "".join(_line(r) for r in kept), sync=True)
        losses = [r for r in kept if r["name"] == "train/loss"]
        last = max(losses, key=lambda r: r["step"], default=None)
        # The last step recorded: status.json says the same after any stop.
        self.last_step = (keep_through or 0) if last is None else last["step"]
        self.last_loss = None if last is None else last["value"]
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - lives with the run

    def write(self, step: int, name: str, value: Any) -> None:
        """Append one record and flush it (nothing once closed)."""
        with self._lock:
            if self._file.closed:  # a run stopped at once: a rank may still be finishing
                return
            self._file.write(_line({"step": step, "name": name, "value": value}))
            self._file.flush()
            if name == "train/loss":
                self.last_step, self.last_loss = step, value

    def annotate(self, step: int, text: str) -> None:
        """Append a free-text annotation (memory plan, skipped checkpoint, ...)."""
        self.write(step, "annotation", text)

    def close(self) -> None:
        """Stop recording: later writes are dropped, so `last_step` stays the last."""
        with self._lock:
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
    """``step -> value`` of the records called `name`: the run's one trajectory.

    Records a resume superseded are not in ``metrics.jsonl``. A run branched
    from another run's checkpoint (``--out NEW --resume PATH``, its parent in
    ``run.json``) starts with its parent's trajectory up to that checkpoint.
    """
    from sexpgpu.train.run_folder import read_parent

    series: dict[int, float] = {}
    seen: set[Path] = set()
    folder, through = Path(run_dir), None
    while folder.resolve() not in seen:
        seen.add(folder.resolve())
        records = read_metrics(folder / "metrics.jsonl")
        own = {r["step"]: r["value"] for r in records if r["name"] == name}
        series = {k: v for k, v in own.items() if through is None or k <= through} | series
        parent = read_parent(folder)
        if parent is None or parent["folder"] is None:
            break
        folder, through = Path(parent["folder"]), parent["step"]
    return dict(sorted(series.items()))


def _append(path: Path, records: list[dict[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(_line(r) for r in records))
        f.flush()
        os.fsync(f.fileno())


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
    replace_whole(Path(path), json.dumps(status, indent=1) + "\n", sync=True)
