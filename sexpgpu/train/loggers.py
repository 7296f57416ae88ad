"""Loggers that mirror a run's metrics stream: TensorBoard event files and W&B.

``metrics.jsonl`` stays the record; a logger only copies each record (a
number as a scalar, an annotation as text) as it is written. A logger that
cannot start, or fails later, warns once and is dropped: it never stops the
run. The names users type (``--log``, ``:log``) are the language's
`sexpgpu.lang.runs.LOGGERS`; `LOGGERS` here holds their implementations.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["LOGGERS", "TENSORBOARD_FOLDER", "Logger", "MirroredLog", "open_loggers"]

log = logging.getLogger(__name__)

TENSORBOARD_FOLDER = "tensorboard"  # inside the run folder


class Logger(Protocol):
    """One mirror of the metrics stream."""

    def scalar(self, step: int, name: str, value: float) -> None: ...
    def text(self, step: int, name: str, text: str) -> None: ...
    def close(self) -> None: ...


class _TensorBoard:
    """Event files under ``RUN/tensorboard`` (`tensorboard --logdir RUN`), written directly."""

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb = (event_pb2, summary_pb2, tensor_pb2, types_pb2)
        self._writer = EventFileWriter(str(run_dir / TENSORBOARD_FOLDER))

    def _write(self, step: int, value: Any) -> None:
        event_pb2, summary_pb2 = self._pb[0], self._pb[1]
        summary = summary_pb2.Summary(value=[value])
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def scalar(self, step: int, name: str, value: float) -> None:
        self._write(step, self._pb[1].Summary.Value(tag=name, simple_value=value))

    def text(self, step: int, name: str, text: str) -> None:
        _, summary_pb2, tensor_pb2, types_pb2 = self._pb
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()])
        plugin = summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
        metadata = summary_pb2.SummaryMetadata(plugin_data=plugin)
        self._write(step, summary_pb2.Summary.Value(tag=name, tensor=tensor, metadata=metadata))
        self._writer.flush()  # annotations are rare: seen at once

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    """A W&B run in the run folder: offline unless ``WANDB_MODE`` or an API key says online."""

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        self._run = wandb.init(
            dir=str(run_dir), name=run_name, mode=mode, config=dict(config), reinit=True
        )

    def scalar(self, step: int, name: str, value: float) -> None:
        self._run.log({name: value}, step=step)

    def text(self, step: int, name: str, text: str) -> None:
        self._run.log({name: text}, step=step)

    def close(self) -> None:
        self._run.finish()


# name users type -> the logger's class (run folder, run name, config)
LOGGERS: dict[str, Callable[[Path, str, Mapping[str, Any]], Logger]] = {
    "tensorboard": _TensorBoard,
    "wandb": _Wandb,
}
_EXTRAS = {"tensorboard": "sexpgpu[log]", "wandb": "sexpgpu[wandb]"}


def open_loggers(
    names: Sequence[str], run_dir: Path, run_name: str, config: Mapping[str, Any]
) -> dict[str, Logger]:
    """The loggers `names` that start; each that does not warns once and is left out."""
    out: dict[str, Logger] = {}
    for name in names:
        try:
            out[name] = LOGGERS[name](run_dir, run_name, config)
        except ImportError as err:
            log.warning(
                "--log %s: %s is not installed (pip install '%s'); metrics.jsonl keeps the record",
                name, err.name or err, _EXTRAS[name],
            )  # fmt: skip
        except Exception as err:  # a logger must never stop the run
            log.warning("--log %s could not start (%s); metrics.jsonl keeps the record", name, err)
    return out


class MirroredLog:
    """A metrics log whose records are also handed to loggers (see the module docstring)."""

    def __init__(self, metrics: Any, loggers: Mapping[str, Logger]) -> None:
        self.metrics = metrics
        self.loggers = dict(loggers)

    def write(self, step: int, name: str, value: Any) -> None:
        """Record in the metrics log, then in each logger."""
        self.metrics.write(step, name, value)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        for key in list(self.loggers):
            if number:
                self._call(key, "scalar", step, name, float(value))
            else:
                self._call(key, "text", step, name, str(value))

    def annotate(self, step: int, text: str) -> None:
        """An annotation, as `sexpgpu.train.metrics.MetricsLog.annotate`."""
        self.write(step, "annotation", text)

    def close(self) -> None:
        """Close the metrics log and every logger (a failing close only warns)."""
        self.metrics.close()
        for key in list(self.loggers):
            self._call(key, "close")

    def _call(self, key: str, method: str, *args: Any) -> None:
        try:
            getattr(self.loggers[key], method)(*args)
        except Exception as err:  # warn once, drop the logger, keep the run
            log.warning(
                "--log %s failed (%s: %s) and is off for the rest of the run; "
                "metrics.jsonl keeps the record",
                key, type(err).__name__, err,
            )  # fmt: skip
            self.loggers.pop(key, None)

    def __getattr__(self, name: str) -> Any:  # the metrics log's other attributes
        return getattr(self.metrics, name)
