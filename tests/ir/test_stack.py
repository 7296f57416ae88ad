"""`stack_microbatches`: one call on k stacked microbatches equals the sum of k calls.

Each graph runs on the interpreter once per microbatch (outputs summed in
f64), and stacked once on the k microbatches stacked on a new leading
axis; the two must agree (f32 to 1e-5 of the outputs' size, bf16 to 2e-2).
The graphs: the examples' training graphs, every op check of
`tests/ir/test_ops.py` with each choice of which operands are data
(batched) and which parameters (shared), and small graphs for the rules'
corner cases (a k equal to another axis size, ids into per-microbatch
tables). The stacked examples also run on the torch lowering on PyTorch's
CPU device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from ir_opcheck import Arg
from test_ops import CASES

from sexpgpu.devices.cpu import run
from sexpgpu.errors import SexpgpuError
from sexpgpu.ir import builder as b
from sexpgpu.ir.autodiff import grad
from sexpgpu.ir.compile import compile_run
from sexpgpu.ir.dtypes import DType
from sexpgpu.ir.node import Graph, Node
from sexpgpu.ir.ops import Op
from sexpgpu.ir.stack import stack_microbatches
from sexpgpu.lang import load_experiment_text

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KS = (1, 2, 3)

Feeds = dict[str, np.ndarray]


# ---------------------------------------------------------------- harness


def _summed(graph: Graph, shared: Feeds, microbatches: Sequence[Feeds]) -> dict[str, np.ndarray]:
    """The original graph run on each microbatch alone, outputs summed in f64."""
    total: dict[str, np.ndarray] = {}
    for feeds in microbatches:
        for name, value in run(graph, {**shared, **feeds}).items():
            total[name] = total.get(name, 0.0) + value.astype(np.float64)
    return total


def _stacked(graph: Graph, shared: Feeds, microbatches: Sequence[Feeds]) -> Feeds:
    """The feeds of the stacked graph: each data field's microbatches on a new axis 0."""
    fields = {name: np.stack([m[name] for m in microbatches]) for name in graph.inputs}
    return {**shared, **fields}


def _assert_close(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], dtype) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        host = np.asarray(got[name], np.float64)
        assert host.shape == value.shape, name
        if dtype == "bf16":  # the whole tensor to 2e-2 of its size: single elements may flip
            bound = 2e-2 * float(np.linalg.norm(value)) + 1e-4 * np.sqrt(value.size)
            assert float(np.linalg.norm(host - value)) <= bound, name
        else:  # near zero: relative to the largest element, with a floor for sums
            # of O(1) terms that cancel (added in another order when stacked)
            atol = 1e-5 * float(np.abs(value).max(initial=0.0)) + 1e-6
            np.testing.assert_allclose(host, value, rtol=1e-5, atol=atol, err_msg=name)


def _check(graph: Graph, k: int, shared: Feeds, microbatches: Sequence[Feeds], dtype="f32"):
    """Stack `graph` by `k`, check its leaves and outputs, and return it."""
    stacked = stack_microbatches(graph, k)
    for name, node in graph.inputs.items():
        new = stacked.inputs[name]
        assert (new.shape, new.dtype) == ((k, *node.shape), node.dtype), name
    for name, node in graph.params.items():
        assert stacked.params[name] is node, name  # shared, the very same node
    for name, node in graph.outputs.items():
        assert (stacked.outputs[name].shape, stacked.outputs[name].dtype) == (
            node.shape,
            node.dtype,
        )
    want = _summed(graph, shared, microbatches)
    _assert_close(run(stacked, _stacked(graph, shared, microbatches)), want, dtype)
    return stacked


def _id_bound(graph: Graph) -> int:
    """A bound every int32 data id must stay below: the smallest table or class count."""
    sizes = [n.inputs[0].shape[0] for n in graph.nodes() if n.op is Op.TAKE]
    sizes += [n.inputs[0].shape[-1] for n in graph.nodes() if n.op is Op.CROSS_ENTROPY]
    return min(sizes, default=10)


def _data(graph: Graph, k: int, rng: np.random.Generator) -> list[Feeds]:
    """`k` microbatches of random data for `graph`'s inputs."""
    bound = _id_bound(graph)

    def sample(node: Node) -> np.ndarray:
        if node.dtype is DType.INT32:
            return rng.integers(0, bound, node.shape).astype(np.int32)
        if node.dtype is DType.BOOL:
            return rng.random(node.shape) < 0.5
        return rng.normal(size=node.shape).astype(np.float32)

    return [{name: sample(node) for name, node in graph.inputs.items()} for _ in range(k)]


