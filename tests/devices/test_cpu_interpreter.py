"""The CPU interpreter frees dead values, reuses dying buffers safely, and rounds bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sexpgpu.devices.cpu import CpuProgram, run
from sexpgpu.errors import SexpgpuError
from sexpgpu.ir import builder as b
from sexpgpu.ir.autodiff import training_graph
from sexpgpu.ir.dtypes import round_bf16
from sexpgpu.ir.node import Graph

RNG = np.random.default_rng(11)


def _chain(length: int, size: int) -> Graph:
    x = b.input("x", (size,), "f32")
    y = x
    for i in range(length):
        y = b.tanh(b.add(y, b.constant(0.01 * i, "f32")))
    return Graph.of({"y": b.sum(y)})


def test_long_chain_holds_a_few_values_not_all():
    size, length = 1 << 16, 50
    program = CpuProgram(_chain(length, size))
    total = 2 * length * size * 4
    got = program({"x": RNG.normal(size=size).astype(np.float32)})["y"]
    value = RNG.normal(size=size)  # check the numbers too
    want = value
    for i in range(length):
        want = np.tanh(want + 0.01 * i)
    np.testing.assert_allclose(program({"x": value})["y"], want.sum(), rtol=1e-4)
    assert got.shape == ()
    # the feed plus one buffer that every op overwrites in place
    assert program.last_peak_bytes <= 3 * size * 4 < total / 20
    assert program.planned_peak_bytes <= 3 * size * 4


def test_planned_peak_matches_measured_on_a_training_graph():
    x = b.input("x", (32, 64), "f32")
    t = b.input("t", (32,), "int32")
    w1, w2 = b.param("w1", (64, 128), "f32"), b.param("w2", (128, 10), "f32")
    h = b.tanh(b.matmul(x, w1))
    loss = b.sum(b.cross_entropy(b.matmul(h, w2), t))
    program = CpuProgram(training_graph(Graph.of({"loss": loss})))
    feeds = {
        "x": RNG.normal(size=(32, 64)).astype(np.float32),
        "t": RNG.integers(0, 10, 32).astype(np.int32),
        "w1": RNG.normal(size=(64, 128)).astype(np.float32),
        "w2": RNG.normal(size=(128, 10)).astype(np.float32),
    }
    program(feeds)
    assert program.planned_peak_bytes > 0
    # measured counts the same buffers; numpy may copy a non-contiguous reshape
    ratio = program.last_peak_bytes / program.planned_peak_bytes
    assert 0.9 <= ratio <= 1.3, (program.last_peak_bytes, program.planned_peak_bytes)


def test_in_place_reuse_never_clobbers_a_live_value():
    x = b.input("x", (3, 4), "f32")
    e = b.exp(x)
    view = b.transpose(e)  # shares e's buffer and stays alive past the add
    y = b.add(e, b.constant(1.0, "f32"))  # e dies here but its buffer is still viewed
    z = b.neg(b.mul(x, x))  # x is a feed: never written
    graph = Graph.of({"y": y, "v": b.mul(view, b.constant(2.0, "f32")), "z": z})
    value = RNG.normal(size=(3, 4)).astype(np.float32)
    keep = value.copy()
    out = run(graph, {"x": value})
    np.testing.assert_allclose(out["y"], np.exp(keep) + 1, rtol=1e-6)
    np.testing.assert_allclose(out["v"], 2 * np.exp(keep).T, rtol=1e-6)
    np.testing.assert_allclose(out["z"], -(keep * keep), rtol=1e-6)
    np.testing.assert_array_equal(value, keep)


def test_outputs_do_not_alias_feeds_or_read_only_constants():
    x = b.input("x", (2, 2), "f32")
    out = run(
        Graph.of({"same": x, "zeros": b.broadcast_to(b.constant(0.0, "f32"), (2, 2))}),
        {"x": np.ones((2, 2), np.float32)},
    )
    out["same"][0, 0] = 5
    out["zeros"][0, 0] = 5  # writeable copies


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30])
def test_bf16_rounding_matches_torch(scale):
    values = (RNG.normal(size=4096) * scale).astype(np.float32)
    values[:4] = [np.inf, -np.inf, 0.0, -0.0]
    ties = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF], dtype=np.uint32).view(np.float32)
    values = np.concatenate([values, ties])
    want = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(round_bf16(values.copy()), want)
    nan = round_bf16(np.array([np.nan, np.uint32(0x7F800001).view(np.float32)], np.float32))
    assert np.isnan(nan).all()


def test_bf16_graph_rounds_every_stored_value_like_torch():
    x = b.input("x", (8, 16), "bf16")
    w = b.param("w", (16, 4), "bf16")
    y = b.exp(b.mul(b.matmul(x, w), b.constant(0.1, "bf16")))
    xv, wv = RNG.normal(size=(8, 16)), RNG.normal(size=(16, 4))
    got = run(Graph.of({"y": y}), {"x": xv, "w": wv})["y"]
    tx, tw = (torch.tensor(v, dtype=torch.bfloat16) for v in (xv, wv))
    want = torch.exp((tx @ tw) * torch.tensor(0.1, dtype=torch.bfloat16)).float().numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32) & 0xFFFF, 0)  # bf16 values
    np.testing.assert_allclose(got, want, rtol=2e-2)


def test_missing_or_misshapen_feed_is_reported():
    graph = Graph.of({"y": b.neg(b.input("x", (2,), "f32"))})
    with pytest.raises(ValueError, match="no feed for input 'x'"):
        run(graph, {})
    with pytest.raises(ValueError, match=r"shape \[3\], the graph wants \[2\]"):
        run(graph, {"x": np.zeros(3)})


def test_where_writes_into_a_dying_branch_correctly():
    x = b.input("x", (4, 5), "f32")
    cond = b.lt(b.iota((4, 5), 1), b.iota((4, 5), 0))
    left = b.where(cond, b.exp(x), b.constant(-1.0, "f32"))  # exp(x) dies here
    right = b.where(cond, b.constant(2.0, "f32"), b.tanh(x))  # tanh(x) dies here
    value = RNG.normal(size=(4, 5)).astype(np.float32)
    out = run(Graph.of({"l": left, "r": right}), {"x": value})
    mask = np.tril(np.ones((4, 5), bool), -1)
    np.testing.assert_allclose(out["l"], np.where(mask, np.exp(value), -1.0), rtol=1e-6)
    np.testing.assert_allclose(out["r"], np.where(mask, 2.0, np.tanh(value)), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_ops_split_over_threads_give_identical_bits(monkeypatch, dtype):
    from sexpgpu.devices import cpu_split

    monkeypatch.setattr(cpu_split, "MIN_ELEMENTS", 8)
    x = b.input("x", (6, 4, 5), dtype)
    w = b.param("w", (5,), dtype)
    col = b.input("col", (6, 1, 1), dtype)
    h = b.gelu(b.mul(b.add(x, w), col))
    h = b.where(b.lt(h, b.constant(0.1, dtype)), b.exp(h), b.sigmoid(h))
    h = b.softmax(b.layernorm(h, 1e-5), axis=0)
    loss = b.sum(b.mul(b.rsqrt(b.add(b.mul(h, h), b.constant(1.0, dtype))), h))
    graph = training_graph(Graph.of({"loss": loss}))
    feeds = {
        "x": RNG.normal(size=(6, 4, 5)),
        "w": RNG.normal(size=5),
        "col": RNG.normal(size=(6, 1, 1)),
    }
    split, whole = CpuProgram(graph, threads=3), CpuProgram(graph, threads=1)
    assert any(s.split is not None for s in split.steps)
    assert all(s.split != 0 for s in split.steps if s.node.op.label == "softmax")
    got, want = split(feeds), whole(feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_no_buffer_is_reused_while_another_operand_views_it():
    x = b.input("x", (4, 4), "f32")
    e = b.exp(x)
    y = b.where(b.lt(x, b.constant(0.0, "f32")), e, b.transpose(e))  # e and e^T both die here
    z = b.add(e, b.transpose(e))
    value = RNG.normal(size=(4, 4)).astype(np.float32)
    out = run(Graph.of({"y": y, "z": z}), {"x": value})
    ev = np.exp(value)
    np.testing.assert_allclose(out["y"], np.where(value < 0, ev, ev.T), rtol=1e-6)
    np.testing.assert_allclose(out["z"], ev + ev.T, rtol=1e-6)


def test_matmul_and_attention_split_over_threads_match(monkeypatch):
    from sexpgpu.devices import cpu_split

    monkeypatch.setattr(cpu_split, "MIN_ELEMENTS", 8)
    x = b.input("x", (3, 4, 6), "f32")
    w = b.param("w", (6, 8), "f32")
    h = b.reshape(b.matmul(x, w), (3, 4, 2, 4))
    q = b.transpose(h, (0, 2, 1, 3))  # (B, H, T, D) from a strided view
    y = b.attention(q, q, b.tanh(q), causal=True)
    z = b.matmul(b.reshape(y, (6, 4, 4)), b.transpose(b.reshape(y, (6, 4, 4))))
    ce = b.cross_entropy(z, b.input("t", (6, 4), "int32"))
    loss = b.add(b.sum(b.mul(z, z)), b.sum(ce))
    graph = training_graph(Graph.of({"loss": loss}))
    feeds = {"x": RNG.normal(size=(3, 4, 6)), "w": RNG.normal(size=(6, 8))}
    feeds["t"] = RNG.integers(0, 4, (6, 4)).astype(np.int32)
    split, whole = CpuProgram(graph, threads=2), CpuProgram(graph, threads=1)
    ops = {s.node.op.label for s in split.steps if s.split is not None}
    assert {"matmul", "attention", "attention-grad", "cross-entropy", "cross-entropy-grad"} <= ops
    got, want = split(feeds), whole(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    ("ids", "targets", "message"),
    [
        ([0, 5], [0, 1], "take: the data holds id 5, out of range for 5 rows"),
        ([0, -1], [0, 1], "take: the data holds id -1, out of range for 5 rows"),
        ([0, 4], [3, 1], "cross-entropy: the data holds id 3, out of range for 3 classes"),
    ],
)
def test_ids_out_of_range_are_data_errors_not_index_errors(ids, targets, message):
    table, w = b.param("table", (5, 4), "f32"), b.param("w", (4, 3), "f32")
    ids_node, targets_node = b.input("ids", (2,), "int32"), b.input("targets", (2,), "int32")
    loss = b.sum(b.cross_entropy(b.matmul(b.take(table, ids_node), w), targets_node))
    feeds = {"table": np.ones((5, 4)), "w": np.ones((4, 3)), "ids": ids, "targets": targets}
    with pytest.raises(SexpgpuError) as info:
        run(Graph.of({"loss": loss}), feeds)
    assert info.value.code == "E-DATA-006" and info.value.message == message
