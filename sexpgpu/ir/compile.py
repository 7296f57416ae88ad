"""From a run of an experiment to the graphs a device runs: `compile_run` -> `CompiledRun`.

The way through, once per run and with no device in sight: trace the run's
loss (and the model) into IR (`sexpgpu.ir.trace`), differentiate it with
respect to every parameter (`sexpgpu.ir.autodiff`), and run the graph passes
with the verifier between them:

* the training graph gives ``loss`` and every parameter's ``grad/<name>``;
* the evaluation graph gives ``loss`` and the model's ``output``, with
  every dropout the identity (`Trace.train_only`);
* the activation graph (built on first use) gives each call's root mean
  square, for the activation-rms diagnostic.

A device receives the `CompiledRun` (``device.load``), never the experiment.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from sexpgpu.ir import builder as b
from sexpgpu.ir.autodiff import training_graph
from sexpgpu.ir.dtypes import FLOATS, DType
from sexpgpu.ir.node import Graph, Node, topological_order
from sexpgpu.ir.ops import VIEW, Op
from sexpgpu.ir.passes import optimize, substitute
from sexpgpu.ir.trace import Trace, trace_run
from sexpgpu.ir.trace_init import Init, draw, param_rng
from sexpgpu.ir.verify import verify
from sexpgpu.lang import Experiment, RunDef

__all__ = [
    "GRAD_PREFIX",
    "CompiledRun",
    "ParamInfo",
    "compile_run",
    "hidden_matrices",
    "matmul_flops",
    "output_graph",
]

log = logging.getLogger(__name__)

GRAD_PREFIX = "grad/"


@dataclass(frozen=True)
class ParamInfo:
    """A parameter: its shape, storage dtype (f32), initializer, and whether weight decay applies.

    `decay` is False for parameters of fewer than two axes (biases, norm
    scales), as LANGUAGE.md asks of weight decay. `hidden` is True for a
    hidden weight matrix (`hidden_matrices`): what `muon` orthogonalizes.
    """

    shape: tuple[int, ...]
    dtype: str
    init: Init
    decay: bool
    hidden: bool = False

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


def matmul_flops(graph: Graph) -> int:
    """Floating-point operations of the graph's matrix products.

    ``2 M N K`` per matmul; fused attention over ``[.. S D]`` counts its two
    products, ``4 S S D`` per head, and its gradient the four of the
    backward, ``8 S S D`` (the causal mask is not discounted, the recomputed
    weights not counted: the usual model-FLOPs convention).
    """
    total = 0
    for node in graph.nodes():
        if node.op is Op.MATMUL:
            total += 2 * node.size * node.inputs[0].shape[-1]
        elif node.op in (Op.ATTENTION, Op.ATTENTION_GRAD):
            q = node.inputs[0]
            per_head = 4 if node.op is Op.ATTENTION else 8
            total += per_head * q.size * q.shape[-2]  # (.. S D) * S
    return total


class CompiledRun:
    """One run, traced, differentiated and optimized: what every device receives.

    Attributes
    ----------
    name
        The run's name.
    params
        Path name -> `ParamInfo`, in the order the model makes them.
    inputs
        Data field -> (per-microbatch shape, dtype), e.g. ``tokens -> ((8, 64), 'int32')``.
    train_graph, eval_graph
        The optimized graphs (``loss`` and ``grad/<name>``; ``loss`` and ``output``).
    flops_per_step
        Matrix-product FLOPs of one microbatch, forward and backward.
    target
        The data field that eval accuracy compares the output's argmax with:
        an integer field the model does not read whose shape is the output's
        without its last axis, and which a cross-entropy of the loss takes as
        its targets; None when there is none.
    trainable
        Whether some parameter reaches the loss.
    rows
        The microbatch's rows (``:batch``): the leading axis of every input.
    """

    def __init__(
        self,
        name: str,
        trace: Trace,
        train_graph: Graph,
        eval_graph: Graph,
        model_inputs: tuple[str, ...],
    ) -> None:
        self.name = name
        self._trace = trace
        self.train_graph = train_graph
        self.eval_graph = eval_graph
        hidden = hidden_matrices(trace)
        self.params: Mapping[str, ParamInfo] = {
            key: ParamInfo(spec.shape, "f32", spec.init, len(spec.shape) >= 2, key in hidden)
            for key, spec in trace.params.items()
        }
        self.inputs: Mapping[str, tuple[tuple[int, ...], str]] = {
            key: (node.shape, str(node.dtype)) for key, node in trace.inputs.items()
        }
        self.flops_per_step = matmul_flops(train_graph)
        self.target = _target_field(trace, model_inputs)
        self.trainable = any(n.op is Op.PARAM for n in topological_order([trace.loss]))
        self.rows = 0
        self._retrace: Callable[[int], CompiledRun] | None = None  # set by `compile_run`
        self._pieces: dict[int, CompiledRun] = {}

    def pieces(self, parts: int) -> CompiledRun | None:
        """This run at ``rows / parts`` rows per microbatch, or None where the graph forbids it.

        A microbatch may be computed in `parts` pieces (after an allocation
        failure, `sexpgpu.runtime.oom.call_with_split`) when its rows divide,
        every input's leading axis is the rows, and the loss is a mean over
        all elements of a value whose leading axis is the rows (the
        language's `cross-entropy` and `mse`): then the pieces' mean loss and
        gradients are the microbatch's, for a model that treats rows apart.
        """
        if parts == 1:
            return self
        if self._retrace is None or not self.rows or self.rows % parts:
            return None
        if any(shape[:1] != (self.rows,) for shape, _ in self.inputs.values()):
            return None
        if not _mean_over_rows(self._trace.loss, self.rows):
            return None
        if parts not in self._pieces:
            self._pieces[parts] = self._retrace(self.rows // parts)
        return self._pieces[parts]

    def with_train_graph(self, graph: Graph) -> CompiledRun:
        """This run training through `graph`, a rewrite of its training graph (recomputation).

        `flops_per_step` stays the model's: recomputed products are not
        counted, as in the usual model-FLOPs convention.
        """
        run = copy.copy(self)
        run.train_graph = graph
        return run

    @property
    def param_count(self) -> int:
        """Number of parameter elements."""
        return sum(info.size for info in self.params.values())

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        """Initial parameters, float32 on the host, deterministic from `seed`.

        Each parameter draws from its own stream, derived from the seed and
        its path name (`sexpgpu.ir.trace_init.param_rng`), so every device and
        rank starts from the same numbers, and the streams are drawn on
        threads (NumPy fills arrays without the GIL: GPT-2 small's 124M
        numbers took a second on one thread).
        """

        def one(key: str) -> np.ndarray:
            info = self.params[key]
            return draw(info.init, info.shape, param_rng(seed, key))

        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            return dict(zip(self.params, pool.map(one, self.params), strict=True))

    @cached_property
    def activation_graph(self) -> Graph:
        """Each call's root mean square on one microbatch, keyed by its path.

        The calls are the model (``gpt``), each defn call (``gpt/block.3``)
        and each layer (``gpt/block.3/attention``).
        """
        trace = self._trace
        outputs = {path: _rms(node) for path, node in trace.activations.items()}
        return optimize(_as_evaluated(trace, outputs), check=verify)


def _as_evaluated(trace: Trace, outputs: Mapping[str, Node]) -> Graph:
    """`outputs` as evaluation computes them: every dropout the identity, no random key fed."""
    leaves = [*trace.inputs.values(), *trace.param_nodes.values()]
    swapped = substitute(Graph.of(outputs, leaves), trace.train_only)
    return Graph.of(swapped.outputs, leaves)


def _mean_over_rows(loss: Node, rows: int) -> bool:
    """Whether `loss` is ``sum(x) * (1 / x.size)`` over all of an `x` laid out row by row.

    Row by row: `x`'s leading axis is the rows, or blocks of them that a
    reshape merged (cross-entropy's per-token losses of ``(rows, T)`` targets).
    """
    if loss.op is not Op.MUL:
        return False
    total, scale = loss.inputs
    if total.op is not Op.SUM or scale.op is not Op.CONSTANT or total.shape != ():
        return False
    (x,) = total.inputs
    value = scale.attrs["value"]
    if not (isinstance(value, float) and value == 1.0 / x.size):
        return False
    while x.shape[:1] != (rows,):
        if not x.shape or x.shape[0] % rows:
            return False
        if x.op is Op.CROSS_ENTROPY:
            x = x.inputs[1]  # per-row losses: laid out as their targets
        elif x.op is Op.RESHAPE:
            x = x.inputs[0]
        else:
            return False
    return True


def hidden_matrices(trace: Trace) -> set[str]:
    """The parameters of two axes that are neither an embedding nor the head.

    An embedding is a table `take` reads rows of; the head is an operand of
    a product the model's output (the loss where there is none) reaches
    without crossing another product. Muon's authors keep both, with the
    vectors, on AdamW: their gradients are sparse or feed the loss directly.
    """
    names = {id(node): key for key, node in trace.param_nodes.items()}
    ends: set[str] = set()
    root = trace.output if trace.output is not None else trace.loss
    for node in topological_order([trace.loss]):
        if node.op is Op.TAKE:
            ends |= _params_of(node.inputs[0], names)
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op is Op.MATMUL:
            for operand in node.inputs:
                ends |= _params_of(operand, names)
        else:
            stack.extend(node.inputs)
    return {
        key for key, node in trace.param_nodes.items() if len(node.shape) == 2 and key not in ends
    }


def _params_of(node: Node, names: Mapping[int, str]) -> set[str]:
    """The parameter `node` is, seen through casts and views; empty if it is none."""
    while node.op is Op.CAST or node.op in VIEW:
        node = node.inputs[0]
    return {names[id(node)]} if node.op is Op.PARAM else set()


def _target_field(trace: Trace, model_inputs: tuple[str, ...]) -> str | None:
    output = trace.output
    if output is None or output.dtype not in FLOATS or len(output.shape) < 2:
        return None
    classified = _classification_targets(trace.loss)
    for key, node in trace.inputs.items():
        fits = node.dtype is DType.INT32 and node.shape == output.shape[:-1]
        if fits and key not in model_inputs and id(node) in classified:
            return key
    return None


def _classification_targets(loss: Node) -> set[int]:
    """The ids of the nodes that are a cross-entropy's targets in the loss (through reshapes).

    Accuracy means something only for a classification loss: an ``mse`` on
    data that happens to hold labels has none.
    """
    found = set()
    for node in topological_order([loss]):
        if node.op is Op.CROSS_ENTROPY:
            targets = node.inputs[1]
            while targets.op is Op.RESHAPE:
                targets = targets.inputs[0]
            found.add(id(targets))
    return found


def _rms(node: Node) -> Node:
    """``sqrt(mean(x * x))`` in f32."""
    x = node if node.dtype == DType.F32 else b.cast(node, DType.F32, span=node.span)
    total = b.sum(b.mul(x, x, span=x.span), None, span=x.span)
    mean = b.mul(total, b.constant(1.0 / max(x.size, 1), DType.F32, span=x.span), span=x.span)
    return b.sqrt(mean, span=x.span)


def compile_run(experiment: Experiment, run: RunDef) -> CompiledRun:
    """Trace, differentiate and optimize `run`.

    Parameters
    ----------
    experiment
        The loaded experiment (variant applied).
    run
        The run to compile; its ``:batch`` sets the microbatch rows and its
        ``:dtype`` the compute dtype.

    Raises
    ------
    SexpgpuError
        E-TRACE-*, E-SHAPE-* or E-DATA-* for models that do not trace.
    """
    trace = trace_run(experiment, run)
    leaves = [*trace.inputs.values(), *trace.param_nodes.values()]
    forward = Graph.of({"loss": trace.loss}, leaves)
    train = optimize(training_graph(forward, "loss", GRAD_PREFIX), check=verify)
    outputs = {"loss": trace.loss}
    if trace.output is not None:
        outputs["output"] = trace.output
    evaluation = optimize(_as_evaluated(trace, outputs), check=verify)
    model = experiment.models[run.model]
    model_inputs = tuple(getattr(s, "name", str(s)) for s in model.inputs)
    compiled = CompiledRun(run.name, trace, train, evaluation, model_inputs)
    compiled.rows = run.batch
    compiled._retrace = lambda rows: compile_run(experiment, replace(run, batch=rows))
    log.info(
        "compiled %s: %d parameters, %d nodes, %.3g FLOPs per microbatch",
        run.name,
        compiled.param_count,
        len(train.nodes()),
        compiled.flops_per_step,
    )
    return compiled


def output_graph(
    experiment: Experiment, run: RunDef, batch: int = 1, dtype: str | None = None
) -> Graph | None:
    """The model's output alone, traced at `batch` rows: what sampling and export run.

    Its inputs are the data fields the output reads (not the loss's targets),
    its parameters all of the run's; None when the loss calls no model.
    `dtype` replaces the run's compute dtype (``"f32"`` for exact comparisons).
    """
    changes: dict[str, object] = {"batch": batch}
    if dtype is not None:
        changes["dtype"] = dtype
    trace = trace_run(experiment, dataclasses.replace(run, **changes))
    if trace.output is None:
        return None
    graph = Graph.of({"output": trace.output}, trace.param_nodes.values())
    return optimize(graph, check=verify)
