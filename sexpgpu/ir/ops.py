"""The closed op set of the IR, grouped by kind.

Every op has a shape/dtype rule, a NumPy implementation and a VJP in the
tables of `sexpgpu.ir.rules` (or sits in an explicit exemption set there).
Layers such as ``linear``, ``rmsnorm`` or ``attention`` are composed from
these ops by the tracer; the few fused ops (softmax, log-softmax,
cross-entropy, attention, layernorm, gelu, and the gradients of all but
log-softmax) exist so that the [batch seq vocab] log-probabilities and the [batch
heads seq seq] attention weights are never stored whole, and the
intermediates of a normalization or an activation are not stored at all.

Attributes per op (in ``Node.attrs``):

==================  ==========================================================
op                  attrs
==================  ==========================================================
INPUT, PARAM        name: str, shape, dtype
CONSTANT            value: int | float | bool | ConstArray, shape, dtype
IOTA                axis: int (values count along this axis), shape, dtype
CAST                dtype: DType (the target, also ``Node.dtype``)
SUM, MAX            axes: tuple[int, ...] (sorted, non-negative), keepdims: bool
RESHAPE             shape: tuple[int, ...] (the result's)
TRANSPOSE           axes: tuple[int, ...] (a permutation)
BROADCAST_TO        shape: tuple[int, ...] (the result's)
SLICE               axis: int, start: int, stop: int
PAD                 axis: int, before: int, after: int (zeros)
CONCAT              axis: int
SCATTER_ADD         rows: int (first axis of the result)
SOFTMAX, ...        axis: int (SOFTMAX, LOG_SOFTMAX, SOFTMAX_GRAD)
ATTENTION, ..._GRAD causal: bool, scale: float
LAYERNORM, ..._GRAD eps: float (normalizes over the last axis)
UNIFORM             salt: int (a 31-bit number telling one call site's stream
                    from another's; see docs/ir.md, "Random numbers")
==================  ==========================================================
"""

from __future__ import annotations

from enum import Enum, auto

__all__ = [
    "BINARY",
    "COMPARISON",
    "ELEMENTWISE",
    "FED",
    "FUSED",
    "LEAF",
    "MOVEMENT",
    "PRODUCT",
    "RANDOM",
    "REDUCE",
    "UNARY",
    "VIEW",
    "Op",
]


class Op(Enum):
    """One IR operation. Printed lower-case with dashes (``Op.LOG_SOFTMAX`` -> log-softmax)."""

    # leaves
    INPUT = auto()
    PARAM = auto()
    CONSTANT = auto()
    IOTA = auto()
    # elementwise unary
    NEG = auto()
    EXP = auto()
    LOG = auto()
    SQRT = auto()
    RSQRT = auto()
    TANH = auto()
    SIGMOID = auto()
    ABS = auto()
    SIGN = auto()
    SIN = auto()
    COS = auto()
    CAST = auto()
    # elementwise binary (NumPy broadcasting)
    ADD = auto()
    SUB = auto()
    MUL = auto()
    DIV = auto()
    POW = auto()
    MAXIMUM = auto()
    MINIMUM = auto()
    LT = auto()
    LE = auto()
    EQ = auto()
    # elementwise ternary
    WHERE = auto()
    # counter-based random numbers (elementwise over int32 keys and counters)
    UNIFORM = auto()
    # reductions
    SUM = auto()
    MAX = auto()
    # movement
    RESHAPE = auto()
    TRANSPOSE = auto()
    BROADCAST_TO = auto()
    SLICE = auto()
    PAD = auto()
    CONCAT = auto()
    TAKE = auto()
    SCATTER_ADD = auto()
    # products
    MATMUL = auto()
    # fused
    SOFTMAX = auto()
    LOG_SOFTMAX = auto()
    SOFTMAX_GRAD = auto()
    CROSS_ENTROPY = auto()
    CROSS_ENTROPY_GRAD = auto()
    ATTENTION = auto()
    ATTENTION_GRAD = auto()
    LAYERNORM = auto()
    LAYERNORM_GRAD = auto()
    GELU = auto()
    GELU_GRAD = auto()

    @property
    def label(self) -> str:
        """The printed name: ``log-softmax``."""
        return self.name.lower().replace("_", "-")

    @classmethod
    def from_label(cls, label: str) -> Op:
        """The op printed as `label` (KeyError if none)."""
        return cls[label.upper().replace("-", "_")]


LEAF = frozenset({Op.INPUT, Op.PARAM, Op.CONSTANT, Op.IOTA})
# Leaves whose values the caller feeds by name (the others are computed).
FED = frozenset({Op.INPUT, Op.PARAM})
UNARY = frozenset(
    {
        Op.NEG,
        Op.EXP,
        Op.LOG,
        Op.SQRT,
        Op.RSQRT,
        Op.TANH,
        Op.SIGMOID,
        Op.ABS,
        Op.SIGN,
        Op.SIN,
        Op.COS,
        Op.CAST,
    }
)
COMPARISON = frozenset({Op.LT, Op.LE, Op.EQ})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.POW, Op.MAXIMUM, Op.MINIMUM}) | COMPARISON
# Ops whose value is a hash of their integer operands (no gradient, no state).
RANDOM = frozenset({Op.UNIFORM})
ELEMENTWISE = UNARY | BINARY | {Op.WHERE} | RANDOM
REDUCE = frozenset({Op.SUM, Op.MAX})
MOVEMENT = frozenset(
    {
        Op.RESHAPE,
        Op.TRANSPOSE,
        Op.BROADCAST_TO,
        Op.SLICE,
        Op.PAD,
        Op.CONCAT,
        Op.TAKE,
        Op.SCATTER_ADD,
    }
)
# Movement ops whose CPU result is a view sharing its input's memory.
VIEW = frozenset({Op.RESHAPE, Op.TRANSPOSE, Op.BROADCAST_TO, Op.SLICE})
PRODUCT = frozenset({Op.MATMUL})
FUSED = frozenset(
    {
        Op.SOFTMAX,
        Op.LOG_SOFTMAX,
        Op.SOFTMAX_GRAD,
        Op.CROSS_ENTROPY,
        Op.CROSS_ENTROPY_GRAD,
        Op.ATTENTION,
        Op.ATTENTION_GRAD,
        Op.LAYERNORM,
        Op.LAYERNORM_GRAD,
        Op.GELU,
        Op.GELU_GRAD,
    }
)

assert frozenset(Op) == LEAF | ELEMENTWISE | REDUCE | MOVEMENT | PRODUCT | FUSED
