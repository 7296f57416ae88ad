"""`Replay`: a function that only queues kernels, captured as a CUDA graph and replayed.

The one capture path of the cuda device: the fused training step
(`sexpgpu.devices.cuda.fused`) and the update (the gradients' norm, the
clipping factor, the optimizer's kernels) both go through it. A function
qualifies when it reads nothing from the host but what its operands and
device scalars hold (refilled in place before each call), and its caller's
`key` names those operands (their addresses: a capture reads and writes
memory, whichever tensors hold it). The first call with a key runs it as it
is (warming up the libraries it calls), the second captures it and replays
the capture, and every later call with that key replays. A new key (a
checkpoint loaded new moments, say) starts over, and the old graph's memory
is freed. A capture the driver refuses leaves plain calls, logged once and
said in `events` (the run's annotations) where the caller keeps them.

Between replays a graph keeps the memory its capture used, free or not.
Work run beside it (an evaluation) draws on that memory (`beside`) rather
than on the device's, so that it needs no more than the plan counted for the
larger of the two.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from sexpgpu.runtime.oom import release_caches

__all__ = ["Replay"]

log = logging.getLogger(__name__)

# One capture at a time in a process: PyTorch's generator state admits one capture
# per device, and ranks sharing a GPU capture from threads of their own.
_CAPTURING = threading.Lock()
# Graphs whose capture itself failed: PyTorch aborts the process when one is destroyed
# (it unregisters a graph that was never registered), so they are kept. A capture whose
# body failed (out of memory) still ends, and is dropped with its memory.
_REFUSED: list[Any] = []


class Replay:
    """Calls of queue-only functions on `device`, captured per key (see the module docstring).

    Parameters
    ----------
    device
        Where the calls run; only CUDA devices capture.
    what
        Names the captured function in the log and `events` (``update``).
    events
        Where the capture's news goes (the run's annotations), or None.
    """

    def __init__(self, device: torch.device, what: str, events: list[str] | None = None) -> None:
        self.device = device
        self.enabled = device.type == "cuda"  # only CUDA devices capture
        self.what = what
        self.events = events
        self.refused: str | None = None  # why the driver refused a capture, if it did
        self.captures = 0
        self._seen: tuple[Any, ...] | None = None
        self._key: tuple[Any, ...] | None = None
        self._graph: Any = None
        self._result: Any = None
        self._stream: Any = None  # the capture's: its pool's blocks serve this stream alone

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def forget(self) -> None:
        """Drop the capture: what it reads (a launch table, say) may be gone. Keys start over."""
        self._graph = self._result = self._key = self._seen = None

    def __call__(
        self,
        key: tuple[Any, ...],
        queue: Callable[[], Any],
        plain: Callable[[], Any] | None = None,
    ) -> Any:
        """`queue()`, replayed from a capture where one is made (see the module docstring).

        `plain` is what runs in place of a capture or replay (default `queue`):
        a caller may make a plain call safe to retry where a replay needs nothing.
        """
        plain = queue if plain is None else plain
        if not self.enabled or self.refused is not None:
            return plain()
        if self._graph is not None and key == self._key:
            self._graph.replay()
            return self._result
        if key != self._seen:  # first sight: a plain call, which also warms up
            self._seen = key
            return plain()
        self._graph = self._result = None  # the old graph's memory goes first
        graph, capture, failed = None, None, None
        try:
            graph = torch.cuda.CUDAGraph()
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            # Other ranks' threads keep working on their GPUs while this one captures.
            capture = torch.cuda.graph(
                graph, stream=self._stream, capture_error_mode="thread_local"
            )
            with _CAPTURING, capture:
                try:
                    result = queue()
                except RuntimeError as error:  # out of memory, say: the capture still ends
                    failed = f"{type(error).__name__}: {error}"
        except RuntimeError as error:  # the capture itself failed (nothing ran: it only records)
            if graph is not None:
                _REFUSED.append(graph)
            failed, graph = f"{type(error).__name__}: {error}", None
        if failed is not None:
            # An ended capture is dropped, and its memory with it: its body's frames
            # (what it allocated) went with the error, which only its text outlives;
            # frames that hold their own error wait for the collector, and the pool is
            # freed only once no graph owns it, the capture's context included (a 2.47B
            # Llama's next plain call ran out with 12 GiB still in the failed capture's pool).
            graph = capture = None
            release_caches()
            self.refused = failed
            log.warning("no CUDA graph of the %s (%s); runs without one", self.what, failed)
            self._note(f"{self.what}: no CUDA graph ({failed}); launched each step")
            return plain()
        self._graph, self._key, self._result = graph, key, result
        self.captures += 1
        self._note(f"{self.what}: captured as a CUDA graph, replayed from this step on")
        graph.replay()
        return result

    @contextlib.contextmanager
    def beside(self) -> Iterator[None]:
        """Work run inside allocates from the capture's memory, on its stream (where one is held).

        The graph's outputs stay allocated; the blocks it frees within a
        replay are free between replays, and the work takes them. Its stream
        first waits for the work queued so far (the last replay), and the
        caller's stream waits for it after. Anything made inside that
        outlives it would be overwritten by the next replay, so then the
        graph is dropped (the next call captures again). Where PyTorch offers
        no way to allocate from a graph's pool, the work allocates as usual.
        """
        begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
        if self._graph is None or begin is None:
            yield
            return
        # As Inductor's CUDA graph trees warm up a graph in its pool (cudagraph_trees.py).
        index, pool = self.device.index or 0, self._graph.pool()
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)
        allocated = torch.cuda.memory_allocated(self.device)
        try:
            with torch.cuda.stream(self._stream):
                begin(index, pool)
                try:
                    yield
                finally:
                    torch._C._cuda_endAllocateToPool(index, pool)
                    torch._C._cuda_releasePool(index, pool)
        finally:
            caller.wait_stream(self._stream)
            if torch.cuda.memory_allocated(self.device) > allocated:
                log.debug("memory made beside the %s outlived it; its graph dropped", self.what)
                self.forget()

    def _note(self, line: str) -> None:
        if self.events is not None:
            self.events.append(line)
