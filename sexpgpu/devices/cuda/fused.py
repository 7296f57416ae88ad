"""`FusedGraph`: an IR graph traced to aten, compiled by Inductor, replayed as a CUDA graph.

The way through, once per graph (decided by measurement, docs/devices.md):

1. **trace**: `TorchGraph`'s schedule runs once under ``make_fx`` on example
   feeds of the right shapes (real tensors, so a kernel that refuses them,
   an attention backend say, is replaced before it is recorded), and the
   lowering (cuBLAS products, SDPA attention, the fused aten
   normalizations) is written once. Each aten call is renamed
   after the IR node that made it (``ir12__gelu``), so Inductor's provenance
   maps every generated kernel back to IR nodes and their source forms.
2. **rewrite**: the traced step gets cuBLAS's and cuBLASLt's epilogues
   (`sexpgpu.devices.cuda.fx_rewrites`), its weight gradients' products
   write into their buffers, and it reads each parameter it casts
   to bf16 from a copy the update keeps (`ParamCopies`) instead of casting;
3. **sum in place**: where a step is several calls, the traced function
   adds each summed output (the loss, every gradient) into a buffer the
   caller passes, so the gradient accumulation fuses into the backward's
   last kernels. Where a step is one call, it returns them (no `sums`): each
   gradient is allocated as the backward makes it, so the gradients of the
   last layers share the step's memory with the activations of the first.
4. **compile**: ``torch._inductor.compile`` fuses the elementwise and
   reduction regions into generated Triton kernels (C++ on the CPU) and
   calls cuBLAS and SDPA for the rest; with a pool of compile workers, in a
   few parts at once (`sexpgpu.devices.cuda.parallel_compile`). What the
   trace made is kept in the compile cache (`sexpgpu.devices.cuda.compile_cache`):
   a later run of the same step skips steps 1 to 3 and loads Inductor's
   code by the AOTAutograd key the entry notes
   (`sexpgpu.devices.cuda.inductor_keys`), and the report says ``(cached)``.
5. **capture**: on a GPU the second call is captured as a CUDA graph over
   static input buffers, and every later call copies its batch in and
   replays it: one launch for the whole call.

Ids are checked on the host before they are uploaded (a CUDA gather past
its table stops the process, and a traced graph cannot read a value back);
a graph whose ids are computed rather than fed is `NotFusable`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from sexpgpu.devices.cuda.compile_cache import StepCache, kept_bytes, step_key
from sexpgpu.devices.cuda.compile_worker import (
    compile_part,
    input_metadata,
    pack_graph,
    settings,
    unpack_graph,
    warm_up,
)
from sexpgpu.devices.cuda.executor import TorchGraph, feed_tensor
from sexpgpu.devices.cuda.fx_rewrites import (
    bias_adds_onto_products,
    gelu_into_products,
    param_casts_to_inputs,
    products_into_sums,
)
from sexpgpu.devices.cuda.inductor_keys import load_by_key, noting_key
from sexpgpu.devices.cuda.lowering import ids_checked_by_caller
from sexpgpu.devices.cuda.parallel_compile import CompilePool, PartedCall, split
from sexpgpu.devices.cuda.param_copies import ParamCopies
from sexpgpu.devices.cuda.process import inductor_options
from sexpgpu.devices.cuda.replay import Replay
from sexpgpu.ir.node import Graph, Node
from sexpgpu.ir.numpy_fused import check_ids
from sexpgpu.ir.ops import Op
from sexpgpu.ir.printer import format_graph
from sexpgpu.runtime.memory import call_peak_bytes

__all__ = ["FusedGraph", "Kernel", "NotFusable"]

log = logging.getLogger(__name__)

# Ops whose operand 1 holds ids, and the axis of operand 0 they index.
_ID_OPERANDS = {Op.TAKE: 0, Op.CROSS_ENTROPY: -1, Op.CROSS_ENTROPY_GRAD: -1}
# Ops that move ids without changing which values occur.
_SAME_VALUES = (Op.RESHAPE, Op.TRANSPOSE, Op.BROADCAST_TO)
_MADE_ONCE = (Op.CONSTANT, Op.IOTA)
_WRITE_BACK = re.compile(r"copy_(_\d+)?")


# Ranks load in their own threads; tracing and Inductor's compile go one at a time.
_COMPILING = threading.Lock()


class NotFusable(Exception):
    """The graph cannot take the fused path; the message says why."""


class Kernel:
    """One generated or library kernel of a compiled graph and the IR nodes it covers."""

    def __init__(self, name: str, nodes: Sequence[Node], sums: bool = False) -> None:
        self.name = name
        self.nodes = list(nodes)
        self.sums = sums  # it adds into the step's buffers

    def forms(self) -> str:
        """``add, gelu (gpt.lisp:31)``: the ops covered, with the source lines they come from."""
        ops = sorted({n.op.label for n in self.nodes})
        ops += ["the sums into the step's buffers"] if self.sums else []
        lines = sorted({f"{n.span.source.name}:{n.span.line}" for n in self.nodes if n.span})
        return ", ".join(ops) + (f" ({', '.join(lines)})" if lines else "")


class FusedGraph:
    """`graph` compiled for `device`; call it with feeds and the buffers it sums into.

    Parameters
    ----------
    graph
        The program; INPUT nodes are fed host arrays, PARAM nodes tensors.
    device
        ``torch.device("cuda", i)``, or ``torch.device("cpu")`` (tests: the
        same trace and compiler, C++ kernels, no capture).
    sums
        Outputs added into caller's buffers instead of returned (none for a
        step of one call: it returns them all, made as the backward goes).
    examples
        Feeds of the right shapes: the trace runs the lowering once on them
        (its ids must lie in their tables; zeros do).
    pool
        Worker processes that compile parts of the step at once
        (`sexpgpu.devices.cuda.parallel_compile`), started only where the
        cache misses; None compiles it here, whole.
    cache
        Where traced steps are kept (`sexpgpu.devices.cuda.compile_cache`);
        None traces and compiles every time.

    Raises
    ------
    NotFusable
        Ids that are computed inside the graph (not fed), or an Inductor failure.
    """

    def __init__(
        self,
        graph: Graph,
        device: torch.device,
        *,
        sums: Sequence[str],
        examples: Mapping[str, Any],
        pool: CompilePool | None = None,
        cache: StepCache | None = None,
        copies: bool = True,
        in_order: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.copies = copies  # whether the step reads bf16 copies the update keeps
        self.in_order = in_order  # whether Inductor keeps the schedule's order (`_IN_ORDER`)
        self._pool = pool if pool is not None and pool.size else None
        self.parts = 1  # how many parts Inductor compiled the step in
        self.parts_cached = 0  # of them, how many a worker compiled (loaded from the cache)
        self.cached = False  # whether the step came from the compile cache
        self.traced_before = False  # whether its trace did (Inductor's code may not have)
        self.eager = TorchGraph(graph, self.device)
        self.graph = self.eager.graph  # decomposed where the lowering has no kernel
        self._ids = _fed_ids(self.graph)
        self.sums = tuple(sums)
        self.returned = tuple(n for n in self.graph.outputs if n not in self.sums)
        leaves = {n.name: n for n in self.graph.nodes() if n.op in (Op.INPUT, Op.PARAM)}
        self.inputs = [n for n in leaves.values() if n.op is Op.INPUT]
        self.params = [n.name for n in leaves.values() if n.op is Op.PARAM]
        self.copied: list[str] = []  # the parameters read from their bf16 copies
        self.copies_only: list[str] = []  # of them, those whose f32 the step reads nowhere
        self.kernels: list[Kernel] = []
        # A plain call's peak measured by `call_peak_bytes`, kept in the step's cache entry.
        self.peak: int | None = None
        self.peak_kept = False  # whether `peak` came from the entry (an earlier run measured it)
        self._entry_at: tuple[StepCache, str] | None = None
        with _COMPILING:
            self._compiled = self._compile(examples, cache)
        self._replay = Replay(self.device, "fused step")
        self._static: list[torch.Tensor] = []  # the inputs a capture reads, refilled per call
        self.calls = 0

    def for_caller(self) -> FusedGraph:
        """The same compiled step with a capture and inputs of its own, for one rank's calls.

        Ranks that share a device share the compiled step, but each sums into
        buffers of its own (a capture is keyed by their addresses) from a
        thread of its own: one capture's state between them would be raced for.
        """
        twin = copy.copy(self)
        twin._replay = Replay(self.device, "fused step")
        twin._replay.enabled, twin._replay.refused = self._replay.enabled, self._replay.refused
        twin._static, twin.calls = [], 0
        return twin

    def release(self) -> None:
        """Drop the capture and its memory (its outputs included); later calls capture again."""
        self._replay.forget()

    def beside(self) -> contextlib.AbstractContextManager[None]:
        """Work run beside the step allocates from its capture's memory (`Replay.beside`)."""
        return self._replay.beside()

    @property
    def capture(self) -> bool:
        """Whether calls are captured and replayed as a CUDA graph (on a GPU, until refused)."""
        return self._replay.enabled and self._replay.refused is None

    @capture.setter
    def capture(self, value: bool) -> None:
        self._replay.enabled = value

    @property
    def captured(self) -> bool:
        """Whether a CUDA graph of the step is held (and replayed)."""
        return self._replay.captured

    @property
    def no_capture(self) -> str:
        """Why there is no CUDA graph: on the CPU, or the driver's refusal ("" where there is)."""
        if self._replay.refused is not None:
            return self._replay.refused
        return "" if self._replay.enabled else "on the CPU"

    def zero_buffers(self) -> dict[str, torch.Tensor]:
        """Fresh f32 zeros for every summed output (a call's buffers)."""
        return {
            s: torch.zeros(self.graph.outputs[s].shape, dtype=torch.float32, device=self.device)
            for s in self.sums
        }

    # ------------------------------------------------------------ compile

    def _flat(
        self,
        feeds: Mapping[str, Any],
        buffers: Mapping[str, torch.Tensor],
        copies: ParamCopies | None = None,
    ) -> list:
        """The compiled call's operands: inputs, parameters, their bf16 copies, the buffers.

        `copies` are those the update keeps (`TorchOps`); None makes copies
        for this call alone (a dry call or a measurement).
        """
        inputs = [feed_tensor(n, feeds, self.device) for n in self.inputs]
        params = [feeds[p] for p in self.params]
        copies = ParamCopies() if copies is None else copies
        made = copies.current([feeds[p] for p in self.copied])
        return [*inputs, *params, *made, *(buffers[s] for s in self.sums)]

    @property
    def copy_bytes(self) -> int:
        """What the parameters' bf16 copies take: they live for the run, beside the parameters."""
        sizes = {n.name: n.size for n in self.graph.nodes() if n.op is Op.PARAM}
        return sum(2 * sizes[p] for p in self.copied)

    @property
    def calls_cublaslt(self) -> bool:
        """Whether the step runs cuBLASLt's products (gelu epilogues, sums written in place)."""
        return any(self.gelu_products) or self.sum_products > 0

    def _traced(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        names = [n.name for n in self.inputs] + self.params
        feeds = dict(zip(names, flat, strict=False))
        buffers = flat[len(names) :]
        marks = self._marks
        mode = torch.fx.experimental.proxy_tensor.get_proxy_mode()

        def after_step(i: int) -> None:
            marks.append((i, len(mode.tracer.graph.nodes)))

        with ids_checked_by_caller():
            out = self.eager(feeds, after_step=after_step if mode is not None else None)
        for buffer, name in zip(buffers, self.sums, strict=True):
            buffer.add_(out[name])
        return tuple(out[name] for name in self.returned)

    def _compile(self, examples: Mapping[str, Any], cache: StepCache | None) -> Any:
        """The compiled step: loaded from `cache` where it holds it, else traced, compiled, kept."""
        for node, source in self._ids.items():
            if source is None:
                raise NotFusable("ids computed inside the graph are checked only when run eagerly")
            if source.op in _MADE_ONCE:  # known now: checked once, here
                check_ids(node, self.eager.constant(source).cpu().numpy(), _id_range(node))
        self._ids = {n: s for n, s in self._ids.items() if s.op is Op.INPUT}
        options = {**_provenance(), **(_IN_ORDER if self.in_order else {}), **inductor_options()}
        key = None
        if cache is not None:
            key = step_key(
                format_graph(self.graph, spans=False),
                self.device,
                sums=self.sums,
                options={**options, "param_copies": self.copies},
                settings=settings(),
            )
            self._entry_at = cache, key
            entry = cache.load(key)
            if entry is not None:
                loaded = self._load(entry, options)
                if loaded is not None:
                    if loaded[1] != entry.get("keys"):  # graphs compiled again, or keys not noted
                        cache.save(key, {**entry, "keys": loaded[1]})
                    self.peak = kept_bytes(entry.get("peak"))  # None: measured again
                    self.peak_kept = self.peak is not None
                    return loaded[0]
        if self._pool is not None:
            self._pool.start()  # their imports overlap the trace
        began = time.perf_counter()
        gm = self._trace(examples)
        traced = time.perf_counter()
        try:
            compiled, graphs = self._inductor(gm, options)
        except Exception as error:  # Inductor's own failures carry no stable type
            raise NotFusable(f"Inductor failed: {type(error).__name__}: {error}") from error
        # Where the first step's wait goes: the report prints it.
        self.seconds = (traced - began, time.perf_counter() - traced)
        if cache is not None:
            cache.save(key, self._entry(graphs))
        return compiled

    def _trace(self, examples: Mapping[str, Any]) -> torch.fx.GraphModule:
        """The step as aten calls named after the IR, rewritten (the module docstring's 1 to 3)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        flat = self._flat(examples, self.zero_buffers())
        self._marks: list[tuple[int, int]] = []
        # One fake-tensor mode for the trace's metadata: make_fx otherwise makes
        # a new one (and records its stack) for every value: 0.6 s of a 5 s trace.
        context = torch._guards.TracingContext(FakeTensorMode(allow_fallback_kernels=True))
        try:
            with torch._guards.tracing(context):
                gm = make_fx(self._traced, tracing_mode="real")(*flat)
        except torch.OutOfMemoryError as error:  # the trace runs the step op by op once
            torch.cuda.empty_cache()
            raise NotFusable(f"the trace ran out of device memory ({error})") from error
        self._name_after_ir(gm)
        bias_adds_onto_products(gm)  # a stacked graph's linear layers, as one batch's
        self.gelu_products = gelu_into_products(gm)  # after: it reads the adds on products
        self.sum_products = products_into_sums(gm)  # the weight gradients into their buffers
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        first = len(self.inputs)
        params = placeholders[first : first + len(self.params)]
        copied = param_casts_to_inputs(gm, params) if self.copies else []
        self.copied = [self.params[i] for i in copied]
        self.copies_only = [self.params[i] for i in copied if not placeholders[first + i].users]
        return gm

    def _inductor(self, gm: torch.fx.GraphModule, options: dict) -> tuple[Any, dict[str, Any]]:
        """Inductor's compile of the traced step, in parts over the pool's workers where it has any.

        Sets `kernels` from each compile's provenance, in launch order.
        Returns the compiled call and the graphs compiled, as `pack_graph`
        bytes (what the cache keeps): ``graphs`` [(bytes, inputs)], and for
        a split step its ``parent`` and the parts' ``names``.
        """
        if self._pool is not None:
            try:  # on a copy: the split rewrites its graph
                parted = self._compile_parts(copy.deepcopy(gm), options)
            except Exception as error:  # a part Inductor or the split refuses: whole, then
                log.warning("the step compiles whole (its parts failed: %s)", error)
                parted = None
            if parted is not None:
                return parted
        # Compiled as unpacked from its bytes, as a later run compiles it from the
        # cache: so that run meets this one's entry in Inductor's cache.
        packed = pack_graph(gm)
        inputs = input_metadata(gm)
        compiled, key = _compiled_noting_key(
            unpack_graph(packed), inputs, str(self.device), options
        )
        self.kernels = self._kernel_map(compiled)
        kept = {"graphs": [(packed, inputs)], "keys": [key], "parent": None, "names": []}
        return compiled, kept

    def _compile_parts(
        self, gm: torch.fx.GraphModule, options: dict
    ) -> tuple[PartedCall, dict[str, Any]] | None:
        """The step split into parts, compiled by the pool's workers and loaded here, or None."""
        from torch._dynamo.utils import counters

        parent = split(gm, self._pool.size)
        if parent is None:
            return None
        parts = dict(parent.named_children())
        device, matmul_settings = str(self.device), settings()
        # Both sides compile the part as unpacked from the same bytes (its tensors come
        # back as buffers, which changes the cache key): so they meet in one cache entry.
        jobs = [
            {
                "graph": pack_graph(p),
                "inputs": input_metadata(p),
                "device": device,
                "options": options,
                "settings": matmul_settings,
            }
            for p in parts.values()
        ]
        compiled, by_part, keys = {}, {}, {}
        names = list(parts)
        ended = self._pool.compile(jobs)
        warm_up(device, options)  # meanwhile, this process's first compile's set-up
        hits = counters["inductor"]["fxgraph_cache_hit"]
        # Each part is loaded as its worker ends (a cache hit), beside the others' compiles.
        for i, failed in ended:
            if failed:
                log.debug("compile worker: %s not compiled (%s); compiled here", names[i], failed)
            graph = unpack_graph(jobs[i]["graph"])
            compiled[names[i]], keys[i] = _compiled_noting_key(
                graph, jobs[i]["inputs"], device, options
            )
            by_part[i] = self._kernel_map(compiled[names[i]])
        self.kernels = [k for i in range(len(names)) for k in by_part[i]]
        self.parts = len(parts)
        self.parts_cached = counters["inductor"]["fxgraph_cache_hit"] - hits
        graphs = [(job["graph"], job["inputs"]) for job in jobs]
        kept = {
            "graphs": graphs,
            "keys": [keys[i] for i in range(len(names))],
            "parent": pack_graph(parent),
            "names": names,
        }
        return PartedCall(parent, compiled), kept

    def _entry(self, graphs: dict[str, Any]) -> dict[str, Any]:
        """What the cache keeps of a compiled step: its graphs and what the trace decided."""
        position = {id(node): i for i, node in enumerate(self.eager.order)}
        kernels = [(k.name, [position[id(n)] for n in k.nodes], k.sums) for k in self.kernels]
        rewrites = (self.gelu_products, self.sum_products)
        read = {"copied": self.copied, "copies_only": self.copies_only}
        return {**graphs, **read, "kernels": kernels, "rewrites": rewrites}

    def _load(self, entry: dict[str, Any], options: dict) -> tuple[Any, list] | None:
        """The step loaded from a cache entry, and its graphs' AOTAutograd keys; or None.

        Each graph's code is loaded by the key its entry notes
        (`sexpgpu.devices.cuda.inductor_keys`); a graph whose key is missing
        or finds nothing is compiled from the saved graph (where Inductor's
        cache serves it, a load too), and its key noted anew. None where the
        entry does not fit this graph or Inductor fails on it: the caller
        then traces and compiles as if there were none.
        """
        from torch._dynamo.utils import counters

        began = time.perf_counter()
        device = str(self.device)
        try:
            order = self.eager.order
            kernels = [
                Kernel(n, [order[i] for i in nodes], sums) for n, nodes, sums in entry["kernels"]
            ]
            keys = list(entry.get("keys") or [None] * len(entry["graphs"]))
            compiled, cached = [], 0
            for i, (graph, inputs) in enumerate(entry["graphs"]):
                gm = unpack_graph(graph)
                loaded = load_by_key(keys[i], gm, options) if keys[i] is not None else None
                if loaded is None:
                    hits = counters["inductor"]["fxgraph_cache_hit"]
                    loaded, keys[i] = _compiled_noting_key(gm, inputs, device, options)
                    cached += counters["inductor"]["fxgraph_cache_hit"] > hits
                else:
                    cached += 1
                compiled.append(loaded)
            copies_only = list(entry["copies_only"])
            if entry["parent"] is not None:
                call = PartedCall(
                    unpack_graph(entry["parent"]), dict(zip(entry["names"], compiled, strict=True))
                )
            else:
                (call,) = compiled
        except Exception as error:  # an entry of another layout, or a failure of the libraries
            log.warning("compile cache: the entry did not load (%s); compiling again", error)
            return None
        self.kernels = kernels
        self.copied, self.copies_only = list(entry["copied"]), copies_only
        self.gelu_products, self.sum_products = entry["rewrites"]
        self.parts = len(compiled)
        self.parts_cached = cached
        # Cached where every graph's code was found compiled (a missing one compiles).
        self.cached = self.parts_cached == self.parts
        self.traced_before = True
        self.seconds = (0.0, time.perf_counter() - began)
        return call, keys

    def _name_after_ir(self, gm: torch.fx.GraphModule) -> None:
        """Name each aten call ``ir<position>__<name>`` after the IR node whose lowering made it.

        Calls after the last IR node are the sums into the buffers: ``sums__<name>``.
        """
        bounds = iter(self._marks)
        position, end = next(bounds, (None, None))
        for count, node in enumerate(gm.graph.nodes, start=1):
            while end is not None and count > end:
                position, end = next(bounds, (None, None))
            if node.op == "call_function":
                prefix = "sums" if position is None else f"ir{position}"
                node._rename(f"{prefix}__{node.name}")
        gm.recompile()

    def _kernel_map(self, compiled: Any) -> list[Kernel]:
        """StepGraphs in launch order with the IR nodes each covers (Inductor's provenance)."""
        text = getattr(compiled, "inductor_provenance_mapping_str", None)
        if not text:
            return []
        mapping = json.loads(text)
        post_to_pre = mapping.get("postToPre", {})
        order = self.eager.order
        kernels = []
        for key, value in mapping.items():
            if not key.endswith("CodeToPost"):
                continue
            for kernel, posts in value.items():
                positions, sums = set(), False
                for post in posts:
                    # AOTAutograd's write-backs into the graph's operands come from
                    # no node of ours: the only operands a step writes are its sums.
                    sums |= post not in post_to_pre and _WRITE_BACK.fullmatch(post) is not None
                    for pre in post_to_pre.get(post, [post]):
                        head = pre.split("__", 1)[0]
                        sums |= head == "sums"
                        if head.startswith("ir") and head[2:].isdigit():
                            positions.add(int(head[2:]))
                nodes = [order[i] for i in sorted(positions)]
                kernels.append(Kernel(kernel.rsplit(":", 1)[0], nodes, sums))
        return kernels

    # ------------------------------------------------------------ run

    def check_ids(self, feeds: Mapping[str, Any]) -> None:
        """E-DATA-006 before upload: every fed id within its table (as the interpreter)."""
        for node, fed in self._ids.items():
            check_ids(node, np.asarray(feeds[fed.name]), _id_range(node))

    def __call__(
        self,
        feeds: Mapping[str, Any],
        buffers: Mapping[str, torch.Tensor],
        *,
        copies: ParamCopies | None = None,
        zeros: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Run once: `buffers` (one per name in `sums`) grow by this call's outputs.

        `copies` are the bf16 copies of the parameters the update keeps
        (`sexpgpu.devices.cuda.param_copies`; None: made for this call).
        `zeros` says the buffers hold zeros (a step's first call): a failed
        call may simply zero them again. The other outputs are returned;
        after a replay they live in the CUDA graph's memory and are
        overwritten by the next call.
        """
        self.check_ids(feeds)
        flat = self._flat(feeds, buffers, copies)
        self.calls += 1
        if not self.capture:
            out = self._once(flat, buffers, zeros)
        else:
            n_in = len(self.inputs)
            static = self._refill(flat[:n_in])
            key = tuple(t.data_ptr() for t in flat[n_in:])
            out = self._replay(
                key,
                lambda: self._compiled(*static, *flat[n_in:]),
                plain=lambda: self._once(flat, buffers, zeros),
            )
        return dict(zip(self.returned, out, strict=True))

    def _refill(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The inputs copied into the buffers a capture reads (made at the first call)."""
        if not self._static:
            self._static = [t.clone() for t in inputs]
        else:
            for static, value in zip(self._static, inputs, strict=True):
                static.copy_(value)
        return self._static

    def _once(
        self, flat: list, buffers: Mapping[str, torch.Tensor], zeros: bool
    ) -> Sequence[torch.Tensor]:
        """A plain call.

        A call that fails to allocate halfway must leave the caller's sums
        as they were, so that `sexpgpu.runtime.oom` can retry it: buffers
        known to be zeros are zeroed again, others are summed into through
        scratch buffers (a copy of every gradient, so only where needed).
        """
        n = len(flat) - len(self.sums)
        if zeros:
            try:
                return self._compiled(*flat)
            except BaseException:
                torch._foreach_zero_(list(flat[n:]))
                raise
        scratch = [torch.zeros_like(b) for b in flat[n:]]
        out = self._compiled(*flat[:n], *scratch)
        if scratch:
            torch._foreach_add_([buffers[s] for s in self.sums], scratch)
        return out

    def call_peak_bytes(self, feeds: Mapping[str, Any]) -> int | None:
        """The most bytes one plain call holds beyond its operands (a dry call; GPU only).

        Inductor decides which buffers share memory, so the fused step's live
        set is read from the allocator over calls on `feeds` before the first
        step (`sexpgpu.runtime.memory.call_peak_bytes`), rather than from the
        op-by-op schedule. None on the CPU, or where the dry call does not fit.

        The peak is kept in the step's compile cache entry, whose key names
        the compiled code, the GPU and the libraries: a step loaded from the
        cache with its peak is not called again (two calls and their waits of
        a warm start; `peak_kept` says so).
        """
        if self.peak is None:
            flat = self._flat(feeds, self.zero_buffers())
            self.peak = call_peak_bytes(self.device, lambda: self._compiled(*flat))
            if self.peak is not None and self._entry_at is not None:
                cache, key = self._entry_at
                entry = cache.load(key)
                if entry is not None:
                    cache.save(key, {**entry, "peak": self.peak})
        return self.peak

    # ------------------------------------------------------------ report

    def _compile_text(self) -> str:
        """How the step was made: traced and compiled, or loaded from the compile cache."""
        load_s = self.seconds[1]
        parts = f" in {self.parts} parts" if self.parts > 1 else ""
        if self.cached:
            return f"loaded from the compile cache in {load_s:.1f} s{parts}"
        if self.traced_before:
            return (
                f"traced before, compiled in {load_s:.1f} s{parts} "
                f"({self.parts_cached} of {self.parts} found in Inductor's cache)"
            )
        text = f"traced in {self.seconds[0]:.1f} s, compiled in {load_s:.1f} s"
        if self.parts > 1:
            text += f" in {self.parts} parts, {self.parts_cached} of them by compile workers"
        return text

    def report_lines(self) -> list[str]:
        """``kernel x12 triton_poi_fused_add_gelu_7 <- add, gelu (gpt.lisp:31)``, repeats folded."""
        folded: Counter = Counter()
        first: dict[str, str] = {}
        for kernel in self.kernels:
            forms = kernel.forms()
            family = kernel.name.rstrip("0123456789").rstrip("_")
            folded[(family, forms)] += 1
            first.setdefault((family, forms), kernel.name)
        lines = [
            f"fused: {len(self.kernels)} kernels (Inductor; {self._compile_text()}), "
            f"{'no CUDA graph ' + self.no_capture if self.no_capture else 'CUDA graph'}"
            + (" (cached)" if self.cached else "")
        ]
        for (family, forms), count in folded.items():
            lines.append(f"kernel x{count} {first[(family, forms)]} <- {forms or 'no IR node'}")
        return lines


def _compiled_noting_key(
    gm: torch.fx.GraphModule, inputs: Any, device: str, options: dict
) -> tuple[Any, str | None]:
    """`compile_part`'s result, and the AOTAutograd key its compile noted (`noting_key`)."""
    with noting_key() as noted:
        compiled = compile_part(gm, inputs, device, options)
    return compiled, noted.key


def _fed_ids(graph: Graph) -> dict[Node, Node | None]:
    """Each id-taking node -> the INPUT, CONSTANT or IOTA its ids come from unchanged, or None."""
    found: dict[Node, Node | None] = {}
    for node in graph.nodes():
        if node.op in _ID_OPERANDS:
            ids = node.inputs[1]
            while ids.op in _SAME_VALUES:
                ids = ids.inputs[0]
            found[node] = ids if ids.op is Op.INPUT or ids.op in _MADE_ONCE else None
    return found


def _id_range(node: Node) -> int:
    return node.inputs[0].shape[_ID_OPERANDS[node.op]]


# A step that recomputes keeps its order, the one the memory plan's schedule counted.
# Inductor's locality pass moves each value to just before its first use, which keeps
# that value's inputs alive until then: a forward value only the backward reads dragged
# the activation it was made from into the backward (a GPT recomputing to 70% of its
# live set held 55 MiB for a schedule of 42 MiB; docs/devices.md). Other steps keep the
# pass, whose speed is the one measured.
_IN_ORDER = {"reorder_for_locality": False}


def _provenance() -> dict[str, Any]:
    """Inductor's setting that records which fx nodes each kernel covers, where it has one."""
    known = hasattr(torch._inductor.config.trace, "provenance_tracking_level")
    return {"trace.provenance_tracking_level": 1} if known else {}
