"""Every IR op as a PyTorch call: `LOWERINGS[op](node, *tensors) -> tensor`.

One small function per op, registered with `lowering`, which also records
the torch call it makes (`TORCH_CALLS`, printed by the lowering report). The
meaning is the interpreter's (`sexpgpu.ir.numpy_impl`, `numpy_fused`):

* NumPy broadcasting (torch's is the same) and one dtype per binary op;
* ``bf16`` values are real ``torch.bfloat16`` tensors. Torch computes each
  bf16 op in f32 and rounds its result once, as the interpreter does; the
  fused normalizations, softmax and cross-entropy do the same inside;
* cross-entropy works in f32 for bf16 logits and gives f32 (the loss is
  never bf16-quantized);
* int32 stays int32 (sums included), bool stays bool.

Leaves: INPUT and PARAM are fed by the caller (`LOWERING_EXEMPT`);
CONSTANT and IOTA take the ``torch.device`` in place of operands, so the
executor makes them once, at plan time.

Precision of products: matmuls go through ``torch.matmul`` (cuBLAS on a
GPU) with f32 accumulation. TF32 would silently round f32 operands to 10
mantissa bits, so f32 graphs must run with
``torch.backends.cuda.matmul.allow_tf32 = False``, PyTorch's default, which
the cuda device sets once when it opens (`sexpgpu.devices.cuda.process`).
bf16 products keep cuBLAS's defaults.

torch is imported here, so this module is imported only lazily, by the
cuda device.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from sexpgpu.devices.cuda import (
    scatter_rows,  # noqa: F401  (registers torch.ops.sexpgpu.scatter_rows)
    xent,  # noqa: F401  (registers torch.ops.sexpgpu.xent_with_grad)
)
from sexpgpu.devices.cuda.attention import sdpa_backward, sdpa_forward, select_sdpa_backend
from sexpgpu.ir.counter_rng import GOLDEN, MIX_MULTIPLIERS, mix32
from sexpgpu.ir.dtypes import DType
from sexpgpu.ir.node import ConstArray, Node
from sexpgpu.ir.numpy_fused import check_ids
from sexpgpu.ir.ops import FED, Op

__all__ = [
    "LOWERINGS",
    "LOWERING_EXEMPT",
    "TORCH_CALLS",
    "TORCH_DTYPES",
    "ids_checked_by_caller",
    "lowering",
    "torch_dtype",
]

T = torch.Tensor
LOWERINGS: dict[Op, Callable[..., T]] = {}
TORCH_CALLS: dict[Op, str] = {}  # what each lowering calls, for the report
# Ops without a lowering: the leaves the caller feeds.
LOWERING_EXEMPT = FED

TORCH_DTYPES = {
    DType.F32: torch.float32,
    DType.BF16: torch.bfloat16,
    DType.F64: torch.float64,
    DType.INT32: torch.int32,
    DType.BOOL: torch.bool,
}


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype that stores IR `dtype` (bf16 -> ``torch.bfloat16``)."""
    return TORCH_DTYPES[dtype]


def lowering(*ops: Op, call: str) -> Callable:
    """Register the decorated function as the lowering of `ops`, which makes the torch `call`."""

    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        for op in ops:
            assert op not in LOWERINGS, f"{op} lowered twice"
            LOWERINGS[op] = fn
            TORCH_CALLS[op] = call
        return fn

    return decorate


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic type for a fused op's internals: bf16 widens to f32."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


# Set while a caller has checked every id on the host (`ids_checked_by_caller`).
_IDS_CHECKED = contextvars.ContextVar("ids_checked", default=False)


@contextlib.contextmanager
def ids_checked_by_caller() -> Iterator[None]:
    """Skip the device-side id checks: the caller checked the ids on the host.

    A graph traced for compilation cannot read a device value back, and a
    CUDA gather past its table would stop the whole process, so the traced
    path checks its fed ids before uploading them.
    """
    token = _IDS_CHECKED.set(True)
    try:
        yield
    finally:
        _IDS_CHECKED.reset(token)