# ---------------------------------------------------------------- the examples


MLP_BF16 = ((":seed 0", ":seed 0 :dtype bf16"),)
GPT_SMALL = (("(batch 8) (microbatches 8)", "(batch 2) (microbatches 8)"),)
GPT_BF16 = (('(lr 1e-3) (dtype "f32")', '(lr 1e-3) (dtype "bf16")'),)
EXAMPLE_CASES = [
    pytest.param("mlp.lisp", None, (), "f32", id="mlp"),
    pytest.param("mlp.lisp", None, MLP_BF16, "bf16", id="mlp-bf16"),
    pytest.param("gpt.lisp", "smoke", GPT_SMALL, "f32", id="gpt-smoke"),
    pytest.param("gpt.lisp", "smoke", GPT_SMALL + GPT_BF16, "bf16", id="gpt-smoke-bf16"),
]


def _compiled(example: str, variant: str | None, edits):
    text = (EXAMPLES / example).read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    experiment = load_experiment_text(text, example, variant=variant, base_dir=EXAMPLES)
    return compile_run(experiment, experiment.run())


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize(("example", "variant", "edits", "dtype"), EXAMPLE_CASES)
def test_example_training_graphs_stack(example, variant, edits, dtype, k) -> None:
    compiled = _compiled(example, variant, edits)
    graph = compiled.train_graph
    data = _data(graph, k, np.random.default_rng(k))
    stacked = _check(graph, k, compiled.init_params(0), data, dtype)
    # Every new node carries the span of the node it batches (or of the output it sums).
    spans = {n.span for n in graph.nodes()}
    assert {n.span for n in stacked.nodes()} <= spans


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(("example", "variant", "edits", "dtype"), EXAMPLE_CASES)
def test_stacked_examples_run_on_the_torch_lowering(example, variant, edits, dtype, k) -> None:
    torch = pytest.importorskip("torch")
    from sexpgpu.devices.cuda.executor import TorchGraph

    compiled = _compiled(example, variant, edits)
    graph = compiled.train_graph
    stacked = stack_microbatches(graph, k)
    feeds = _stacked(graph, compiled.init_params(0), _data(graph, k, np.random.default_rng(7)))
    want = {n: v.astype(np.float64) for n, v in run(stacked, feeds).items()}
    program = TorchGraph(stacked, torch.device("cpu"))
    got = {n: v.detach().float().numpy() for n, v in program(feeds).items()}
    _assert_close(got, want, dtype)
    # Each attention still pairs with its gradient (the forward's stash is kept).
    assert program.report()["stashed"] == TorchGraph(graph, torch.device("cpu")).report()["stashed"]


# ---------------------------------------------------------------- every op, batched or shared


def _op_graph(build, args: Sequence[Arg], data: Sequence[bool], with_grad: bool):
    """The op check's graph (the op, and the gradient of ``sum(op * w)`` if `with_grad`),
    operand ``x<i>`` an INPUT node where ``data[i]`` holds, else a PARAM node
    (``data[-1]``: ``w``'s). Returns the graph and each leaf's name and `Arg`."""

    def leaf(name: str, arg: Arg, is_data: bool) -> Node:
        dtype = "f32" if arg.is_float else ("bool" if arg.kind == "bool" else "int32")
        return (b.input if is_data else b.param)(name, arg.shape, dtype)

    leaves = {f"x{i}": a for i, a in enumerate(args)}
    xs = [leaf(name, a, d) for (name, a), d in zip(leaves.items(), data, strict=False)]
    y = build(*xs)
    outputs = {"y": b.cast(y, "f32") if y.dtype is DType.BOOL else y}  # a bool has no sum
    if with_grad:
        leaves["w"] = Arg(y.shape)
        w = leaf("w", leaves["w"], data[-1])
        loss = b.sum(b.mul(y, w))
        floats = [x for x, a in zip(xs, args, strict=True) if a.is_float]
        outputs |= {f"g{i}": g for i, g in enumerate(grad(loss, floats))} | {"loss": loss}
        xs.append(w)
    return Graph.of(outputs, xs), leaves


