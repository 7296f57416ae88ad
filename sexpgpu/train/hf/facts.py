"""What a model computes, read from its traced graph: the facts a mapping needs.

Parameter shapes do not say how many heads attention splits into, whether it
is causal, a norm's epsilon or a rotary base; the traced output graph does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sexpgpu.ir.node import Node, topological_order
from sexpgpu.ir.ops import Op
from sexpgpu.ir.trace import trace_run

__all__ = ["ModelFacts", "model_facts"]


@dataclass(frozen=True)
class ModelFacts:
    """The model's sizes and choices, as its graph has them.

    Attributes
    ----------
    model
        The defmodel's name: every parameter's path starts with it.
    seq
        The positions of one row.
    attentions
        Attention calls: (heads, key/value heads, head size, causal), in order.
    layernorm_eps
        The epsilons of the fused layernorms.
    rope_bases
        The bases of rotary embeddings (constants raised to a power of the
        position's frequency index).
    ops
        Every op the output graph uses.
    """

    model: str
    seq: int
    attentions: tuple[tuple[int, int, int, bool], ...]
    layernorm_eps: frozenset[float]
    rope_bases: frozenset[float]
    ops: frozenset[Op]


def model_facts(experiment: Any, run: Any) -> ModelFacts:
    """Trace `run`'s model (one row, f32) and read its facts."""
    trace = trace_run(experiment, dataclasses.replace(run, batch=1, dtype="f32"))
    assert trace.output is not None
    nodes = topological_order([trace.output])
    attentions = []
    for node in nodes:
        if node.op is Op.ATTENTION:
            q, k = node.inputs[0], node.inputs[1]
            kv = _repeated_heads(k)
            attentions.append((q.shape[-3], kv, q.shape[-1], bool(node.attrs.get("causal"))))
    eps = {float(n.attrs["eps"]) for n in nodes if n.op is Op.LAYERNORM}
    bases = {
        float(n.inputs[0].attrs["value"])
        for n in nodes
        if n.op is Op.POW and n.inputs[0].op is Op.CONSTANT and not n.inputs[0].shape
    }
    seq = next(iter(trace.inputs.values())).shape[-1] if trace.inputs else 0
    return ModelFacts(
        run.model,
        seq,
        tuple(attentions),
        frozenset(eps),
        frozenset(bases),
        frozenset(n.op for n in nodes),
    )


def _repeated_heads(k: Node) -> int:
    """The key/value heads before a repeat written by hand gave them one per query head."""
    # (.. K S D) -> reshape (.. K 1 S D) -> broadcast (.. K G S D) -> reshape (.. H S D)
    if k.op is Op.RESHAPE and k.inputs[0].op is Op.BROADCAST_TO:
        return k.inputs[0].shape[-4]
    return k.shape[-3]
