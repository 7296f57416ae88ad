"""`TorchGraphs`: a run's graphs on one torch device (the `StepGraphs` of cuda).

The training graph runs as a `sexpgpu.devices.cuda.fused.FusedGraph` where
it was compiled (Inductor's kernels, a CUDA graph on a GPU), `degree`
microbatches per call: a step of one call returns its gradients, made as
the backward goes; a step of several sums them into buffers kept for the
run. Otherwise, and for
the evaluation and activation graphs, op by op through
`sexpgpu.devices.cuda.executor.TorchGraph`. Sharded, the parameters it reads
as bf16 copies alone may be kept as those copies alone (`keep_copies_only`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from sexpgpu.devices.cuda.executor import TorchGraph
from sexpgpu.devices.cuda.param_copies import ParamCopies
from sexpgpu.devices.state import SummingGraphs, Sums
from sexpgpu.ir.compile import GRAD_PREFIX, CompiledRun
from sexpgpu.runtime.devices import Device as DeviceId
from sexpgpu.runtime.memory import PeakTracker

__all__ = ["TorchGraphs"]


class TorchGraphs(SummingGraphs):
    """A run's graphs lowered to PyTorch on one device (the `StepGraphs` of cuda).

    With `fused`, the training graph runs as a `FusedGraph` (Inductor's
    kernels, summing into buffers this object owns, a CUDA graph on a GPU)
    reading the bf16 `copies` of the parameters that the update keeps
    (`TorchOps` writes them); without it, op by op.
    """

    has_activations = True

    def __init__(
        self,
        compiled: CompiledRun,
        device: Any,
        where: DeviceId,
        *,
        fused: Any = None,
        degree: int = 1,
        copies: ParamCopies | None = None,
    ) -> None:
        self.compiled = compiled
        self.params = compiled.params
        self.device = device
        self.where = where
        self._eval = TorchGraph(compiled.eval_graph, device)
        self._activations: Any = None
        self._graph = TorchGraph
        self._tracker = PeakTracker(where)
        self.fused = fused
        self.degree = degree  # microbatches per call of `fused`
        self.copies = ParamCopies() if copies is None else copies
        self._pending: list[Mapping[str, np.ndarray]] = []
        self._pieces: dict[int, TorchGraphs | None] = {}
        self._buffers: Sums | None = None
        self._room: dict[str, torch.Tensor] = {}  # `idle_f32`'s, where there are no buffers
        self._stand_ins: dict[str, torch.Tensor] = {}  # parameters kept as their copies alone

    @functools.cached_property
    def _train(self) -> TorchGraph:
        """The training graph op by op: planned only where it runs (or its peak is asked)."""
        return TorchGraph(self.compiled.train_graph, self.device)

    @property
    def last_peak_bytes(self) -> int:
        """The allocator's high-water mark on a GPU; the planned live set on the CPU."""
        if not self._tracker.device.is_cuda:
            self._tracker.observe(self._train.planned_peak_bytes)
        return self._tracker.peak

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        return self.compiled.init_params(seed)

    def train_step(self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray]) -> Any:
        out = self._train({**batch, **params})
        return out["loss"], {name: out[GRAD_PREFIX + name] for name in self.params}

    def accumulate(
        self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray], sums: Sums | None
    ) -> Sums:
        if self.fused is None:
            return super().accumulate(params, batch, sums)
        whole = not self.fused.sums  # the call is the step, and returns its sums
        if sums is None and not whole:
            sums = self._zeroed()
        # Held until `degree` microbatches are here (the degree divides a rank's
        # microbatches); kept only once the call succeeds, so a retry starts over.
        pending = [*self._pending, batch]
        if len(pending) < self.degree:
            self._pending = pending
            return sums
        if self.degree > 1:
            batch = {name: np.stack([b[name] for b in pending]) for name in batch}
        if whole:
            out = self.fused({**batch, **params}, {}, copies=self.copies)
            self._pending = []
            grads = {k: out[GRAD_PREFIX + k] for k in self.params}
            return Sums(out["loss"], grads, self.degree)
        assert sums is not None
        buffers = {"loss": sums.loss, **{GRAD_PREFIX + k: g for k, g in sums.grads.items()}}
        self.fused({**batch, **params}, buffers, copies=self.copies, zeros=sums.count == 0)
        self._pending = []
        sums.count += self.degree
        return sums

    @property
    def copies_only(self) -> list[str]:
        """The parameters the fused step reads as bf16 copies alone (their f32 nowhere)."""
        return [] if self.fused is None else list(self.fused.copies_only)

    def keep_copies_only(self, host: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Stand-ins for the f32 parameters of `host`, whose bf16 copies alone are kept.

        The fused call takes every parameter's f32 operand but reads none of
        these: each stand-in is a view of one buffer never written (the size
        of the largest of them), so its copy is never cast again from it.
        The copies are cast here from `host`'s f32, as the step would cast them.
        """
        largest = max((int(np.size(v)) for v in host.values()), default=0)
        scratch = torch.empty(largest, dtype=torch.float32, device=self.device)
        for k, value in host.items():
            stand_in = scratch[: value.size].view(value.shape)
            (copy,) = self.copies.current([stand_in])
            copy.copy_(torch.from_numpy(np.array(value, np.float32)).to(self.device).to(copy.dtype))
            self._stand_ins[k] = stand_in
        return dict(self._stand_ins)

    def copies_of(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The bf16 copies of `params` (f32 parameters or stand-ins), current."""
        return dict(zip(params, self.copies.current(list(params.values())), strict=True))

    def idle_f32(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Between steps, f32 room for parameters `names`: their gradient buffers, idle then.

        A step that returns its gradients has no buffers: the room is made
        once and kept (the plan counts it as gradients).
        """
        if self.fused is not None and not self.fused.sums:
            for k in names:
                if k not in self._room:
                    shape = self.params[k].shape
                    self._room[k] = torch.empty(shape, dtype=torch.float32, device=self.device)
            return {k: self._room[k] for k in names}
        if self._buffers is None:
            self._zeroed()
        assert self._buffers is not None
        return {k: self._buffers.grads[k] for k in names}

    def accumulate_pieces(
        self,
        params: Mapping[str, Any],
        batch: Mapping[str, np.ndarray],
        sums: Sums | None,
        parts: int,
    ) -> Sums:
        # Op by op, a parameter kept as its copy alone is read as the copy widened:
        # the graph reads it only through its cast to bf16, which gives the copy back.
        widened = {k: c.float() for k, c in self.copies_of(self._stand_ins).items()}
        return super().accumulate_pieces({**params, **widened}, batch, sums, parts)

    def pieces(self, parts: int) -> TorchGraphs | None:
        """The training graph at ``1 / parts`` of the rows, op by op (after allocations failed)."""
        if parts not in self._pieces:
            smaller = self.compiled.pieces(parts)
            self._pieces[parts] = (
                None
                if smaller is None
                else TorchGraphs(smaller, self.device, self.where, copies=self.copies)
            )
        return self._pieces[parts]

    def held_batches(self) -> list[Mapping[str, np.ndarray]]:
        return self._pending

    def _zeroed(self) -> Sums:
        """The step's sums at zero, in buffers kept for the whole run (a CUDA graph reads them)."""
        if self._buffers is None:
            zeros = {
                k: torch.zeros(info.shape, dtype=torch.float32, device=self.device)
                for k, info in self.params.items()
            }
            self._buffers = Sums(torch.zeros((), dtype=torch.float32, device=self.device), zeros, 0)
        buffers = self._buffers
        torch._foreach_zero_([buffers.loss, *buffers.grads.values()])
        return Sums(buffers.loss, dict(buffers.grads), 0)

    def release(self) -> None:
        if self.fused is not None:
            self.fused.release()

    def beside(self) -> contextlib.AbstractContextManager[None]:
        return self.fused.beside() if self.fused is not None else contextlib.nullcontext()

    def eval_step(self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray]) -> Any:
        out = self._eval({**batch, **params})
        return out["loss"], out.get("output")

    def activation_rms(
        self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray]
    ) -> dict[str, float]:
        if self._activations is None:
            self._activations = self._graph(self.compiled.activation_graph, self.device)
        out = self._activations({**batch, **params})
        return {path: float(value) for path, value in out.items()}
