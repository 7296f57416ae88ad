"""A run compiled for the cpu interpreter: `compile_run` -> `TrainingProgram`.

The way through: trace the run's loss (and the model) into IR
(`sexpgpu.ir.trace`), differentiate it with respect to every parameter
(`sexpgpu.ir.autodiff`), run the graph passes with the verifier between
them, and plan both graphs on the interpreter (`sexpgpu.devices.cpu`):

* the training graph gives the loss and every parameter's gradient;
* the evaluation graph gives the loss and the model's output.

Parameters and gradients are float32 NumPy arrays keyed by path name
(``gpt/block.3/attention/wq``); optimizers, schedules, clipping and
microbatch accumulation work on these dicts in `sexpgpu.train`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from sexpgpu.devices.cpu import CpuProgram
from sexpgpu.ir import builder as b
from sexpgpu.ir.autodiff import training_graph
from sexpgpu.ir.dtypes import DType
from sexpgpu.ir.node import Graph, Node
from sexpgpu.ir.ops import Op
from sexpgpu.ir.passes import optimize
from sexpgpu.ir.trace import Trace, trace_run
from sexpgpu.ir.trace_init import Init, draw, param_rng
from sexpgpu.ir.verify import verify
from sexpgpu.lang import Experiment, RunDef

__all__ = ["GRAD_PREFIX", "ParamInfo", "TrainingProgram", "compile_run", "matmul_flops"]

log = logging.getLogger(__name__)

GRAD_PREFIX = "grad/"


@dataclass(frozen=True)
class ParamInfo:
    """A parameter: its shape, storage dtype (f32), initializer, and whether weight decay applies.

    `decay` is False for parameters of fewer than two axes (biases, norm
    scales), as LANGUAGE.md asks of weight decay.
    """

    shape: tuple[int, ...]
    dtype: str
    init: Init
    decay: bool

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


class TrainingProgram:
    """One run on the cpu device: parameters, inputs, and the two planned graphs.

    Attributes
    ----------
    params
        Path name -> `ParamInfo`, in the order the model makes them.
    inputs
        Data field -> (per-microbatch shape, dtype), e.g. ``tokens -> ((8, 64), 'int32')``.
    planned_peak_bytes
        The most bytes the training graph's schedule holds at once
        (parameters, the batch, activations and gradients).
    flops_per_step
        Matrix-product FLOPs of one microbatch, forward and backward.
    train_graph, eval_graph
        The optimized graphs (``loss`` and ``grad/<name>``; ``loss`` and ``output``).
    """

    def __init__(self, trace: Trace, train_graph: Graph, eval_graph: Graph) -> None:
        self.trace = trace
        self.train_graph = train_graph
        self.eval_graph = eval_graph
        self.params: Mapping[str, ParamInfo] = {
            name: ParamInfo(spec.shape, "f32", spec.init, len(spec.shape) >= 2)
            for name, spec in trace.params.items()
        }
        self.inputs: Mapping[str, tuple[tuple[int, ...], str]] = {
            name: (node.shape, str(node.dtype)) for name, node in trace.inputs.items()
        }
        self._train = CpuProgram(train_graph)
        self._eval = CpuProgram(eval_graph)
        self.planned_peak_bytes = self._train.planned_peak_bytes
        self.flops_per_step = matmul_flops(train_graph)
        self.last_peak_bytes = 0
        self._activations: CpuProgram | None = None

    @property
    def param_count(self) -> int:
        """Number of parameter elements."""
        return sum(info.size for info in self.params.values())

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        """Initial parameters, float32, deterministic from `seed`.

        Each parameter draws from its own stream, derived from the seed and
        its path name (`sexpgpu.ir.trace_init.param_rng`).
        """
        return {
            name: draw(info.init, info.shape, param_rng(seed, name))
            for name, info in self.params.items()
        }

    def train_step(
        self, params: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]
    ) -> tuple[float, dict[str, np.ndarray]]:
        """The loss of one microbatch and the gradient of every parameter (float32)."""
        out = self._run(self._train, params, batch)
        grads = {name: _f32(out[GRAD_PREFIX + name]) for name in self.params}
        return float(out["loss"]), grads

    def eval_step(
        self, params: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]
    ) -> tuple[float, np.ndarray]:
        """The loss of one microbatch and the model's output (e.g. the logits)."""
        out = self._run(self._eval, params, batch)
        return float(out["loss"]), out.get("output", np.zeros(0, np.float32))

    def activation_rms(
        self, params: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]
    ) -> dict[str, float]:
        """Root mean square of each call's result on one microbatch, keyed by path.

        The calls are the model (``gpt``), each defn call (``gpt/block.3``)
        and each layer (``gpt/block.3/attention``); the graph is compiled on
        first use.
        """
        if self._activations is None:
            outputs = {path: _rms(node) for path, node in self.trace.activations.items()}
            leaves = [*self.trace.inputs.values(), *self.trace.param_nodes.values()]
            self._activations = CpuProgram(optimize(Graph.of(outputs, leaves), check=verify))
        out = self._run(self._activations, params, batch)
        return {path: float(value) for path, value in out.items()}

    def _run(
        self, program: CpuProgram, params: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        feeds = dict(batch)
        feeds.update(params)
        out = program(feeds)
        self.last_peak_bytes = program.last_peak_bytes
        return out


def _rms(node: Node) -> Node:
    """``sqrt(mean(x * x))`` in f32."""
    x = node if node.dtype == DType.F32 else b.cast(node, DType.F32, span=node.span)
    total = b.sum(b.mul(x, x, span=x.span), None, span=x.span)
    mean = b.mul(total, b.constant(1.0 / max(x.size, 1), DType.F32, span=x.span), span=x.span)
    return b.sqrt(mean, span=x.span)


def _f32(array: np.ndarray) -> np.ndarray:
    return array if array.dtype == np.float32 else array.astype(np.float32)


def compile_run(experiment: Experiment, run: RunDef) -> TrainingProgram:
    """Trace, differentiate, optimize and plan `run` on the cpu interpreter.

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
    evaluation = optimize(Graph.of(outputs, leaves), check=verify)
    program = TrainingProgram(trace, train, evaluation)
    log.info(
        "compiled %s: %d parameters, %d nodes, %.3g FLOPs per microbatch, peak %d bytes planned",
        run.name,
        program.param_count,
        len(train.nodes()),
        program.flops_per_step,
        program.planned_peak_bytes,
    )
    return program
