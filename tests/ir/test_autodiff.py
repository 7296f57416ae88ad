"""Reverse-mode autodiff on composite graphs against PyTorch autograd."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from sexpgpu.devices.cpu import run
from sexpgpu.errors import Source, Span
from sexpgpu.ir import builder as b
from sexpgpu.ir.autodiff import grad, training_graph
from sexpgpu.ir.node import Graph, topological_order
from sexpgpu.ir.verify import verify

RNG = np.random.default_rng(7)


def _c(value, like):
    return b.constant(value, like.dtype)


def _mlp_loss(dtype):
    x = b.input("x", (6, 5), dtype)
    y = b.input("y", (6,), "int32")
    w1, b1 = b.param("w1", (5, 8), dtype), b.param("b1", (8,), dtype)
    w2, b2 = b.param("w2", (8, 4), dtype), b.param("b2", (4,), dtype)
    h = b.maximum(b.add(b.matmul(x, w1), b1), _c(0.0, x))  # relu
    logits = b.add(b.matmul(h, w2), b2)
    loss = b.div(b.sum(b.cross_entropy(logits, y)), _c(6.0, x))
    return Graph.of({"loss": loss})


def _mlp_feeds():
    return {
        "x": RNG.normal(size=(6, 5)),
        "y": RNG.integers(0, 4, size=6).astype(np.int32),
        "w1": RNG.normal(size=(5, 8)) * 0.5,
        "b1": RNG.normal(size=8) * 0.1,
        "w2": RNG.normal(size=(8, 4)) * 0.5,
        "b2": RNG.normal(size=4) * 0.1,
    }


def _torch_mlp(feeds, dtype):
    t = {k: torch.tensor(v, dtype=dtype, requires_grad=k[0] in "wb") for k, v in feeds.items()}
    h = torch.relu(t["x"] @ t["w1"] + t["b1"])
    loss = F.cross_entropy(h @ t["w2"] + t["b2"], torch.tensor(feeds["y"]).long())
    loss.backward()
    return loss.item(), {k: t[k].grad.numpy() for k in ("w1", "b1", "w2", "b2")}


def test_two_layer_mlp_matches_torch_in_f64_and_f32():
    feeds = _mlp_feeds()
    for dtype, tdtype, tol in [("f64", torch.float64, 1e-10), ("f32", torch.float32, 1e-5)]:
        graph = training_graph(_mlp_loss(dtype))
        verify(graph)
        out = run(graph, feeds)
        want_loss, want = _torch_mlp(feeds, tdtype)
        np.testing.assert_allclose(out["loss"], want_loss, rtol=tol)
        for name, g in want.items():
            np.testing.assert_allclose(out[f"grad/{name}"], g, rtol=tol, atol=tol, err_msg=name)


def test_attention_block_matches_torch():
    # softmax(q k^T / sqrt(d) + causal mask) v with heads, then layernorm: the tracer's shapes.
    bsz, heads, seq, dim = 2, 2, 5, 3
    q, k, v = (b.param(n, (bsz, heads, seq, dim), "f64") for n in "qkv")
    gamma = b.param("gamma", (heads * dim,), "f64")
    scores = b.mul(b.matmul(q, b.transpose(k)), _c(dim**-0.5, q))
    causal = b.le(b.iota((seq, seq), 1), b.iota((seq, seq), 0))
    scores = b.where(causal, scores, _c(-1e9, q))
    att = b.matmul(b.softmax(scores, axis=-1), v)  # (B, H, T, D)
    merged = b.reshape(b.transpose(att, (0, 2, 1, 3)), (bsz, seq, heads * dim))
    mean = b.sum(merged, axes=-1, keepdims=True)
    mean = b.div(mean, _c(heads * dim, q))
    centered = b.sub(merged, mean)
    var = b.div(b.sum(b.mul(centered, centered), axes=-1, keepdims=True), _c(heads * dim, q))
    normed = b.mul(b.mul(centered, b.rsqrt(b.add(var, _c(1e-5, q)))), gamma)
    loss = b.sum(b.mul(b.tanh(normed), normed))
    params = [q, k, v, gamma]
    graph = Graph.of({"loss": loss} | {f"g{i}": g for i, g in enumerate(grad(loss, params))})
    verify(graph)
    feeds = {n: RNG.normal(size=p.shape) for n, p in zip("qkvg", params, strict=True)}
    feeds["gamma"] = feeds.pop("g")
    out = run(graph, feeds)

    t = {n: torch.tensor(a, requires_grad=True) for n, a in feeds.items()}
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    s = (t["q"] @ t["k"].transpose(-1, -2)) * dim**-0.5
    a = torch.softmax(s.masked_fill(~mask, -1e9), -1) @ t["v"]
    m = a.transpose(1, 2).reshape(bsz, seq, heads * dim)
    n = F.layer_norm(m, (heads * dim,), eps=1e-5) * t["gamma"]
    tl = (torch.tanh(n) * n).sum()
    tl.backward()
    np.testing.assert_allclose(out["loss"], tl.item(), rtol=1e-10)
    for i, name in enumerate(["q", "k", "v", "gamma"]):
        np.testing.assert_allclose(out[f"g{i}"], t[name].grad.numpy(), rtol=1e-8, atol=1e-10)


def test_fan_out_accumulates_and_broadcast_operands_sum_back():
    x = b.param("x", (3, 1), "f64")
    y = b.mul(b.add(x, b.exp(x)), b.broadcast_to(x, (2, 3, 4)))  # x used three times
    loss = b.sum(y)
    (gx,) = grad(loss, [x])
    value = RNG.normal(size=(3, 1))
    got = run(Graph.of({"g": gx}), {"x": value})["g"]
    t = torch.tensor(value, requires_grad=True)
    ((t + t.exp()) * t.expand(2, 3, 4)).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-12)


def test_backward_nodes_keep_the_forward_span_and_unused_wrt_get_zeros():
    span = Span(Source("m.lisp", "(tanh x)\n"), 1, 1, 1, 9)
    x = b.param("x", (4,), "f32")
    unused = b.param("u", (2, 2), "f32")
    loss = b.sum(b.tanh(x, span=span), span=span)
    gx, gu = grad(loss, [x, unused])
    backward = [n for n in topological_order([gx]) if n.op.label != "param"]
    assert backward and all(n.span is span for n in backward)
    out = run(Graph.of({"gu": gu, "gx": gx}), {"x": np.zeros(4), "u": np.ones((2, 2))})
    np.testing.assert_array_equal(out["gu"], np.zeros((2, 2)))
    np.testing.assert_allclose(out["gx"], np.ones(4))


def test_embedding_gradient_matches_torch():
    table = b.param("wte", (10, 3), "f64")
    ids = b.input("ids", (2, 6), "int32")
    rows = b.take(table, ids)
    loss = b.sum(b.mul(rows, rows))
    (g,) = grad(loss, [table])
    feeds = {"wte": RNG.normal(size=(10, 3)), "ids": RNG.integers(0, 10, (2, 6)).astype(np.int32)}
    got = run(Graph.of({"g": g}), feeds)["g"]
    t = torch.tensor(feeds["wte"], requires_grad=True)
    (t[torch.tensor(feeds["ids"]).long()] ** 2).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-12)


def test_cotangents_of_tiling_slices_are_joined_by_concat():
    qkv = b.param("qkv", (2, 9), "f64")
    q, k, v = (b.slice(qkv, 1, 3 * i, 3 * i + 3) for i in range(3))
    tail = b.slice(qkv, 1, 7, 9)  # overlaps v: added, not joined
    loss = b.sum(b.add(b.mul(q, k), b.tanh(v)))
    (g,) = grad(loss, [qkv])
    assert g.op.label == "concat" and "pad" not in {n.op.label for n in topological_order([g])}
    (g2,) = grad(b.add(loss, b.sum(tail)), [qkv])
    value = RNG.normal(size=(2, 9))
    out = run(Graph.of({"g": g, "g2": g2}), {"qkv": value})
    t = torch.tensor(value, requires_grad=True)
    tq, tk, tv = t[:, :3], t[:, 3:6], t[:, 6:]
    ((tq * tk).sum() + torch.tanh(tv).sum() + t[:, 7:].sum()).backward()
    want = t.grad.numpy().copy()
    want[:, 7:] -= 1
    np.testing.assert_allclose(out["g"], want, rtol=1e-12)
    np.testing.assert_allclose(out["g2"], t.grad.numpy(), rtol=1e-12)


def test_cotangent_with_a_gap_is_padded_with_zeros():
    x = b.param("x", (7,), "f64")
    loss = b.add(b.sum(b.exp(b.slice(x, 0, 1, 3))), b.sum(b.slice(x, 0, 5, 6)))
    (g,) = grad(loss, [x])
    value = RNG.normal(size=7)
    got = run(Graph.of({"g": g}), {"x": value})["g"]
    want = np.zeros(7)
    want[1:3] = np.exp(value[1:3])
    want[5] = 1
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_deep_chains_need_no_recursion():
    x = b.param("x", (3,), "f32")
    y = x
    for _ in range(5000):
        y = b.mul(y, b.constant(1.0001, "f32"))
    (g,) = grad(b.sum(y), [x])
    graph = Graph.of({"g": g})
    verify(graph)
    out = run(graph, {"x": np.ones(3)})["g"]
    np.testing.assert_allclose(out, np.full(3, 1.0001**5000), rtol=1e-3)


def test_a_broadcast_operand_gradient_keeps_the_forward_span():
    source = Source("m.lisp", "(tanh (+ x bias))\n")
    outer, inner = Span(source, 1, 1, 1, 18), Span(source, 1, 7, 1, 17)
    x, bias = b.input("x", (3, 4), "f32"), b.param("bias", (4,), "f32")
    loss = b.sum(b.tanh(b.add(x, bias, span=inner), span=outer), span=outer)
    (gbias,) = grad(loss, [bias])
    assert gbias.op.label == "sum" and gbias.span is inner
