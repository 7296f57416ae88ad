"""`TrainState`: one rank's parameters, gradient buffers and optimizer, on any device.

The device-side half of the step, written once over a backend's `StepGraphs`
(the compiled graphs, run on the device), `ArrayOps` (its arrays) and
`Stream` (the order its work runs in): the cpu device passes NumPy and the
host, the cuda device PyTorch tensors on its GPU and its stream. It is the
`sexpgpu.devices.base.Program` every device returns.

Allocation failures in a training step go through `sexpgpu.runtime.oom`:
the caches are released and the step retried; a second failure computes
each microbatch in halves (quarters...) where the graph allows it
(`sexpgpu.ir.compile.CompiledRun.pieces`), kept for the run; when nothing
more splits, E-MEM-002. The ``memory: allocation failed`` lines are kept
in `events` for the run's annotations.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from sexpgpu.devices.arrays import NUMPY, ArrayOps
from sexpgpu.devices.base import EvalResult, HostState
from sexpgpu.devices.collectives import (
    allgather_over_ranks,
    gather_over_ranks,
    gather_to_lead,
    scatter_over_ranks,
    sum_over_ranks,
)
from sexpgpu.devices.optim import Optimizer, global_norm, make_optimizer
from sexpgpu.devices.shard import Shards, shard_params
from sexpgpu.devices.stream import HostStream, Stream
from sexpgpu.ir.compile import CompiledRun, ParamInfo
from sexpgpu.runtime.oom import SplitState, call_with_split, release_caches

R = TypeVar("R")

__all__ = ["StepGraphs", "SummingGraphs", "Sums", "TrainState", "add_sums", "in_pieces", "summed"]


@dataclass
class Sums:
    """One optimizer step's running sums on the device: loss, gradients, microbatches."""

    loss: Any
    grads: dict[str, Any]
    count: int
    divisor: int = 1  # the mean gradient is `grads` over this many microbatches (`reduce`)


def summed(sums: Sums | None, loss: Any, grads: Mapping[str, Any]) -> Sums:
    """`sums` grown by one microbatch's outputs (the first one's become the buffers)."""
    if sums is None:
        return Sums(loss, dict(grads), 1)
    for k, g in grads.items():
        sums.grads[k] += g
    sums.loss = sums.loss + loss
    sums.count += 1
    return sums


class StepGraphs(Protocol):
    """A run's graphs on one device: what `TrainState` calls.

    Parameters and gradients are the backend's float32 arrays keyed by path
    name; batches arrive as host NumPy arrays (the graphs upload them).
    """

    compiled: CompiledRun
    params: Mapping[str, ParamInfo]
    has_activations: bool
    last_peak_bytes: int  # the most bytes the last call held at once
    # The parameters the training step reads as bf16 copies alone, never as f32
    # (cuda's fused bf16 step); where there are some, the graphs keep the copies:
    # `keep_copies_only`, `copies_of` and `idle_f32` (`sexpgpu.devices.cuda.step_graphs`).
    copies_only: Sequence[str]

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        """Initial parameters on the host (the same on every device)."""
        ...

    def train_step(self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray]) -> Any:
        """``(loss, grads)`` of one microbatch; the loss may stay on the device."""
        ...

    def accumulate(
        self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray], sums: Sums | None
    ) -> Sums:
        """`sums` (None at a step's first microbatch) grown by one microbatch.

        Either `summed` over `train_step`, or a kernel that sums in place; a
        call that fails to allocate leaves `sums` as it was.
        """
        ...

    def pieces(self, parts: int) -> StepGraphs | None:
        """These graphs at ``1 / parts`` of a microbatch's rows; None where the graph forbids."""
        ...

    def accumulate_pieces(
        self,
        params: Mapping[str, Any],
        batch: Mapping[str, np.ndarray],
        sums: Sums | None,
        parts: int,
    ) -> Sums:
        """`accumulate`, each microbatch computed in `parts` pieces of its rows."""
        ...

    def eval_step(self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray]) -> Any:
        """``(loss, output)`` of one microbatch."""
        ...

    def activation_rms(
        self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray]
    ) -> dict[str, float]:
        """Each call's root mean square on `batch`."""
        ...

    def release(self) -> None:
        """Drop what is kept only for speed (a captured step's memory); later calls remake it."""
        ...

    def beside(self) -> contextlib.AbstractContextManager[None]:
        """Where work beside the training step (an evaluation) allocates: in what it keeps."""
        ...