def _check_ids(node: Node, ids: T, size: int) -> None:
    """E-DATA-006 at the node's span unless every id lies in ``[0, size)`` (as the interpreter)."""
    if ids.numel() and not _IDS_CHECKED.get():
        low, high = torch.aminmax(ids)
        check_ids(node, np.array([int(low), int(high)]), size)


# ---------------------------------------------------------------- leaves


@lowering(Op.CONSTANT, call="torch.tensor (made once)")
def _constant(node: Node, device: torch.device) -> T:
    value = node.attrs["value"]
    if isinstance(value, ConstArray):
        array = torch.from_numpy(np.array(value.array))
        return array.to(device=device, dtype=torch_dtype(node.dtype))
    # Through f32 as the interpreter (an f64 literal rounds once to f32, then to bf16).
    start = torch.float32 if node.dtype is DType.BF16 else torch_dtype(node.dtype)
    scalar = torch.tensor(value, dtype=start, device=device).to(torch_dtype(node.dtype))
    return scalar.expand(node.shape)


@lowering(Op.IOTA, call="torch.arange (made once)")
def _iota(node: Node, device: torch.device) -> T:
    axis, shape = node.attrs["axis"], node.shape
    wide = torch.float32 if node.dtype is DType.BF16 else torch_dtype(node.dtype)
    line = torch.arange(shape[axis], dtype=wide, device=device).to(torch_dtype(node.dtype))
    view = [-1 if i == axis else 1 for i in range(len(shape))]
    return line.reshape(view).expand(shape)


# ---------------------------------------------------------------- elementwise


def _plain(fn: Callable[..., T], name: str) -> Callable[..., T]:
    def run(node: Node, *args: T) -> T:
        return fn(*args)

    run.__name__ = name
    return run


for _op, _fn, _name in [
    (Op.NEG, torch.neg, "torch.neg"),
    (Op.EXP, torch.exp, "torch.exp"),
    (Op.LOG, torch.log, "torch.log"),
    (Op.SQRT, torch.sqrt, "torch.sqrt"),
    (Op.RSQRT, torch.rsqrt, "torch.rsqrt"),
    (Op.TANH, torch.tanh, "torch.tanh"),
    (Op.SIGMOID, torch.sigmoid, "torch.sigmoid"),
    (Op.SIN, torch.sin, "torch.sin"),
    (Op.COS, torch.cos, "torch.cos"),
    (Op.ABS, torch.abs, "torch.abs"),
    (Op.SIGN, torch.sign, "torch.sign"),
    (Op.ADD, torch.add, "torch.add"),
    (Op.SUB, torch.sub, "torch.sub"),
    (Op.MUL, torch.mul, "torch.mul"),
    (Op.DIV, torch.div, "torch.div"),
    (Op.POW, torch.pow, "torch.pow"),
    (Op.MAXIMUM, torch.maximum, "torch.maximum"),
    (Op.MINIMUM, torch.minimum, "torch.minimum"),
    (Op.LT, torch.lt, "torch.lt"),
    (Op.LE, torch.le, "torch.le"),
    (Op.EQ, torch.eq, "torch.eq"),
    (Op.WHERE, torch.where, "torch.where"),
]:
    lowering(_op, call=_name)(_plain(_fn, _name))


_WORD = 0xFFFFFFFF


def _mix32(x: T) -> T:
    """`sexpgpu.ir.counter_rng.mix32` on 32-bit words held in int64 (torch lacks uint32 math)."""
    first, second = MIX_MULTIPLIERS
    x = x ^ (x >> 16)
    x = (x * first) & _WORD
    x = x ^ (x >> 15)
    x = (x * second) & _WORD
    return x ^ (x >> 16)


