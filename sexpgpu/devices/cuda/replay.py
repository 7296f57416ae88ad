"""`Replay`: a function that only queues kernels, captured as a CUDA graph and replayed.

The update (the gradients' norm, the clipping factor, the optimizer's
kernels) runs once a step over the same buffers, but as a few dozen
launches of the host's: captured, it is one. A function qualifies when it
reads nothing from the host but what the buffers and device scalars hold
(`TorchOps.scalars`, refilled before each call), and its caller's `key`
names those buffers. The first call with a key runs it as it is (warming up
the libraries it calls), the second captures it and replays the capture,
and every later call with that key replays. A new key (a checkpoint loaded
new moments, say) starts over, and the old graph's memory is freed. A
capture the driver refuses leaves plain calls, logged once. Either is said
in `events` (the run's annotations).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Replay"]

log = logging.getLogger(__name__)


class Replay:
    """Calls of queue-only functions on `device`, captured per key (see the module docstring)."""

    def __init__(self, device: torch.device, events: list[str]) -> None:
        self.device = device
        self.events = events
        self.refused: str | None = None  # why the driver refused a capture, if it did
        self.captures = 0
        self._seen: tuple[Any, ...] | None = None
        self._key: tuple[Any, ...] | None = None
        self._graph: Any = None
        self._result: Any = None

    def forget(self) -> None:
        """Drop the capture: what it reads (a launch table, say) may be gone. Keys start over."""
        self._graph = self._result = self._key = self._seen = None

    def __call__(self, key: tuple[Any, ...], queue: Callable[[], Any]) -> Any:
        if self.device.type != "cuda" or self.refused is not None:
            return queue()
        if self._graph is not None and key == self._key:
            self._graph.replay()
            return self._result
        if key != self._seen:  # first sight: a plain call, which also warms up
            self._seen = key
            return queue()
        self._graph = self._result = None  # the old graph's memory goes first
        try:
            graph = torch.cuda.CUDAGraph()
            # Other ranks' threads keep working on their GPUs while this one captures.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                result = queue()
        except RuntimeError as error:  # nothing ran: a capture only records
            self.refused = f"{type(error).__name__}: {error}"
            log.warning("no CUDA graph of the update (%s); it runs without one", error)
            self.events.append(f"update: no CUDA graph ({self.refused}); launched each step")
            return queue()
        self._graph, self._key, self._result = graph, key, result
        self.captures += 1
        self.events.append("update: captured as a CUDA graph, replayed from this step on")
        graph.replay()
        return result