class SummingGraphs:
    """`StepGraphs.accumulate` as `summed` over ``train_step``: for graphs that return gradients."""

    copies_only: Sequence[str] = ()  # every parameter read as f32

    def release(self) -> None:
        pass  # nothing captured

    def beside(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # nothing kept between steps to draw on

    def accumulate(
        self, params: Mapping[str, Any], batch: Mapping[str, np.ndarray], sums: Sums | None
    ) -> Sums:
        return summed(sums, *self.train_step(params, batch))  # type: ignore[attr-defined]

    def accumulate_pieces(
        self,
        params: Mapping[str, Any],
        batch: Mapping[str, np.ndarray],
        sums: Sums | None,
        parts: int,
    ) -> Sums:
        # Microbatches held for a stacked call are computed now, in pieces too;
        # released only once that succeeds, so a retry starts over.
        held = self.held_batches()
        sums = add_sums(sums, in_pieces(self, params, [*held, batch], parts))
        held.clear()
        return sums

    def held_batches(self) -> list[Mapping[str, np.ndarray]]:
        """The microbatches `accumulate` holds for a later call (none here)."""
        return []


def in_pieces(
    graphs: Any, params: Mapping[str, Any], batches: list[Mapping[str, np.ndarray]], parts: int
) -> Sums:
    """The sums of `batches`, each computed in `parts` pieces of its rows by `graphs.pieces`.

    The pieces' losses and gradients are means over their rows, so a
    microbatch's are their sum over `parts` (a power of two: exact).
    """
    small = graphs.pieces(parts)
    assert small is not None, "split only where the graph allows it"
    total: Sums | None = None
    for batch in batches:
        for piece in _row_pieces(batch, graphs.compiled.rows, parts):
            total = summed(total, *small.train_step(params, piece))
    assert total is not None
    scale = 1.0 / parts
    total.loss = total.loss * scale
    total.grads = {k: g * scale for k, g in total.grads.items()}
    total.count = len(batches)
    return total


def _row_pieces(
    batch: Mapping[str, np.ndarray], rows: int, parts: int
) -> list[dict[str, np.ndarray]]:
    """`batch` cut in `parts` along the rows (fields without them, if any, go whole)."""
    step = rows // parts
    return [
        {
            name: array[lo : lo + step] if np.ndim(array) and len(array) == rows else array
            for name, array in batch.items()
        }
        for lo in range(0, rows, step)
    ]


def add_sums(sums: Sums | None, more: Sums) -> Sums:
    """`sums` (None at a step's first microbatch) grown by `more`, in place."""
    if sums is None:
        return more
    for k, g in more.grads.items():
        sums.grads[k] += g
    sums.loss = sums.loss + more.loss
    sums.count += more.count
    return sums


class TrainState:
    """A `Program` over `graphs` and `xp` (see `sexpgpu.devices.base`).

    Parameters
    ----------
    graphs
        The run's graphs on the device.
    xp, stream
        The device's arrays and stream (NumPy's and the host's by default).
    plan
        The run's `sexpgpu.runtime.memory.MemoryPlan`, named by E-MEM-002.
    """

    def __init__(
        self,
        graphs: StepGraphs,
        xp: ArrayOps = NUMPY,
        stream: Stream | None = None,
        *,
        plan: Any = None,
    ) -> None:
        self.graphs, self.xp = graphs, xp
        self.stream = stream if stream is not None else HostStream()
        self.params: Mapping[str, ParamInfo] = graphs.params
        self.values: dict[str, Any] = {}  # parameter arrays on the device
        self.optimizer: Optimizer | None = None
        self.events: list[str] = []
        self._split = SplitState()
        self._eval_split = SplitState()  # evaluation's own: a training step keeps its split
        self.plan = plan
        self._sums: Sums | None = None
        self._peak = 0
        self._comms: Any = None  # the ranks the optimizer state is sharded over, if it is
        self.shards: Shards | None = None
        # Sharded where the step reads bf16 copies alone (`start`): the parameters whose
        # f32 only their owners keep, this rank's of them, and the f32 stand-ins it feeds.
        self._copies_only: list[str] = []
        self.copies_alone: list[str] = []
        self._stand_ins: dict[str, Any] = {}
        self._full: dict[str, Any] | None = None  # every f32 parameter (`gather_params`)

    # -- state -----------------------------------------------------------------------------

    def start(
        self, optimizer: Any, *, seed: int, state: HostState | None, shard_over: Any = None
    ) -> None:
        xp = self.xp
        self._comms = shard_over if shard_over is not None and shard_over.size > 1 else None
        own = self.params
        if self._comms is not None:  # this rank's optimizer state alone
            sizes = {k: math.prod(info.shape) for k, info in self.params.items()}
            self.shards = shard_params(sizes, self._comms.size)
            own = {k: self.params[k] for k in self.shards.of(self._comms.rank)}
        self.optimizer = make_optimizer(
            optimizer,
            {k: info.shape for k, info in own.items()},
            {k: info.decay for k, info in own.items()},
            xp,
            self.stream,
            {k: info.hidden for k, info in own.items()},
        )
        host = self.graphs.init_params(seed) if state is None else state.params
        # Sharded, the f32 master weights the step reads as bf16 copies alone stay with
        # their owners: this rank keeps the copies of the others' (docs/devices.md).
        self._copies_only = list(self.graphs.copies_only) if self._comms is not None else []
        self.copies_alone = [k for k in self._copies_only if k not in own]
        kept = [k for k in self.params if k not in self.copies_alone]
        self.values = {k: xp.upload(np.asarray(host[k], np.float32)) for k in kept}
        self._stand_ins = {}
        if self.copies_alone:
            alone = {k: np.asarray(host[k], np.float32) for k in self.copies_alone}
            self._stand_ins = self.graphs.keep_copies_only(alone)
        self._full = None
        if state is not None and state.optimizer:  # parameters alone start a fresh optimizer
            self.optimizer.load(state.moments, state.optimizer)

    def gather_params(self) -> None:
        """Every rank together: each rank's f32 parameters whole, until its next step.

        Only where this rank keeps some as their bf16 copies alone: their f32
        comes from their owners into the gradient buffers, idle between steps.
        """
        if self._copies_only and self._full is None:
            assert self._sums is None, "between steps only: a step sums into that room"
            full = {**self.values, **self.graphs.idle_f32(self.copies_alone)}
            gather_over_ranks(self._comms, {k: full[k] for k in self._copies_only}, self.shards)
            self._full = {k: full[k] for k in self.params}

    def _f32(self) -> dict[str, Any]:
        """The f32 parameters whole (`gather_params` first where this rank keeps some as copies)."""
        if not self.copies_alone:
            return self.values
        assert self._full is not None, "gather_params() first: every rank together"
        return self._full

    def host_params(self) -> dict[str, np.ndarray]:
        """The parameters copied to the host (without the optimizer's moments)."""
        return {k: self.xp.download(v) for k, v in self._f32().items()}

    def host_state(self) -> HostState:
        """The state on the host; sharded, a collective whose moments rank 0 of node 0 holds."""
        assert self.optimizer is not None, "start() first"
        download = self.xp.download
        moments = {k: download(v) for k, v in self.optimizer.tensors().items()}
        if self._comms is not None:
            self.gather_params()
            everyone = gather_to_lead(self._comms, moments)
            moments = {} if everyone is None else self._in_order(everyone)
        return HostState(self.host_params(), moments, self.optimizer.scalars())

    def _in_order(self, moments: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`moments` in the order one rank keeps them: by moment, then parameter."""
        assert self.optimizer is not None
        keys = [f"{m}/{k}" for m in self.optimizer.moments for k in self.params]
        return {key: moments[key] for key in keys if key in moments}

    # -- the step --------------------------------------------------------------------------

    def accumulate(self, batch: Mapping[str, np.ndarray]) -> None:
        self._full = None  # the step writes the gradient buffers that held it
        self._sums = call_with_split(
            lambda parts: self._train(batch, parts),
            self._split,
            what="training step",
            can_split=lambda parts: self.graphs.pieces(parts) is not None,
            plan=self.plan,
        )
        self._peak = max(self._peak, int(self.graphs.last_peak_bytes))
        self._take_events()

    def _train(self, batch: Mapping[str, np.ndarray], parts: int) -> Sums:
        params = {**self.values, **self._stand_ins}
        if parts == 1:
            return self.graphs.accumulate(params, batch, self._sums)
        return self.graphs.accumulate_pieces(params, batch, self._sums, parts)

    def local_grad_norm(self) -> float:
        assert self._sums is not None, "accumulate() first"
        return global_norm(self._sums.grads, self.xp) / self._sums.count

    def reduce(self, ctx: Any, microbatches: int) -> float:
        """Sum the buffers over every rank (`sexpgpu.devices.collectives`), then the mean.

        `ctx` is a `Comms` (this node's group and the other nodes) or a bare
        `RankContext` of one node.
        """
        assert self._sums is not None, "accumulate() first"
        if self._comms is not None:  # each rank's shard's sums alone
            loss, grads = scatter_over_ranks(ctx, self._sums.loss, self._sums.grads, self.shards)
        else:
            loss, grads = sum_over_ranks(ctx, self._sums.loss, self._sums.grads)
        # The gradients stay sums: `update` takes their mean through the factor
        # it scales them by anyway (no pass of its own over every gradient).
        self._sums.grads, self._sums.divisor = grads, microbatches
        return self.stream.read_later(loss / microbatches)

    def update(self, lr: float, clip: float | None) -> Any:
        assert self._sums is not None and self.optimizer is not None
        if self._comms is not None:
            return self._update_shard(lr, clip)
        grads, optimizer, xp, stream = self._sums.grads, self.optimizer, self.xp, self.stream
        divisor = self._sums.divisor
        optimizer.advance(lr)

        def queue() -> Any:
            # The norm and the clipping factor stay on the device and go into the
            # update's own kernels: the host reads the norm once the update is queued.
            norm, scale = _mean_norm_and_scale(xp, xp.norm(list(grads.values())), clip, divisor)
            optimizer.queue(self.values, grads, scale)
            return norm

        # Everything the queued update touches: a backend may capture it and replay it.
        moments = [a for arrays in optimizer.state.values() for a in arrays.values()]
        arrays = [*self.values.values(), *grads.values(), *moments]
        norm = stream.replayed(("update", clip, divisor), arrays, queue)
        self._sums = None
        self._take_events()
        return stream.read_later(norm)  # the caller reads it once it has queued more

    def _update_shard(self, lr: float, clip: float | None) -> Any:
        """`update` of this rank's shard, then every rank's parameters on every rank.

        The norm is summed from every parameter's square in parameter order
        (the shards are contiguous, in rank order), as one rank sums it. Not
        captured for replay: collectives run between its parts.
        """
        assert self._sums is not None and self.optimizer is not None and self._comms is not None
        grads, xp, divisor = self._sums.grads, self.xp, self._sums.divisor
        self.optimizer.advance(lr)
        squares = allgather_over_ranks(self._comms, xp.square_norms(list(grads.values())).tolist())
        summed = xp.norm_from(np.array([s for part in squares for s in part], np.float64))
        norm, scale = _mean_norm_and_scale(xp, summed, clip, divisor)
        if grads:  # a rank past the last parameter owns none
            self.optimizer.queue({k: self.values[k] for k in grads}, grads, scale)
        self._gather_update()
        self._sums = None
        self._take_events()
        return self.stream.read_later(norm)

    def _gather_update(self) -> None:
        """The owners' updated parameters on every rank: bf16 copies where kept as copies alone."""
        alone = set(self._copies_only)
        f32 = {k: v for k, v in self.values.items() if k not in alone}
        if f32:
            gather_over_ranks(self._comms, f32, self.shards)
        if alone:
            # Owners' copies current (an update may leave them to the next cast), then
            # written in place into the others' (not counted in their stand-ins' versions).
            params = {k: self.values.get(k, self._stand_ins.get(k)) for k in self._copies_only}
            gather_over_ranks(self._comms, self.graphs.copies_of(params), self.shards)

    @property
    def asynchronous(self) -> bool:
        return bool(self.stream.asynchronous)

    # -- evaluation and diagnostics ----------------------------------------------------------

    # Both run op by op in the memory the training step keeps between its calls (a CUDA
    # graph's, `StepGraphs.beside`): where memory runs out, that goes first, then the batch
    # is split.

    def evaluate(self, batch: Mapping[str, np.ndarray], target: str | None) -> EvalResult:
        def pieces(graphs: StepGraphs, piece: Mapping[str, np.ndarray]) -> EvalResult:
            loss, output = graphs.eval_step(self._f32(), piece)
            if target is None:
                return EvalResult(float(loss))
            truth = piece[target]
            return EvalResult(float(loss), self.xp.argmax_hits(output, truth), int(truth.size))

        results = self._beside_the_step(batch, pieces, "evaluation")
        # Equal pieces of a loss that is a mean over rows (`CompiledRun.pieces`).
        loss = results[0].loss if len(results) == 1 else sum(r.loss for r in results) / len(results)
        return EvalResult(loss, sum(r.correct for r in results), sum(r.count for r in results))

    @property
    def has_activations(self) -> bool:
        return bool(self.graphs.has_activations)

    def activation_rms(self, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        results = self._beside_the_step(
            batch, lambda graphs, piece: graphs.activation_rms(self._f32(), piece), "diagnostics"
        )
        if len(results) == 1:
            return results[0]
        # A root mean square over equal pieces: the root of their squares' mean.
        return {k: math.sqrt(sum(r[k] ** 2 for r in results) / len(results)) for k in results[0]}

    def _beside_the_step(
        self,
        batch: Mapping[str, np.ndarray],
        fn: Callable[[StepGraphs, Mapping[str, np.ndarray]], R],
        what: str,
    ) -> list[R]:
        """``fn(graphs, piece)`` over the batch's pieces (one at first), as memory allows."""

        def split(parts: int) -> list[R]:
            if parts == 1:
                with self.graphs.beside():
                    return [fn(self.graphs, batch)]
            graphs = self.graphs.pieces(parts)
            assert graphs is not None, "split only where the graph allows it"
            rows = self.graphs.compiled.rows
            return [fn(graphs, piece) for piece in _row_pieces(batch, rows, parts)]

        def whole_rows(parts: int) -> bool:
            rows = self.graphs.compiled.rows
            fit = all(len(a) == rows for a in batch.values() if np.ndim(a))
            return fit and self.graphs.pieces(parts) is not None

        results = call_with_split(
            split,
            self._eval_split,
            what=what,
            can_split=whole_rows,
            plan=self.plan,
            release=self._release,
        )
        self._take_events()
        return results

    def _release(self) -> None:
        """Free the memory kept between steps for speed: the step's and update's captures."""
        self.graphs.release()
        self.stream.forget()
        release_caches()

    def take_peak(self) -> int:
        peak, self._peak = self._peak, 0
        return peak

    def _take_events(self) -> None:
        for source in (self._split.events, self._eval_split.events, self.stream.events):
            if source:
                self.events += source
                source.clear()


def _mean_norm_and_scale(xp: Any, norm: Any, clip: float | None, divisor: int) -> tuple[Any, Any]:
    """The mean gradient's norm, from the summed one's, and the factor the update scales
    the summed gradients by: the clipping factor over `divisor` (None: one)."""
    if divisor != 1:  # of the mean gradient, which the update sees through `scale`
        norm = norm / divisor
    return norm, _times(xp.clip_scale(norm, clip), 1 / divisor)


def _times(scale: Any, factor: float) -> Any:
    """`scale` (None: one, a host number or a device scalar) times the host number `factor`."""
    if factor == 1:
        return scale
    return factor if scale is None else scale * factor