@lowering(Op.UNIFORM, call="counter-based hash (int64 words)")
def _uniform(node: Node, key: T, counter: T) -> T:
    salt = int(mix32(np.uint32(node.attrs["salt"])))  # a number of the node: mixed here
    k = _mix32((key.long() & _WORD) ^ salt)
    h = _mix32(_mix32(((counter.long() & _WORD) + k) & _WORD) ^ _mix32((k + GOLDEN) & _WORD))
    return (h >> 8).to(torch.float32) * 2.0**-24


@lowering(Op.CAST, call="Tensor.to")
def _cast(node: Node, x: T) -> T:
    target = torch_dtype(node.dtype)
    if target == torch.bfloat16 and x.dtype != torch.float32:
        x = x.float()  # the interpreter goes through f32, then rounds to bf16
    return x.to(target)


# ---------------------------------------------------------------- reductions


# A float sum of at most this many terms, none along the last axis, is written as adds.
SHORT_SUM = 16


@lowering(Op.SUM, call="torch.sum")
def _sum(node: Node, x: T) -> T:
    axes, keep = sorted(a % x.dim() for a in node.attrs["axes"]), node.attrs["keepdims"]
    if not axes:  # torch would read dim=[] as every axis
        return x
    terms = math.prod(x.shape[a] for a in axes)
    if x.is_floating_point() and x.dim() - 1 not in axes and 1 < terms <= SHORT_SUM:
        return _sum_by_adds(x, axes, keep, terms)
    # int32 sums stay int32 (torch would widen them to int64).
    dtype = x.dtype if x.dtype == torch.int32 else None
    return torch.sum(x, dim=axes, keepdim=keep, dtype=dtype)


def _sum_by_adds(x: T, axes: list[int], keep: bool, terms: int) -> T:
    """A few terms along outer axes (stacked microbatches, grouped heads' gradients
    where attention is decomposed), summed by adds in f32 (f64 stays f64), rounded
    once, as torch.sum does.

    Inductor makes a reduction over a short outer axis a kernel that reads
    its operand at about a third of the copy rate (81 against 34 us for
    TinyLlama's key gradients, benches/README.md); adds of slices make one
    pointwise kernel that reads each slice as a row, and fuses with what reads
    the sum.
    """
    rows = x.movedim(axes, list(range(len(axes)))).reshape(
        terms, *(n for i, n in enumerate(x.shape) if i not in axes)
    )
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    total = rows[0].to(wide)
    for i in range(1, terms):
        total = total + rows[i].to(wide)
    total = total.to(x.dtype)
    for a in axes if keep else ():
        total = total.unsqueeze(a)
    return total


@lowering(Op.MAX, call="torch.amax")
def _max(node: Node, x: T) -> T:
    axes, keep = list(node.attrs["axes"]), node.attrs["keepdims"]
    return torch.amax(x, dim=axes, keepdim=keep) if axes else x


# ---------------------------------------------------------------- movement


@lowering(Op.RESHAPE, call="Tensor.reshape")
def _reshape(node: Node, x: T) -> T:
    return x.reshape(node.shape)


@lowering(Op.TRANSPOSE, call="Tensor.permute")
def _transpose(node: Node, x: T) -> T:
    return x.permute(node.attrs["axes"])


@lowering(Op.BROADCAST_TO, call="torch.broadcast_to")
def _broadcast_to(node: Node, x: T) -> T:
    return torch.broadcast_to(x, node.shape)


@lowering(Op.SLICE, call="Tensor.narrow")
def _slice(node: Node, x: T) -> T:
    start, stop = node.attrs["start"], node.attrs["stop"]
    return x.narrow(node.attrs["axis"], start, stop - start)


@lowering(Op.PAD, call="Tensor.new_zeros + copy_")
def _pad(node: Node, x: T) -> T:
    axis, before = node.attrs["axis"], node.attrs["before"]
    result = x.new_zeros(node.shape)
    result.narrow(axis, before, x.shape[axis]).copy_(x)
    return result


