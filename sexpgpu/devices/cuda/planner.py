"""`Planner`: what the cuda device decides for a run before anything is allocated.

One `sexpgpu.devices.cuda.device.CudaDevice.plan` call makes a `Planner`,
which makes each candidate stacking degree's graphs once (the stacked
graph, its schedule's live set, its compiled step), chooses the degree
(`sexpgpu.devices.cuda.stacking`), measures the chosen step's live set
with a dry call where a GPU runs it, and returns everything as one value,
`CudaPlan`, which the device's `report` and `load` take. Nothing outlives
the call but that value, and the numbers each degree's graph gave (live
set, FLOPs, nodes), kept in the compile cache: a later plan of the same
graphs reads them there and stacks and schedules only the degree it
chooses. They are functions of the graphs, nothing timed, so the plan is
the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from sexpgpu.devices.cuda.parallel_compile import CompilePool
from sexpgpu.devices.optim import moment_count
from sexpgpu.devices.shard import largest_shard, master_elements
from sexpgpu.ir.compile import CompiledRun, matmul_flops
from sexpgpu.ir.dtypes import DType, numpy_dtype
from sexpgpu.ir.node import Graph
from sexpgpu.ir.ops import Op
from sexpgpu.ir.printer import format_graph
from sexpgpu.ir.recompute import Recomputation, cheap, fit, recompute_graph
from sexpgpu.ir.siblings import merge_siblings
from sexpgpu.runtime.memory import MemoryPlan, call_peak_bytes, detect_budget

if TYPE_CHECKING:
    from sexpgpu.devices.cuda.compile_cache import StepCache
    from sexpgpu.devices.cuda.fused import FusedGraph
    from sexpgpu.devices.cuda.stacking import Choice

__all__ = ["CudaPlan", "Planner", "fused_base", "fused_graph"]


def fused_base(graph: Graph) -> tuple[Graph, int]:
    """`graph` as a fusing device runs it, and how many cheap values it makes again.

    Its sibling products made one (`sexpgpu.ir.siblings`), and its cheap
    values made again in the backward, by the fused kernels that read them
    (`sexpgpu.ir.recompute.cheap`).
    """
    graph = merge_siblings(graph, "loss")
    roots = cheap(graph, into_products=CHEAP_INTO_PRODUCTS)
    return (recompute_graph(graph, roots) if roots else graph), len(roots)


class PlanningDevice(Protocol):
    """What a `Planner` reads of its device (`sexpgpu.devices.cuda.device.CudaDevice`).

    A protocol, not an import: the device imports the planner.
    """

    torch: Any
    kind: str  # "cuda", or "cpu" for PyTorch's CPU device
    first: str  # the torch device the plan is made on
    on_gpu: bool
    fuse: bool
    deterministic: bool
    cache: StepCache | None

    @property
    def captures(self) -> bool: ...

    def library_workspace(self, cublaslt: bool = True) -> int: ...

    def device_name(self) -> str: ...


@dataclass(frozen=True)
class CudaPlan:
    """What `CudaDevice.plan` decided for a run; `report` and `load` take it.

    Attributes
    ----------
    compiled
        The run.
    memory
        The most one GPU holds at once, by part.
    microbatches
        Microbatches per rank and step.
    choice
        The stacking degree and why.
    stacked
        The training graph at that degree (the graph itself at 1).
    fused
        `stacked` compiled for the first device (`FusedGraph`), why it cannot
        be (a string), or None where nothing was compiled (op by op, or no
        GPU to compile for: a run compiles it when it loads).
    live
        (bytes, where) of the larger live set: the schedule's node at the
        peak, or the name of the call a dry call measured.
    copy_bytes
        The fused step's bf16 parameter copies (`sexpgpu.devices.cuda.param_copies`).
    lowering
        The lowering report's lines of the training graph's schedule.
    recompute
        What the training graph at that degree recomputes to fit
        (`sexpgpu.ir.recompute`), or None where it fits as compiled.
    """

    compiled: CompiledRun
    memory: MemoryPlan
    microbatches: int
    choice: Choice
    stacked: Graph
    fused: FusedGraph | str | None
    live: tuple[int, Any]
    copy_bytes: int
    lowering: tuple[str, ...]
    recompute: Recomputation | None = None


# How many times a plan whose compiled step does not fit recomputes more before E-MEM-001.
_REFITS = 2
# How many of the step's largest buffers a plan made to fit leaves free for its CUDA
# graph's capture (`Planner._capture_room`); where that cannot fit, the plan fits without.
CAPTURE_ROOM = 1
# The share of its budget a plan made to fit leaves free where it can, else as much of it
# as it can (`Planner._rooms`): the allocator's stranded blocks and what a run allocates
# beside the step. A 2.47B Llama planned to 40.0 of 40.0 GiB ran out in its first plain
# call, asking 342 MiB with 0.2 GiB stranded in free blocks.
HEADROOM = 0.01
# Whether the cheap values a product reads are made again too (`recompute.cheap`): less
# memory, a pass more each; benches/gpt2_cuda.py's side `sexpgpu-products` measures it.
CHEAP_INTO_PRODUCTS = False


def _same(a: Recomputation, b: Recomputation) -> bool:
    """Whether two searches chose the same step (each search rewrites its graph anew)."""
    return (a.values, a.flops) == (b.values, b.flops)


def _room_left(plan: MemoryPlan, room: int) -> bool:
    """Whether `plan` fits its budget with `room` bytes to spare."""
    return plan.total + room <= plan.budget.nbytes


class Planner:
    """One `CudaDevice.plan` call's work: each candidate degree's graphs, made once.

    It lives for the call; what it decides goes into the `CudaPlan` it returns.
    """

    def __init__(
        self, device: PlanningDevice, compiled: CompiledRun, per_rank: int, pool: CompilePool
    ) -> None:
        self.device, self.compiled, self.per_rank, self.pool = device, compiled, per_rank, pool
        self.torch = device.torch
        self.first = self.torch.device(device.first)
        self._gpu = device.kind == "cuda"  # planned as a GPU runs it, here or on the CPU
        self._stacks: dict[int, Graph] = {}
        # Per degree: the graph a fitting call runs, and its cheap values made again (`_base`).
        self._bases: dict[int, tuple[Graph, int]] = {}
        self._recompute: dict[int, Recomputation] = {}  # per degree, where nothing fits without
        self._headroom = 0  # bytes a plan made to fit leaves free where it can (`plan` sets it)
        self._room_sizes: dict[int, tuple[int, ...]] = {}  # per degree, `_rooms`
        # (id(graph), whether its call is the whole step) -> (graph, live set)
        self._live: dict[tuple[int, bool], tuple[Graph, tuple[int, Any]]] = {}
        self._fused: dict[int, FusedGraph | str] = {}
        self._eval: tuple[int, Any] | None = None
        # Per degree (live set bytes, products' FLOPs, nodes): those the cache held, then
        # those computed here (`_numbers`).
        self._text = format_graph(compiled.train_graph, spans=False)
        self._key = self._plan_key()
        kept = self._remembered()
        self._known: dict[int, tuple[int, int, int]] = kept["degrees"]
        self._computed: dict[int, tuple[int, int, int]] = {}
        # The evaluation graph's peak a dry call measured (None: not yet), kept beside them.
        self._eval_peak: int | None = kept["eval_peak"]
        self._eval_peak_new = False

    def plan(self, optimizer: str, ranks: int, memory: int | None, shards: int = 1) -> CudaPlan:
        device = self.device
        moments = moment_count(optimizer)
        scratch = _update_scratch(optimizer, self.compiled)
        budget = detect_budget(device.first, memory)
        self._headroom = int(HEADROOM * budget.nbytes)

        def plan_at(
            degree: int, live: tuple[int, Any], copy_bytes: int = 0, copies_only: Any = ()
        ) -> MemoryPlan:
            # Sharded, a GPU keeps its shard's moments alone, and the f32 of the parameters
            # the step reads as bf16 copies alone (devices/shard.py).
            moment_elements = moments * largest_shard(self.compiled, shards)
            masters = 4 * master_elements(self.compiled, shards, copies_only)
            parts = self._parts(
                degree, moment_elements, ranks, live[0], copy_bytes, masters, scratch
            )
            return MemoryPlan(budget, parts)

        # A fused step that does not recompute reads bf16 copies the update keeps all step.
        copies = _copy_bytes(self.compiled.train_graph) if device.fuse else 0

        def copy_bytes_at(degree: int) -> int:
            return 0 if degree in self._recompute else copies

        def fits(degree: int, graph: Graph | None = None, room: int = 0) -> bool:
            if graph is None:
                live = (self._numbers(degree)[0], None)
                return plan_at(degree, live, copy_bytes_at(degree)).fits
            return _room_left(plan_at(degree, self._live_of(graph, self._whole(degree))), room)

        if not any(fits(d) for d in self._degrees()):
            # Recomputation, chosen with the degree: the least that fits at each one,
            # judged by the schedule (no compile); larger degrees need more. A plan made
            # to fit leaves its CUDA graph's pool room (`_capture_room`) where it can,
            # else the allocator's headroom where it can (`_rooms`).
            for d in reversed(self._degrees()):
                found = self._fit(d, lambda g, room, d=d: fits(d, g, room))
                assert found is not None  # the stacked graph does not fit
                self._recompute[d] = found
                if not found.fits:
                    break
        choice = self._choose(fits)
        self._remember()
        degree = choice.degree
        measures = device.captures and device.on_gpu  # a dry call measures the step it plans
        live, copy_bytes = self._first_live(degree, measures), copy_bytes_at(degree)
        memory_plan = plan_at(degree, live, copy_bytes)
        # Only a plan that fits is worth a compile and a dry call (E-MEM-001 comes next otherwise).
        if measures and memory_plan.fits:
            # The best measured step so far by `_standing`, kept while a better one is sought.
            best = None
            for attempt in range(_REFITS + 1):
                measured = self._dry_call(degree)
                if measured is None:
                    break
                missed = measured[0][0] - live[0]  # Inductor's buffers beyond the schedule
                live, copy_bytes = measured
                only = self._fused_graph(degree).copies_only  # type: ignore[union-attr]
                memory_plan = plan_at(degree, live, copy_bytes, only)
                standing = self._standing(degree, memory_plan)
                rank = self._ranked(standing, memory_plan)
                if best is None or rank > best[0]:
                    step = self._recompute.get(degree), self._fused.get(degree)
                    best = rank, step, live, copy_bytes, memory_plan
                if standing == len(self._wanted(degree)) or attempt == _REFITS:
                    break
                if not self._refit(degree, missed, plan_at, standing):
                    break
                live, copy_bytes = self._live_set(degree), copy_bytes_at(degree)
            now = self._ranked(self._standing(degree, memory_plan), memory_plan)
            if best is not None and best[0] > now:
                _, (recompute, fused), live, copy_bytes, memory_plan = best
                self._recompute.pop(degree, None)
                self._fused.pop(degree, None)
                if recompute is not None:
                    self._recompute[degree] = recompute
                if fused is not None:
                    self._fused[degree] = fused
        if live[1] is None:  # not measured after all: the schedule names where it peaks
            live = self._live_set(degree)
        # Compiled here where a device can run it; without a GPU, the run's load compiles it.
        compiles = device.fuse and (device.on_gpu or device.kind == "cpu")
        recompute = self._recompute.get(degree)
        compiled = self.compiled
        if degree == 1 and self._graph(1) is not compiled.train_graph:  # op by op too
            compiled = compiled.with_train_graph(self._graph(1))
        schedule = _lowering_lines(compiled.train_graph, self.first)
        made = self._bases.get(degree, (None, 0))[1]
        if recompute is None and made:
            schedule.insert(0, _cheap_line(made))
        return CudaPlan(
            compiled=compiled,
            memory=memory_plan,
            microbatches=self.per_rank,
            choice=choice,
            stacked=self._graph(degree),
            fused=self._fused_graph(degree) if compiles else None,
            live=live,
            copy_bytes=copy_bytes,
            lowering=tuple(schedule),
            recompute=recompute,
        )

    def _capture_room(self, degree: int) -> int:
        """Room a step made to fit leaves beyond its plan for the capture of its CUDA graph.

        The capture allocates the call's live set again in a pool of its own,
        whose freed blocks serve only requests that fit in them: on a 2.3B
        Llama planned to 0.4 GiB of a 40 GiB card, the capture ran out asking
        342 MiB with 625 MiB stranded in free blocks and 79 MiB in the default
        pool's cache (benches/README.md), about 0.7 GiB beyond the plain call's
        peak, where the step's largest buffer (its logits) is 1.0 GiB. So the
        room is `CAPTURE_ROOM` of the step's largest buffers; a step that
        captures none needs none.
        """
        if not self.device.captures:
            return 0
        nodes = self._stacked(degree).nodes()
        return CAPTURE_ROOM * max(n.size * numpy_dtype(n.dtype).itemsize for n in nodes)

    def _rooms(self, degree: int) -> tuple[int, ...]:
        """What a step made to fit at `degree` leaves free beyond its plan, most wanted first.

        Its capture's room, else the allocator's headroom, else as much of
        the headroom as it can (a half, a quarter), else nothing. The rooms
        nest: a step that leaves one leaves every smaller one.
        """
        if degree not in self._room_sizes:
            h, capture = self._headroom, self._capture_room(degree)
            self._room_sizes[degree] = tuple(sorted({capture, h, h // 2, h // 4, 0}, reverse=True))
        return self._room_sizes[degree]

    def _wanted(self, degree: int) -> tuple[int, ...]:
        """`_rooms` for a step that recomputes; one that recomputes nothing only has to fit."""
        return self._rooms(degree) if degree in self._recompute else (0,)

    def _standing(self, degree: int, plan: MemoryPlan) -> int:
        """How many of `_wanted(degree)` `plan` leaves: all is the best, 0 does not fit."""
        return sum(_room_left(plan, room) for room in self._wanted(degree))

    @staticmethod
    def _ranked(standing: int, plan: MemoryPlan) -> tuple[int, int]:
        """How a measured step ranks: by `_standing`, then, where it leaves no room but
        fits, by the bytes it leaves (the allocator's only slack)."""
        return standing, plan.budget.nbytes - plan.total if standing == 1 else 0

    def _fit(
        self, degree: int, fits: Callable[[Graph, int], bool], better: int = 0
    ) -> Recomputation | None:
        """The least recomputation at `degree` that leaves the most of `_rooms` it can.

        `fits(graph, room)` judges a candidate: each room in turn, most
        wanted first, until one fits. A step that leaves the `better` smallest
        rooms already looks only among the larger ones. None where the
        stacked graph fits as it is.
        """
        found = None
        rooms = self._rooms(degree)
        for room in rooms[: len(rooms) - better]:
            found = fit(self._stacked(degree), lambda g, r=room: fits(g, r), matmul_flops)
            if found is None or found.fits:
                break
        return found

    def _refit(
        self, degree: int, missed: int, plan_at: Callable[..., MemoryPlan], standing: int
    ) -> bool:
        """Recompute more at `degree`, as if each schedule held `missed` bytes more; if it can.

        The compiled step held `missed` bytes beyond the schedule's estimate,
        and did not fit or left less room than wanted (its `_standing`); the
        search runs again against the estimate plus those bytes, among the
        rooms it did not leave, and a different graph is compiled and measured
        in its place.
        """
        old = self._recompute.get(degree)
        whole = self._whole(degree)

        def fits(g: Graph, room: int) -> bool:
            return _room_left(plan_at(degree, (self._live_of(g, whole)[0] + missed, None)), room)

        found = self._fit(degree, fits, better=standing)
        if found is not None and not found.fits and standing == 1 and fits(found.graph, 0):
            # No step leaves a room, but the one that recomputes the most leaves more bytes
            # than one that fits to the last of them: measured in its place, the better kept.
            found = replace(found, fits=True)
        if found is None or not found.fits or (old is not None and _same(found, old)):
            return False
        self._recompute[degree] = found
        self._fused.pop(degree, None)
        return True

    def _degrees(self) -> list[int]:
        """The stacking degrees a call may run, largest first (1 only op by op)."""
        from sexpgpu.devices.cuda.stacking import degrees

        return degrees(self.per_rank) if self.device.fuse else [1]

    def _graph(self, degree: int) -> Graph:
        """The training graph a call at `degree` runs: stacked, recomputing where chosen."""
        recompute = self._recompute.get(degree)
        return self._base(degree) if recompute is None else recompute.graph

    def _parts(
        self,
        degree: int,
        moment_elements: int,
        ranks: int,
        live: int,
        copy_bytes: int,
        masters: int,
        scratch: int,
    ) -> dict[str, int]:
        device, compiled = self.device, self.compiled
        params = 4 * compiled.param_count
        constants = _constant_bytes(compiled.train_graph)
        fed = _fed_param_bytes(compiled.train_graph)
        largest = max((4 * info.size for info in compiled.params.values()), default=0)
        if self._whole(degree):
            # The call returns the gradients, made as it goes: its live set counts them.
            # Sharded, room for the f32 of the parameters kept as copies alone
            # (`TorchGraphs.idle_f32`), where there are some: about what `masters` saves.
            gradients = params - masters + largest if masters < params else 0
        else:
            gradients = params if device.fuse or self.per_rank > 1 else 0
        return {
            "parameters": masters,  # sharded, less where the step reads bf16 copies alone
            # The fused call's bf16 copies (param_copies.py): measured calls leave them out.
            "parameter copies": copy_bytes,
            "optimizer": 4 * moment_elements,
            "gradients": gradients,
            "constants": constants,
            "activations": max(0, live - fed - constants),
            # The libraries', and the update rule's scratch (`UPDATE_SCRATCH`).
            "workspace": device.library_workspace(self._calls_cublaslt(degree)) + scratch,
            # NCCL sums packed copies of the gradients (devices/cuda/collectives.py).
            "collectives": params if ranks > 1 else 0,
        }

    def _calls_cublaslt(self, degree: int) -> bool:
        """Whether the call at `degree` runs cuBLASLt's products: counted until its trace says."""
        fused = self._fused.get(degree)
        return fused is None or (not isinstance(fused, str) and fused.calls_cublaslt)

    def _stacked(self, degree: int) -> Graph:
        """The training graph running `degree` microbatches per call (1: the graph itself)."""
        from sexpgpu.ir.stack import stack_microbatches

        if degree == 1:
            return self.compiled.train_graph
        if degree not in self._stacks:
            self._stacks[degree] = stack_microbatches(self.compiled.train_graph, degree)
        return self._stacks[degree]

    def _base(self, degree: int) -> Graph:
        """`_stacked` as a fusing device runs it when it fits without recomputing.

        `fused_base` on a fusing device. Recomputation to fit starts from the
        stacked graph itself: its checkpointing makes those values again with
        their segments anyway, and keeps back products one by one.
        """
        if degree not in self._bases:
            graph = self._stacked(degree)
            self._bases[degree] = fused_base(graph) if self.device.fuse else (graph, 0)
        return self._bases[degree][0]

    def _numbers(self, degree: int) -> tuple[int, int, int]:
        """(live set bytes, products' FLOPs, nodes) of the training graph a call at `degree` runs.

        From the compile cache where an earlier plan of these graphs kept them
        (the degree is then neither stacked nor scheduled), else from the graph.
        """
        if degree in self._recompute:  # a recomputing graph's: never kept
            graph = self._graph(degree)
            return self._live_set(degree)[0], matmul_flops(graph), len(graph.nodes())
        if degree in self._known:
            return self._known[degree]
        if degree not in self._computed:
            graph = self._base(degree)
            self._computed[degree] = (
                self._live_set(degree)[0],
                matmul_flops(graph),
                len(graph.nodes()),
            )
        return self._computed[degree]

    def _plan_key(self) -> str | None:
        """The key of this plan's numbers in the compile cache, or None where none are kept."""
        from sexpgpu.devices.cuda.compile_cache import plan_key
        from sexpgpu.devices.cuda.compile_worker import settings

        if self.device.cache is None:
            return None
        return plan_key(
            self._text,
            format_graph(self.compiled.eval_graph, spans=False),
            self.first,
            degrees=self._degrees(),
            settings=settings(),
        )

    def _remembered(self) -> dict[str, Any]:
        """What an earlier plan of these graphs kept (nothing where absent or damaged).

        ``degrees``: per degree, `_numbers`; ``eval_peak``: the evaluation
        graph's peak a dry call measured, or None.
        """
        from sexpgpu.devices.cuda.compile_cache import kept_bytes

        entry = {} if self._key is None else self.device.cache.load(self._key, kind="plan") or {}
        numbers = entry.get("degrees")
        numbers = numbers if isinstance(numbers, dict) else {}
        return {
            "degrees": {
                d: tuple(n)
                for d, n in numbers.items()
                if isinstance(d, int)
                and isinstance(n, tuple)
                and len(n) == 3
                and all(isinstance(x, int) for x in n)
            },
            "eval_peak": kept_bytes(entry.get("eval_peak")),
        }

    def _remember(self) -> None:
        """Keep what was computed or measured here beside what was found, for the next plan."""
        if self._key is not None and (self._computed or self._eval_peak_new):
            numbers = {**self._known, **self._computed}
            entry = {"degrees": numbers, "eval_peak": self._eval_peak}
            self.device.cache.save(self._key, entry, kind="plan")
            self._known, self._computed, self._eval_peak_new = numbers, {}, False

    def _first_live(self, degree: int, measures: bool) -> tuple[int, Any]:
        """The live set a plan at `degree` starts from.

        Where a dry call will measure the step, the bytes the degree's
        numbers hold, without the node at the peak (on a warm start they are
        the compile cache's, and the schedule is not made again: 0.4 s of
        GPT-2 small's under cProfile); else `_live_set`.
        """
        if measures and degree not in self._recompute:
            return self._numbers(degree)[0], None
        return self._live_set(degree)

    def _live_set(self, degree: int) -> tuple[int, Any]:
        """(bytes, node at the peak) of the larger of the training and evaluation schedules."""
        return self._live_of(self._graph(degree), self._whole(degree))

    def _live_of(self, graph: Graph, whole: bool) -> tuple[int, Any]:
        """`_live_set` of a training graph (a degree's, or a recomputing candidate).

        A `whole` step's call returns its gradients: they are counted from
        when each is made (the gradient buffers of a step of several calls
        are a part of the plan of their own).
        """
        key = (id(graph), whole)
        if key not in self._live:
            train = _schedule_peak(graph, self.torch, whole, self._gpu)
            self._live[key] = (graph, max(train, self._eval_live(), key=_bytes))
        return self._live[key][1]

    def _whole(self, degree: int) -> bool:
        """Whether a call at `degree` is a whole step, fused: it returns its gradients."""
        return self.device.fuse and degree == self.per_rank

    def _eval_live(self) -> tuple[int, Any]:
        if self._eval is None:
            self._eval = _schedule_peak(self.compiled.eval_graph, self.torch, gpu=self._gpu)
        return self._eval

    def _fused_graph(self, degree: int) -> FusedGraph | str:
        """The training graph at `degree` compiled for the first device, or why it cannot be.

        Kept for the call: the measurement, the dry call and the plan share it.
        """
        if degree not in self._fused:
            self._fused[degree] = fused_graph(
                self._graph(degree),
                self.first,
                self.torch,
                # A step of one call returns its sums, each made as the backward goes.
                whole_step=degree == self.per_rank,
                pool=self.pool,
                cache=self.device.cache,
                recomputes=degree in self._recompute,
            )
        return self._fused[degree]

    def _dry_call(self, degree: int) -> tuple[tuple[int, Any], int] | None:
        """The live set and copy bytes measured over calls on zeros, or None where it cannot be.

        The training side is the fused call's; the evaluation graph, which
        runs op by op, is called on zeros too (its schedule's estimate counts
        every f32 row cross-entropy may hold). Both peaks are kept in the
        compile cache (the step's entry, the plan's) and read from it by a
        later plan of the same graphs on the same GPU and libraries, which
        then calls neither.
        """
        from sexpgpu.devices.cuda.executor import TorchGraph

        fused = self._fused_graph(degree)
        if isinstance(fused, str):
            return None
        peak = fused.call_peak_bytes(_zero_feeds(fused.graph, self.torch, fused.device))
        if peak is None:
            return None
        compiled = self.compiled
        measured = self._eval_peak
        if measured is None:
            graph = TorchGraph(compiled.eval_graph, self.first)
            feeds = _zero_feeds(compiled.eval_graph, self.torch, self.first)
            measured = call_peak_bytes(self.first, lambda: graph(feeds))
            if measured is not None:
                self._eval_peak, self._eval_peak_new = measured, True
                self._remember()
        if measured is not None:
            evaluation = (measured + _leaf_bytes(compiled.eval_graph), "evaluation graph")
        else:
            evaluation = self._eval_live()
        train = (peak + _leaf_bytes(fused.graph), "fused training call")
        return max(train, evaluation, key=_bytes), fused.copy_bytes

    def _choose(self, fits: Callable[[int], bool]) -> Choice:
        """The stacking degree (see `sexpgpu.devices.cuda.stacking`)."""
        from sexpgpu.devices.cuda.stacking import (
            Choice,
            CostModel,
            choices_path,
            choose,
            degrees,
            graph_key,
        )

        device, compiled, per_rank = self.device, self.compiled, self.per_rank
        if not device.fuse:
            return Choice(1, "op by op, one microbatch per call")
        fitting = [d for d in degrees(per_rank) if d == 1 or fits(d)]
        bf16 = any(n.dtype is DType.BF16 for n in compiled.train_graph.nodes() if n.op is Op.MATMUL)
        model = CostModel.for_dtype("bf16" if bf16 else "f32")
        model_ms = {}
        for d in fitting:
            live, flops, nodes = self._numbers(d)
            moved = 3 * 4 * compiled.param_count + live
            model_ms[d] = model.step_ms(per_rank // d, flops, moved, nodes)
        return choose(
            fitting,
            model_ms,
            key=graph_key(self._text, device.device_name(), per_rank),
            # Deterministic runs measure nothing: a measurement may change between runs.
            path=None if device.deterministic and device.on_gpu else choices_path(),
            measure=self._measure if device.on_gpu else None,
        )

    def _measure(self, degree: int) -> float:
        """Milliseconds of one step's calls at `degree` on the first GPU (zeros fed)."""
        torch = self.torch
        fused = self._fused_graph(degree)
        if isinstance(fused, str):
            return float("inf")
        feeds = _zero_feeds(fused.graph, torch, fused.device)
        buffers = fused.zero_buffers()
        for _ in range(3):  # a plain call, the capture, a replay
            fused(feeds, buffers, zeros=True)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 5
        start.record()
        for _ in range(reps):
            fused(feeds, buffers, zeros=True)
        stop.record()
        stop.synchronize()
        # The capture on zeros and its memory go: the run's first call (plain) would
        # otherwise run beside them.
        fused.release()
        return start.elapsed_time(stop) / reps * (self.per_rank // degree)


def fused_graph(
    graph: Graph,
    device: Any,
    torch: Any,
    *,
    whole_step: bool,
    pool: CompilePool | None = None,
    cache: StepCache | None = None,
    recomputes: bool = False,
) -> FusedGraph | str:
    """`graph` compiled for `device`, or why it cannot be.

    A call that is a `whole_step` returns its sums; otherwise it adds them
    into buffers. A graph that `recomputes` to fit casts each parameter where
    it reads it (bf16 copies kept all step would cost 2 bytes a parameter the
    plan has not got) and keeps the schedule's order, whose live set the plan
    counted; otherwise it reads the bf16 copies the update keeps.
    """
    from sexpgpu.devices.cuda.fused import FusedGraph, NotFusable

    try:
        return FusedGraph(
            graph,
            device,
            sums=[] if whole_step else list(graph.outputs),
            examples=_zero_feeds(graph, torch, device),
            pool=pool,
            cache=cache,
            copies=not recomputes,
            in_order=recomputes,
        )
    except NotFusable as why:
        return str(why)


def _update_scratch(optimizer: str, compiled: CompiledRun) -> int:
    """The largest scratch of `optimizer`'s rules a GPU may run (`TorchOps.backends`)."""
    import sexpgpu.devices.cuda.adamw  # noqa: F401  (registers the GPU's rules)
    from sexpgpu.devices.update_rules import scratch_bytes

    shapes = [tuple(info.shape) for info in compiled.params.values()]
    return scratch_bytes(optimizer, ("triton", "torch"), shapes)


def _cheap_line(values: int) -> str:
    return (
        f"made again in the backward: {values} values of one pass over kept inputs "
        "(in the kernels that read them)"
    )


def _lowering_lines(graph: Graph, device: Any) -> list[str]:
    """The lowering report of `graph`'s op-by-op schedule on `device`."""
    from sexpgpu.devices.cuda.executor import TorchGraph

    return TorchGraph(graph, device).report_lines()


def _schedule_peak(
    graph: Graph, torch: Any, held: bool = False, gpu: bool = False
) -> tuple[int, Any]:
    """(bytes, node at the peak) of `graph`'s op-by-op schedule, planned on the CPU.

    `held`: with the parameters held for the whole call (`TorchGraph.peak_with_params_held`);
    `gpu`: as a GPU runs it (sexpgpu's Triton kernels).
    """
    from sexpgpu.devices.cuda.executor import TorchGraph

    # Planning allocates only small constants.
    plan = TorchGraph(graph, torch.device("cpu"), kernels=gpu)
    return plan.peak_with_params_held() if held else (plan.planned_peak_bytes, plan.peak_node)


def _bytes(live: tuple[int, Any]) -> int:
    return live[0]


def _zero_feeds(graph: Graph, torch: Any, device: Any) -> dict[str, Any]:
    """Zeros for every fed leaf: the trace runs once on them (0 is a valid id)."""
    feeds: dict[str, Any] = {}
    for node in graph.nodes():
        if node.op is Op.INPUT:
            feeds[node.name] = np.zeros(node.shape, numpy_dtype(node.dtype))
        elif node.op is Op.PARAM:
            feeds[node.name] = torch.zeros(node.shape, dtype=torch.float32, device=device)
    return feeds


def _constant_bytes(graph: Graph) -> int:
    from sexpgpu.devices.cuda.executor import made_once_bytes

    return sum(made_once_bytes(n) for n in graph.nodes() if n.op in (Op.CONSTANT, Op.IOTA))


def _leaf_bytes(graph: Graph) -> int:
    """What a dry call's live set leaves out: the fed parameters and the constants."""
    return _fed_param_bytes(graph) + _constant_bytes(graph)


def _copy_bytes(graph: Graph) -> int:
    """The bf16 copies of `graph`'s parameters a fused step reads (`param_copies.py`)."""
    cast = {
        id(x)
        for n in graph.nodes()
        if n.op is Op.CAST and n.dtype is DType.BF16
        for x in n.inputs
        if x.op is Op.PARAM
    }
    return sum(2 * p.size for p in graph.params.values() if id(p) in cast)


def _fed_param_bytes(graph: Graph) -> int:
    return sum(4 * n.size for n in graph.nodes() if n.op is Op.PARAM)
