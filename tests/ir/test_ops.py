"""Every op against PyTorch (forward, autograd) and finite differences, via `check_op`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ir_opcheck import Arg, check_op, ops_built

from sexpgpu.ir import builder as b
from sexpgpu.ir.ops import Op
from sexpgpu.ir.vocabulary_layers import dropped, rotary

A = Arg


def _ce(logits, t):
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1), reduction="none")
    return flat.reshape(t.shape)


def _scatter_add(ids, updates, rows):
    out = torch.zeros((rows, *updates.shape[ids.dim() :]), dtype=updates.dtype)
    return out.index_add(0, ids.reshape(-1), updates.reshape(-1, *updates.shape[ids.dim() :]))


def _softmax_grad(y, g):
    return y * (g - (g * y).sum(-1, keepdim=True))


def _ce_grad(logits, t, g):
    onehot = F.one_hot(t, logits.shape[-1]).to(logits.dtype)
    return g[..., None] * (torch.softmax(logits, -1) - onehot)


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.7)


def _sdpa_grad(q, k, v, g):
    # dq, dk, dv joined on the head axis; grouped heads as PyTorch's enable_gqa reads them
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.7, enable_gqa=True)
    (out * g).sum().backward()
    return torch.cat([q.grad, k.grad, v.grad], -3)


def _layernorm_grad(x, g):
    x = x.detach().requires_grad_(True)
    (F.layer_norm(x, (x.shape[-1],), eps=1e-3) * g).sum().backward()
    return x.grad


def _gelu_grad(x, g):
    x = x.detach().requires_grad_(True)
    (F.gelu(x, approximate="tanh") * g).sum().backward()
    return x.grad


def _mix(x):
    # docs/ir.md's 32-bit mix, written out again on int64 words (the spec, not the lowering)
    x = (x ^ (x >> 16)) * 0x7FEB352D % 2**32
    x = (x ^ (x >> 15)) * 0x846CA68B % 2**32
    return x ^ (x >> 16)


def _uniform(key, counter, salt=77):
    k = _mix(key % 2**32 ^ _mix(torch.tensor(salt)))
    h = _mix(_mix((counter % 2**32 + k) % 2**32) ^ _mix((k + 0x9E3779B9) % 2**32))
    return (h >> 8).to(torch.float32) / 2**24


def _rope(x, base=100.0):
    # Llama's rotate_half on [.. seq heads d]
    s, d = x.shape[-3], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    theta = torch.arange(s, dtype=torch.float64)[:, None] * inv
    cos, sin = (
        torch.cat([f(theta)] * 2, -1)[:, None, :].to(x.dtype) for f in (torch.cos, torch.sin)
    )
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _gqa(q, k, v, scale=0.6):
    group = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(group, dim=-3) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _dropout(x, p=0.3):
    u = _uniform(torch.tensor(11), torch.arange(x.numel()).reshape(x.shape), salt=5)
    return torch.where(u >= p, x * (1 / (1 - p)), torch.zeros((), dtype=x.dtype))


def _case(name: str, build, torch_fn, *args: Arg, grad: bool = True):
    """One op check: `build` against `torch_fn` on `args`, and their gradients if `grad`."""
    return pytest.param(build, torch_fn, list(args), grad, id=name)


CASES = [
    _case("neg", b.neg, torch.neg, A((3, 4))),
    _case("exp", b.exp, torch.exp, A((3, 4))),
    _case("log", b.log, torch.log, A((5,), "positive")),
    _case("sqrt", b.sqrt, torch.sqrt, A((2, 3), "positive")),
    _case("rsqrt", b.rsqrt, torch.rsqrt, A((2, 3), "positive")),
    _case("tanh", b.tanh, torch.tanh, A((2, 3, 2))),
    _case("sigmoid", b.sigmoid, torch.sigmoid, A((4, 3))),
    _case("abs", b.abs, torch.abs, A((4, 3))),
    _case("sign", b.sign, torch.sign, A((4, 3)), grad=False),
    _case("sin", b.sin, torch.sin, A((3, 4))),
    _case("cos", b.cos, torch.cos, A((2, 5))),
    _case(
        "uniform",
        lambda k, c: b.uniform(k, c, salt=77),
        _uniform,
        A((3, 1), "int1000"),
        A((40,), "int100000"),
        grad=False,
    ),
    _case(
        "cast",
        lambda x: b.cast(b.cast(x, "f64"), x.dtype),
        lambda x: x.to(torch.float64).to(x.dtype),
        A((3, 2)),
    ),
    _case("cast-int", lambda i: b.cast(i, "f32"), lambda i: i.float(), A((5,), "int9"), grad=False),
    _case("add", b.add, torch.add, A((3, 1, 4)), A((2, 4))),
    _case("sub", b.sub, torch.sub, A((4,)), A((3, 4))),
    _case("mul", b.mul, torch.mul, A((2, 3, 1)), A((1, 4))),
    _case("div", b.div, torch.div, A((3, 4)), A((3, 1), "positive")),
    _case("pow", b.pow, torch.pow, A((3, 4), "positive"), A((4,))),
    _case("maximum", b.maximum, torch.maximum, A((3, 4)), A((1, 4))),
    _case("minimum", b.minimum, torch.minimum, A((2, 3)), A((2, 3))),
    _case("lt", b.lt, torch.lt, A((3, 4)), A((4,)), grad=False),
    _case("le", b.le, torch.le, A((3, 1)), A((3, 4)), grad=False),
    _case("eq", b.eq, torch.eq, A((2, 5), "int3"), A((5,), "int3"), grad=False),
    _case("where", b.where, torch.where, A((3, 4), "bool"), A((3, 4)), A((4,))),
    _case("sum-all", b.sum, torch.sum, A((3, 4))),
    _case(
        "sum-keep",
        lambda x: b.sum(x, axes=(0, -1), keepdims=True),
        lambda x: x.sum((0, -1), keepdim=True),
        A((2, 3, 4)),
    ),
    _case("max", lambda x: b.max(x, axes=1), lambda x: torch.amax(x, 1), A((3, 5, 2))),
    _case("reshape", lambda x: b.reshape(x, (4, -1)), lambda x: x.reshape(4, -1), A((2, 3, 4))),
    _case(
        "transpose", lambda x: b.transpose(x, (2, 0, 1)), lambda x: x.permute(2, 0, 1), A((2, 3, 4))
    ),
    _case(
        "broadcast-to",
        lambda x: b.broadcast_to(x, (2, 3, 4)),
        lambda x: x.expand(2, 3, 4),
        A((3, 1)),
    ),
    _case("slice", lambda x: b.slice(x, 1, 1, 3), lambda x: x[:, 1:3], A((2, 5, 2))),
    _case("pad", lambda x: b.pad(x, 0, 2, 1), lambda x: F.pad(x, (0, 0, 2, 1)), A((2, 3))),
    _case(
        "concat",
        lambda x, y: b.concat([x, y, x], axis=-1),
        lambda x, y: torch.cat([x, y, x], -1),
        A((2, 3)),
        A((2, 1)),
    ),
    _case("take", b.take, lambda t, i: t[i], A((6, 3)), A((2, 5), "int6")),
    _case(
        "scatter-add",
        lambda i, u: b.scatter_add(i, u, rows=4),
        lambda i, u: _scatter_add(i, u, 4),
        A((3, 5), "int4"),
        A((3, 5, 2)),
    ),
    _case("matmul", b.matmul, torch.matmul, A((3, 4)), A((4, 2))),
    _case("matmul-batched", b.matmul, torch.matmul, A((2, 1, 3, 4)), A((3, 4, 2))),
    _case("matmul-weight", b.matmul, torch.matmul, A((2, 3, 4)), A((4, 5))),
    _case("softmax", lambda x: b.softmax(x, axis=1), lambda x: torch.softmax(x, 1), A((2, 4, 3))),
    _case("log-softmax", b.log_softmax, lambda x: torch.log_softmax(x, -1), A((3, 5))),
    _case(
        "softmax-grad",
        lambda y, g: b.softmax_grad(y, g, axis=-1),
        _softmax_grad,
        A((3, 5), "positive"),
        A((3, 5)),
        grad=False,
    ),
    _case("cross-entropy", b.cross_entropy, _ce, A((2, 3, 7)), A((2, 3), "int7")),
    _case(
        "cross-entropy-grad",
        b.cross_entropy_grad,
        _ce_grad,
        A((4, 6)),
        A((4,), "int6"),
        A((4,)),
        grad=False,
    ),
    _case(
        "attention-causal",
        lambda q, k, v: b.attention(q, k, v, causal=True, scale=0.7),
        lambda q, k, v: _sdpa(q, k, v, True),
        A((2, 2, 5, 3)),
        A((2, 2, 5, 3)),
        A((2, 2, 5, 3)),
    ),
    _case(
        "attention",
        lambda q, k, v: b.attention(q, k, v, causal=False, scale=0.7),
        lambda q, k, v: _sdpa(q, k, v, False),
        A((1, 4, 3)),
        A((1, 4, 3)),
        A((1, 4, 3)),
    ),
    _case(
        "attention-grouped",
        lambda q, k, v: b.attention(q, k, v, causal=True, scale=0.7),
        lambda q, k, v: _gqa(q, k, v, 0.7),
        A((2, 6, 5, 3)),
        A((2, 2, 5, 3)),
        A((2, 2, 5, 3)),
    ),
    _case(
        "attention-grad",
        lambda q, k, v, g: b.attention_grad(q, k, v, g, causal=True, scale=0.7),
        _sdpa_grad,
        A((3, 4, 2)),
        A((3, 4, 2)),
        A((3, 4, 2)),
        A((3, 4, 2)),
        grad=False,
    ),
    _case(
        "attention-grad-grouped",
        lambda q, k, v, g: b.attention_grad(q, k, v, g, causal=True, scale=0.7),
        _sdpa_grad,
        A((2, 4, 3, 2)),
        A((2, 1, 3, 2)),
        A((2, 1, 3, 2)),
        A((2, 4, 3, 2)),
        grad=False,
    ),
    _case(
        "layernorm",
        lambda x: b.layernorm(x, eps=1e-3),
        lambda x: F.layer_norm(x, (x.shape[-1],), eps=1e-3),
        A((2, 3, 6)),
    ),
    _case(
        "layernorm-grad",
        lambda x, g: b.layernorm_grad(x, g, eps=1e-3),
        _layernorm_grad,
        A((3, 5)),
        A((3, 5)),
        grad=False,
    ),
    _case("gelu", b.gelu, lambda x: F.gelu(x, approximate="tanh"), A((4, 5))),
    _case("gelu-grad", b.gelu_grad, _gelu_grad, A((4, 5)), A((4, 5)), grad=False),
    _case("rope", lambda x: rotary(x, 100.0), _rope, A((2, 5, 3, 4))),
    _case(
        "sdpa-grouped",
        lambda q, k, v: b.attention(q, k, v, causal=True, scale=0.6),
        _gqa,
        A((2, 4, 5, 3)),
        A((2, 2, 5, 3)),
        A((2, 2, 5, 3)),
    ),
    _case(
        "dropout",
        lambda x: dropped(x, b.constant(11, "int32"), 5, 0.3),
        _dropout,
        A((3, 7)),
    ),
    _case(
        "constant-iota",
        lambda x: b.mul(b.add(x, b.cast(b.iota((2, 3), 1), x.dtype)), b.constant(2, x.dtype)),
        lambda x: (x + torch.arange(3).to(x.dtype)) * 2,
        A((2, 3)),
    ),
]


@pytest.mark.parametrize(("build", "torch_fn", "args", "differentiable"), CASES)
def test_op(build, torch_fn, args, differentiable):
    check_op(build, torch_fn, args, differentiable=differentiable)


def test_every_op_is_checked():
    built = set().union(*(ops_built(case.values[0], case.values[2]) for case in CASES))
    covered = built | {Op.PARAM}  # fed like INPUT: nothing of its own to check
    assert covered == set(Op), set(Op) - covered


def test_harness_can_fail():
    with pytest.raises(AssertionError):
        check_op(b.exp, lambda x: torch.exp(x) * 1.001, [A((3,))], dtypes=("f64",))
    with pytest.raises(AssertionError):
        # a wrong VJP: sqrt's forward with tanh's derivative
        check_op(
            lambda x: b.sqrt(x),
            lambda x: torch.sqrt(x.detach()) + torch.tanh(x) - torch.tanh(x.detach()),
            [A((3,), "positive")],
            dtypes=("f64",),
        )


def test_constant_is_rounded_and_broadcast():
    x = b.input("x", (2, 2), "bf16")
    from sexpgpu.devices.cpu import run
    from sexpgpu.ir.node import Graph

    y = b.add(x, b.constant(1 / 3, "bf16", shape=(2, 2)))
    got = run(Graph.of({"y": y}), {"x": np.zeros((2, 2))})["y"]
    want = torch.full((2, 2), 1 / 3).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_in_several_row_blocks(monkeypatch, causal):
    from sexpgpu.ir import numpy_fused

    monkeypatch.setattr(numpy_fused, "_ATTENTION_ROWS", 3)
    check_op(
        lambda q, k, v: b.attention(q, k, v, causal=causal),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
        [A((4, 8, 4)), A((2, 8, 4)), A((2, 8, 4))],
        dtypes=("f64", "f32"),
    )


def _random_broadcast_pair(rng: np.random.Generator) -> tuple[tuple[int, ...], tuple[int, ...]]:
    out = tuple(int(d) for d in rng.integers(1, 4, size=rng.integers(1, 4)))
    a = tuple(d if rng.random() < 0.6 else 1 for d in out)
    b_ = tuple(d if rng.random() < 0.6 else 1 for d in out)[int(rng.integers(0, len(out))) :]
    return a, b_


@pytest.mark.parametrize("seed", range(6))
def test_binary_ops_on_random_broadcast_shapes(seed):
    rng = np.random.default_rng(100 + seed)
    sa, sb = _random_broadcast_pair(rng)
    for build, fn, kinds in [
        (b.add, torch.add, ("float", "float")),
        (b.mul, torch.mul, ("float", "float")),
        (b.div, torch.div, ("float", "positive")),
        (b.maximum, torch.maximum, ("float", "float")),
    ]:
        check_op(build, fn, [A(sa, kinds[0]), A(sb, kinds[1])], seed=seed, dtypes=("f64", "f32"))
    cond = A(sb, "bool")
    check_op(b.where, torch.where, [cond, A(sa), A(sb)], seed=seed, dtypes=("f64",))