@lowering(Op.CONCAT, call="torch.cat")
def _concat(node: Node, *xs: T) -> T:
    return torch.cat(xs, dim=node.attrs["axis"])


@lowering(Op.TAKE, call="Tensor.index_select")
def _take(node: Node, table: T, ids: T) -> T:
    _check_ids(node, ids, table.shape[0])
    return table.index_select(0, ids.reshape(-1)).reshape(node.shape)


@lowering(Op.SCATTER_ADD, call="sexpgpu::scatter_rows (Tensor.index_add_ unless deterministic)")
def _scatter_add(node: Node, ids: T, updates: T) -> T:
    # bf16 rows are summed in f32 and rounded once, as the interpreter does.
    wide = _wide(updates.dtype)
    flat = ids.reshape(-1)
    rows = updates.reshape(flat.numel(), math.prod(node.shape[1:])).to(wide)
    table = torch.ops.sexpgpu.scatter_rows(flat, rows, node.shape[0])
    return table.reshape(node.shape).to(updates.dtype)


# ---------------------------------------------------------------- products


@lowering(Op.MATMUL, call="torch.matmul (cuBLAS on CUDA)")
def _matmul(node: Node, a: T, b: T) -> T:
    return torch.matmul(a, b)


# ---------------------------------------------------------------- fused


@lowering(Op.SOFTMAX, call="aten._softmax")
def _softmax(node: Node, x: T) -> T:
    return torch.ops.aten._softmax(x, node.attrs["axis"], False)


@lowering(Op.LOG_SOFTMAX, call="aten._log_softmax")
def _log_softmax(node: Node, x: T) -> T:
    return torch.ops.aten._log_softmax(x, node.attrs["axis"], False)


@lowering(Op.SOFTMAX_GRAD, call="aten._softmax_backward_data")
def _softmax_grad(node: Node, y: T, g: T) -> T:
    return torch.ops.aten._softmax_backward_data(g, y, node.attrs["axis"], y.dtype)


def _rows(logits: T, targets: T) -> tuple[T, T]:
    """Logits as ``[rows classes]`` in their arithmetic type and int64 ids ``[rows]``."""
    flat = logits.reshape(-1, logits.shape[-1]).to(_wide(logits.dtype))
    return flat, targets.reshape(-1).long()


# Both written as a log-sum-exp per row and elementwise work over the row, so
# that Inductor fuses each into one reduction and one pass over the logits:
# the [rows vocab] f32 probabilities are never materialized on the fused path.
# Where the graph has both, the executor hands the forward's log-sum-exp to the
# gradient, which is then one pass that reads the logits and writes its result.


def cross_entropy_and_lse(node: Node, logits: T, targets: T) -> tuple[T, T]:
    """The per-row loss and the log-sum-exp of every row (f32 for bf16)."""
    _check_ids(node, targets, logits.shape[-1])
    flat, ids = _rows(logits, targets)
    picked = flat.gather(1, ids[:, None])[:, 0]
    lse = torch.logsumexp(flat, dim=-1)
    return (lse - picked).reshape(targets.shape).to(torch_dtype(node.dtype)), lse


@lowering(Op.CROSS_ENTROPY_GRAD, call="exp(x - logsumexp) - onehot, times g (f32 for bf16)")
def cross_entropy_grad(node: Node, logits: T, targets: T, g: T, lse: T | None = None) -> T:
    """``g * (softmax(logits) - onehot(targets))``, row by row.

    `lse` is each row's log-sum-exp where the executor kept the forward's;
    alone, the gradient computes it.
    """
    _check_ids(node, targets, logits.shape[-1])
    flat, ids = _rows(logits, targets)
    if lse is None:
        lse = torch.logsumexp(flat, dim=-1)
    probs = (flat - lse[:, None]).exp_()  # in place where op by op
    classes = torch.arange(flat.shape[1], device=flat.device)
    probs.sub_((classes == ids[:, None]).to(probs.dtype))
    probs.mul_(g.reshape(-1, 1).to(probs.dtype))
    return probs.reshape(logits.shape).to(torch_dtype(node.dtype))