def _masks(n: int) -> list[tuple[bool, ...]]:
    """Which of `n` operands are data: all, none, each alone, all but each."""
    masks = {(True,) * n, (False,) * n}
    for i in range(n):
        masks.add(tuple(j == i for j in range(n)))
        masks.add(tuple(j != i for j in range(n)))
    return sorted(masks)


@pytest.mark.parametrize(("build", "torch_fn", "args", "differentiable"), CASES)
def test_every_op_stacks_with_data_and_shared_operands(build, torch_fn, args, differentiable):
    rng = np.random.default_rng(0)
    with_grad = differentiable and any(a.is_float for a in args)
    for data in _masks(len(args) + with_grad):
        graph, leaves = _op_graph(build, args, data, with_grad)

        for k in KS:
            microbatches = [_draw(leaves, graph.inputs, rng) for _ in range(k)]
            _check(graph, k, _draw(leaves, graph.params, rng), microbatches)


def _draw(leaves: Mapping[str, Arg], names, rng: np.random.Generator) -> Feeds:
    return {name: leaves[name].sample(rng) for name in names}


# ---------------------------------------------------------------- corner cases


def _random(shape, rng) -> np.ndarray:
    return rng.normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_low_rank_data_never_broadcasts_against_an_axis_of_size_k(k) -> None:
    # A scalar and a vector from the data against [3 4] parameters: unaligned,
    # [k] or [k 4] would broadcast with the 4 (or the 3) when k equals it.
    s = b.input("s", (), "f32")
    v = b.input("v", (4,), "f32")
    m = b.input("m", (3, 4), "f32")
    p = b.param("p", (3, 4), "f32")
    q = b.param("q", (2, 4, 3), "f32")
    y = b.add(b.mul(s, p), b.where(b.lt(v, p), v, p))
    z = b.matmul(m, q)  # [2 3 3]: m's batch axis must not meet q's 2
    u = b.broadcast_to(v, (3, 4))
    loss = b.add(b.sum(b.mul(y, y)), b.add(b.sum(z), b.sum(b.mul(u, p))))
    graph = Graph.of({"loss": loss, "y": y, "z": z, "u": u})
    rng = np.random.default_rng(k)
    shared = {"p": _random((3, 4), rng), "q": _random((2, 4, 3), rng)}
    data = [{"s": _random((), rng), "v": _random((4,), rng), "m": _random((3, 4), rng)}]
    _check(
        graph,
        k,
        shared,
        data + [{n: _random(a.shape, rng) for n, a in data[0].items()} for _ in range(k - 1)],
    )


@pytest.mark.parametrize("k", KS)
def test_scatter_add_gives_each_microbatch_its_own_rows(k) -> None:
    ids = b.input("ids", (2, 5), "int32")
    shared_ids = b.param("shared_ids", (2, 5), "int32")
    upd = b.input("upd", (2, 5, 3), "f32")
    shared_upd = b.param("shared_upd", (2, 5, 3), "f32")
    outputs = {
        "both": b.scatter_add(ids, upd, rows=4),
        "ids": b.scatter_add(ids, shared_upd, rows=4),
        "updates": b.scatter_add(shared_ids, upd, rows=4),
        # Square of each microbatch's table: wrong unless the tables are apart.
        "squared": b.sum(b.mul(b.scatter_add(ids, upd, rows=4), b.scatter_add(ids, upd, rows=4))),
    }
    graph = Graph.of(outputs)
    rng = np.random.default_rng(k)
    shared = {
        "shared_ids": rng.integers(0, 4, (2, 5)).astype(np.int32),
        "shared_upd": _random((2, 5, 3), rng),
    }
    data = [
        {"ids": rng.integers(0, 4, (2, 5)).astype(np.int32), "upd": _random((2, 5, 3), rng)}
        for _ in range(k)
    ]
    stacked = _check(graph, k, shared, data)
    # Summed outputs scatter all microbatches' rows into one table; "squared"
    # needs each microbatch's own table, [k*4 3].
    for name in ("both", "ids", "updates"):
        assert stacked.outputs[name].op is Op.SCATTER_ADD, name
    tables = {n.shape for n in stacked.nodes() if n.op is Op.SCATTER_ADD}
    assert tables == {(4, 3), (4 * k, 3)}


