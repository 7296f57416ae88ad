"""One decoding step of a model's output graph on PyTorch, replayed as a CUDA graph.

Sampling runs the output graph (`sexpgpu.ir.compile.output_graph`, one row of
``seq`` ids) once per new token. On a GPU the step is captured once into a
CUDA graph over fixed buffers: each token then costs one copy of the window
in, one replay and one copy of a logits row out, with no Python per op. On
PyTorch's CPU device (tests) the same lowering runs uncaptured.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sexpgpu.devices.cuda.device import import_torch
from sexpgpu.devices.cuda.executor import TorchGraph
from sexpgpu.devices.cuda.lowering import ids_checked_by_caller
from sexpgpu.ir.node import Graph
from sexpgpu.runtime.devices import Device as DeviceId
from sexpgpu.runtime.devices import require_capability

__all__ = ["TorchDecodeStep"]

_WARMUPS = 2  # uncaptured calls first, so lazy library setup happens outside the capture


class TorchDecodeStep:
    """``step(ids) -> logits``: the output graph on one window of ids, on PyTorch.

    Parameters
    ----------
    graph
        The output graph: one INPUT of ids ``[1 seq]`` and ``output`` ``[1 seq vocab]``.
    params
        Parameter name -> float32 array (uploaded once).
    where
        A cuda device (``cuda:N``: captured), or None for PyTorch's CPU device.
    capture
        Capture the step as a CUDA graph (default: on a GPU); False runs the
        lowering op by op each token (benches/sample_cuda.py compares both).
    """

    def __init__(
        self,
        graph: Graph,
        params: Mapping[str, np.ndarray],
        where: DeviceId | None,
        capture: bool | None = None,
    ) -> None:
        torch = import_torch()
        self.torch = torch
        if where is not None:
            require_capability([where])
            self.device = torch.device("cuda", where.index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        (self.input,) = graph.inputs.values()
        self.program = TorchGraph(graph, self.device)
        self.feeds: dict[str, Any] = {
            k: torch.from_numpy(np.asarray(params[k], np.float32)).to(self.device)
            for k in graph.params
        }
        self.ids = torch.zeros(self.input.shape, dtype=torch.int32, device=self.device)
        self.feeds[self.input.name] = self.ids
        self.captured = self.device.type == "cuda" and capture is not False
        self.logits = self._capture() if self.captured else None

    def _run(self) -> Any:
        # The sampler checks every id against the vocabulary on the host.
        with ids_checked_by_caller():
            return self.program(self.feeds)["output"]

    def _capture(self) -> Any:
        torch = self.torch
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(_WARMUPS):
                self._run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            logits = self._run()
        return logits

    def __call__(self, ids: np.ndarray, position: int) -> np.ndarray:
        """The logits (float64) at `position` of the window `ids` (int32 ``[1 seq]``)."""
        self.ids.copy_(self.torch.from_numpy(ids))
        if self.captured:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self._run()
        return logits[0, position].float().cpu().numpy().astype(np.float64)