def cross_entropy_with_grad(
    node: Node, grad: Node, logits: T, targets: T, g: T, over: bool = False
) -> tuple[T, T]:
    """The per-row loss of `node` and its gradient `grad` (``g``: a weight a row), in one kernel.

    `over`: the gradient is written over the logits, which nothing reads
    after (`TorchGraph` decides; the two have one dtype).
    """
    _check_ids(node, targets, logits.shape[-1])
    flat = logits.reshape(-1, logits.shape[-1])
    weights = g.reshape(-1)
    if over:
        flat = flat if flat.is_contiguous() else flat.contiguous()  # rows of their own
        loss = torch.ops.sexpgpu.xent_with_grad_over(flat, targets.reshape(-1), weights)
        out = flat
    else:
        loss, out = torch.ops.sexpgpu.xent_with_grad(
            flat, targets.reshape(-1), weights, torch_dtype(grad.dtype)
        )
    return loss.reshape(targets.shape).to(torch_dtype(node.dtype)), out.reshape(logits.shape)


@lowering(
    Op.CROSS_ENTROPY,
    call="the loss in one pass (sexpgpu::xent_loss: Triton on a GPU; torch.logsumexp - gather)",
)
def _cross_entropy(node: Node, logits: T, targets: T) -> T:
    _check_ids(node, targets, logits.shape[-1])
    flat = logits.reshape(-1, logits.shape[-1])  # as they are: the kernel reads bf16
    loss = torch.ops.sexpgpu.xent_loss(flat, targets.reshape(-1))
    return loss.reshape(targets.shape).to(torch_dtype(node.dtype))


@lowering(Op.ATTENTION, call="scaled-dot-product attention")
def _attention(node: Node, q: T, k: T, v: T) -> T:
    backend = select_sdpa_backend(q.device, q.dtype)
    return sdpa_forward(q, k, v, node.attrs["causal"], node.attrs["scale"], backend)[0]


@lowering(Op.ATTENTION_GRAD, call="scaled-dot-product attention backward")
def _attention_grad(node: Node, q: T, k: T, v: T, g: T) -> T:
    # Alone it runs the forward first; the executor passes the forward's aux instead.
    backend = select_sdpa_backend(q.device, q.dtype)
    causal, scale = node.attrs["causal"], node.attrs["scale"]
    return torch.cat(sdpa_backward(g, q, k, v, causal, scale, None, backend), q.dim() - 3)


def _layernorm_stats(node: Node, x: T) -> tuple[T, T, T]:
    """(normalized x, mean, rstd) over the last axis, no weight or bias."""
    return torch.ops.aten.native_layer_norm(x, [x.shape[-1]], None, None, node.attrs["eps"])


@lowering(Op.LAYERNORM, call="aten.native_layer_norm")
def _layernorm(node: Node, x: T) -> T:
    return _layernorm_stats(node, x)[0]


@lowering(Op.LAYERNORM_GRAD, call="aten.native_layer_norm_backward")
def _layernorm_grad(node: Node, x: T, g: T) -> T:
    # The statistics are recomputed from x, as the IR's layernorm-grad says.
    _, mean, rstd = _layernorm_stats(node, x)
    mask = [True, False, False]
    return torch.ops.aten.native_layer_norm_backward(
        g, x, [x.shape[-1]], mean, rstd, None, None, mask
    )[0]


@lowering(Op.GELU, call="torch.nn.functional.gelu (tanh)")
def _gelu(node: Node, x: T) -> T:
    return F.gelu(x, approximate="tanh")


@lowering(Op.GELU_GRAD, call="aten.gelu_backward (tanh)")
def _gelu_grad(node: Node, x: T, g: T) -> T:
    return torch.ops.aten.gelu_backward(g, x, approximate="tanh")


assert frozenset(Op) == frozenset(LOWERINGS) | LOWERING_EXEMPT