@pytest.mark.parametrize("k", KS)
def test_take_from_a_batched_table_keeps_its_id_check(k) -> None:
    table = b.input("table", (4, 3), "f32")
    ids = b.input("ids", (5,), "int32")
    graph = Graph.of({"y": b.take(b.exp(table), ids)})
    rng = np.random.default_rng(k)
    data = [
        {"table": _random((4, 3), rng), "ids": rng.integers(0, 4, 5).astype(np.int32)}
        for _ in range(k)
    ]
    stacked = _check(graph, k, {}, data)
    # Id 4 is past microbatch 0's table, though within the k tables together.
    data[0]["ids"][2] = 4
    with pytest.raises(SexpgpuError, match="the data holds id 4"):
        run(stacked, _stacked(graph, {}, data))


def test_an_output_no_data_reaches_is_counted_k_times() -> None:
    x = b.input("x", (3,), "f32")
    p = b.param("p", (3,), "f32")
    graph = Graph.of({"loss": b.sum(b.mul(x, p)), "decay": b.mul(p, p)}, [x])
    stacked = _check(
        graph,
        3,
        {"p": np.arange(3, dtype=np.float32)},
        [{"x": np.full(3, i, np.float32)} for i in range(3)],
    )
    assert stacked.outputs["decay"].op is Op.MUL


def test_an_unused_data_field_is_stacked_too() -> None:
    x = b.input("x", (3,), "f32")
    unused = b.input("unused", (2,), "int32")
    graph = Graph.of({"loss": b.sum(x)}, [x, unused])
    assert stack_microbatches(graph, 2).inputs["unused"].shape == (2, 2)


@pytest.mark.parametrize("kv", [4, 2])
def test_attention_grad_keeps_dq_dk_dv_apart(kv: int) -> None:
    # [.. H+2K S D] from the op, batched in front; each part sliced out of the heads.
    shapes = {"q": (4, 5, 3), "k": (kv, 5, 3), "v": (kv, 5, 3), "g": (4, 5, 3)}
    q, k_, v, g = (b.input(n, shapes[n], "f32") for n in "qkvg")
    grads = b.attention_grad(q, k_, v, g, causal=True, scale=0.5)
    bounds = {"dq": (0, 4), "dk": (4, 4 + kv), "dv": (4 + kv, 4 + 2 * kv)}
    parts = {n: b.slice(grads, 0, lo, hi) for n, (lo, hi) in bounds.items()}
    graph = Graph.of({"grads": grads, **parts})
    rng = np.random.default_rng(0)
    data = [{n: _random(shapes[n], rng) for n in "qkvg"} for _ in range(3)]
    _check(graph, 3, {}, data)


@pytest.mark.parametrize("k", [0, -1, 1.0, True])
def test_k_must_be_a_whole_number_of_at_least_one(k) -> None:
    graph = Graph.of({"y": b.sum(b.input("x", (2,), "f32"))})
    with pytest.raises(ValueError, match="k must be"):
        stack_microbatches(graph, k)


def test_a_bool_output_is_refused() -> None:
    x = b.input("x", (2,), "f32")
    graph = Graph.of({"y": b.lt(x, b.constant(0.0, "f32"))})
    with pytest.raises(ValueError, match="bool"):
        stack_microbatches(graph, 2)


@pytest.mark.parametrize("edits", [GPT_SMALL, GPT_SMALL + GPT_BF16], ids=["f32", "bf16"])
def test_summed_gradients_are_one_product_and_one_scatter_over_all_microbatches(edits) -> None:
    graph = _compiled("gpt.lisp", "smoke", edits).train_graph
    stacked = stack_microbatches(graph, 3)

    def made_by(node: Node) -> Node:  # what an output is, under a cast (bf16's f32 gradients)
        return node.inputs[0] if node.op is Op.CAST else node

    weight = made_by(stacked.outputs["grad/gpt/block.0/linear/weight"])
    assert weight.op is Op.MATMUL and [x.shape for x in weight.inputs] == [
        (128, 3 * 128),
        (384, 512),
    ]
    tables = [n.shape for n in stacked.nodes() if n.op is Op.SCATTER_ADD]
    assert tables == [graph.params["gpt/wte"].shape, graph.params["gpt/embed/weight"].shape]
    # Each output is made as the unstacked graph makes it: no sum over the microbatches after.
    for name, node in graph.outputs.items():
        assert made_by(stacked.outputs[name]).op is made_by(node).op, name
