"""Recomputation (`sexpgpu.ir.recompute`): what it chooses, what it costs, what it computes."""

from pathlib import Path

import numpy as np
import pytest

from sexpgpu.devices.cpu import CpuProgram
from sexpgpu.ir.compile import compile_run, matmul_flops
from sexpgpu.ir.ops import ELEMENTWISE, PRODUCT, VIEW, Op
from sexpgpu.ir.recompute import cheap, cuts, fit, moves, recompute_graph
from sexpgpu.lang import load_experiment, load_experiment_text

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt.lisp"
# The smoke GPT at a longer sequence: its activations, not its parameters, fill the plan.
LONG = '(defvariant long (layers 2) (width 128) (heads 4) (seq 256) (microbatches 1) (dtype "f32"))'
LLAMA = ROOT / "examples" / "llama.lisp"
# Four Llama blocks whose SwiGLU values outweigh the residual stream, as at scale.
DEEP = (
    "(defvariant deep (layers 4) (width 64) (heads 4) (kv-heads 1) (ffn 256) (seq 128)"
    ' (microbatches 1) (dtype "f32"))'
)


def _train_graph(variant="smoke", text=None, path=GPT):
    if text is None:
        experiment = load_experiment(path, variant=variant)
    else:
        experiment = load_experiment_text(text, str(GPT), variant=variant, base_dir=GPT.parent)
    return compile_run(experiment, experiment.run(None))


def _peak(graph):
    return CpuProgram(graph, threads=1).planned_peak_bytes


def _feeds(graph, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, node in graph.inputs.items():
        feeds[name] = rng.integers(0, 256, node.shape).astype(np.int32)
    for name, node in graph.params.items():
        feeds[name] = (0.05 * rng.standard_normal(node.shape)).astype(np.float32)
    return feeds


def test_a_graph_too_big_for_a_budget_fits_after_the_pass():
    graph = _train_graph().train_graph
    budget = int(0.8 * _peak(graph))
    assert _peak(graph) > budget
    done = fit(graph, lambda g: _peak(g) <= budget, matmul_flops)
    assert done is not None and done.fits
    assert _peak(done.graph) <= budget
    assert done.values > 0
    assert done.flops >= done.base_flops == matmul_flops(graph)


def test_a_graph_that_fits_is_left_alone():
    graph = _train_graph().train_graph
    assert fit(graph, lambda g: True, matmul_flops) is None


def test_where_nothing_fits_the_cheapest_full_recomputation_is_returned():
    graph = _train_graph().train_graph
    done = fit(graph, lambda g: False, matmul_flops)
    assert done is not None and not done.fits
    walk = moves(graph)
    assert done.values >= len(walk)  # every move's values, and the views they read
    assert _peak(done.graph) < _peak(graph)


def test_flops_added_stay_under_a_bound_at_sixty_percent_of_the_plan():
    compiled = _train_graph("long", GPT.read_text() + LONG)
    graph = compiled.train_graph
    fixed = 3 * 4 * compiled.param_count  # parameters and adamw's two moments, as the cpu plans
    budget = int(0.6 * (fixed + _peak(graph)))
    done = fit(graph, lambda g: fixed + _peak(g) <= budget, matmul_flops)
    assert done is not None and done.fits
    assert done.flops <= 1.25 * done.base_flops, done.flops / done.base_flops


def test_cheap_values_are_recomputed_before_products():
    walk = moves(_train_graph().train_graph)
    first_product = next(i for i, m in enumerate(walk) if any(r.op is Op.MATMUL for r in m.roots))
    assert first_product > 0
    assert all(m.work <= walk[first_product].work for m in walk[:first_product])


@pytest.mark.parametrize("example", ["gpt", "llama"])
def test_the_rewritten_graph_computes_the_same_bits(example):
    graph = _train_graph(path=ROOT / "examples" / f"{example}.lisp").train_graph
    roots = [r for m in moves(graph) for r in m.roots]
    rewritten = recompute_graph(graph, roots)
    assert len(rewritten.nodes()) > len(graph.nodes())
    assert next(iter(rewritten.outputs)) == "loss"
    assert set(rewritten.outputs) == set(graph.outputs)
    feeds = _feeds(graph)
    before, after = CpuProgram(graph)(feeds), CpuProgram(rewritten)(feeds)
    for name in graph.outputs:
        assert np.array_equal(before[name], after[name]), name


@pytest.mark.parametrize("variant", ["smoke"])
def test_the_interpreter_peaks_lower_on_the_rewritten_graph(variant):
    graph = _train_graph(variant).train_graph
    rewritten = recompute_graph(graph, [r for m in moves(graph) for r in m.roots])
    feeds = _feeds(graph, seed=1)
    plain, recomputing = CpuProgram(graph), CpuProgram(rewritten)
    plain(feeds)
    recomputing(feeds)
    assert recomputing.last_peak_bytes < 0.8 * plain.last_peak_bytes


@pytest.mark.parametrize("into_products", [False, True])
def test_cheap_values_are_elementwise_and_free_and_give_the_same_bits(into_products):
    graph = _train_graph("deep", text=LLAMA.read_text() + DEEP, path=LLAMA).train_graph
    roots = cheap(graph, into_products=into_products)
    assert {r.op for r in roots} >= {Op.SIGMOID, Op.MUL}  # SwiGLU's
    assert all(r.op in ELEMENTWISE for r in roots)
    rewritten = recompute_graph(graph, roots)
    assert matmul_flops(rewritten) == matmul_flops(graph)  # no product made again
    assert _peak(rewritten) < 0.9 * _peak(graph)
    feeds = _feeds(graph, seed=2)
    before, after = CpuProgram(graph)(feeds), CpuProgram(rewritten)(feeds)
    for name in graph.outputs:
        assert np.array_equal(before[name], after[name]), name
    # Without `into_products`, a product reads no value made again (a buffer of its own there).
    assert _products_read_made_again(graph, rewritten, roots) == into_products


def _products_read_made_again(graph, rewritten, roots):
    """Whether a product of `rewritten` reads (through views) a copy of one of `roots`."""
    kinds = {(r.op, r.shape, r.span) for r in roots}
    old = {id(n) for n in graph.nodes()}
    new = [n for n in rewritten.nodes() if id(n) not in old]
    made = {id(n) for n in new if (n.op, n.shape, n.span) in kinds}

    def base(x):
        while x.op in VIEW:
            x = x.inputs[0]
        return x

    return any(id(base(x)) in made for n in rewritten.nodes() if n.op in PRODUCT for x in n.inputs)


def test_the_gpts_normalized_values_are_made_again_and_give_the_same_bits():
    # Each layernorm's output is read by its gain's gradient alone (a product reads the
    # output with its gain and bias): made again from the norm's input, which is kept
    # for the norm's own gradient. Gelu's output, read by a product, stays kept.
    graph = _train_graph("long", text=GPT.read_text() + LONG).train_graph
    roots = cheap(graph, into_products=False)
    assert roots and {r.op for r in roots} == {Op.LAYERNORM}
    assert len(roots) == sum(n.op is Op.LAYERNORM for n in graph.nodes())
    rewritten = recompute_graph(graph, roots)
    assert matmul_flops(rewritten) == matmul_flops(graph)
    assert _peak(rewritten) < _peak(graph)
    feeds = _feeds(graph, seed=3)
    before, after = CpuProgram(graph)(feeds), CpuProgram(rewritten)(feeds)
    for name in graph.outputs:
        assert np.array_equal(before[name], after[name]), name


def test_the_report_line():
    from sexpgpu.ir.recompute import Recomputation

    graph = _train_graph().train_graph
    small = Recomputation(graph, 12, 1004, 1000, True)
    assert small.line("plan 3.0 GiB of 4.0 GiB") == (
        "recompute: 12 values, +0.4% FLOPs, plan 3.0 GiB of 4.0 GiB"
    )
    assert Recomputation(graph, 412, 1180, 1000, True).line("plan 31.2 of 40.0 GiB") == (
        "recompute: 412 values, +18% FLOPs, plan 31.2 of 40.0 GiB"
    )


def test_the_cuts_of_a_residual_network_are_the_sums_between_its_blocks():
    compiled = _train_graph("deep", LLAMA.read_text() + DEEP, path=LLAMA)
    found = cuts(compiled.train_graph)
    sums = [n for n in found if n.op is Op.ADD and n.shape == (8, 128, 64)]
    assert len(sums) == 2 * 4  # after attention and after the feed-forward layer, per block
    order = {id(n): i for i, n in enumerate(compiled.train_graph.nodes())}
    assert [order[id(n)] for n in found] == sorted(order[id(n)] for n in found)


def test_checkpointing_at_the_cuts_fits_below_the_walks_last_move():
    graph = _train_graph("deep", LLAMA.read_text() + DEEP, path=LLAMA).train_graph
    walk_last = _peak(recompute_graph(graph, [r for m in moves(graph) for r in m.roots]))
    done = fit(graph, lambda g: _peak(g) < walk_last, matmul_flops)
    assert done is not None and done.fits
    assert _peak(done.graph) < walk_last < _peak(graph)
    assert done.base_flops < done.flops < 1.5 * done.base_flops  # about one more forward
    feeds = _feeds(graph)
    before, after = CpuProgram(graph)(feeds), CpuProgram(done.graph)(feeds)
    for name in graph.outputs:
        assert np.array_equal(before[name], after[name]), name


def test_where_every_cut_kept_does_not_fit_every_second_one_may():
    from sexpgpu.ir.recompute import _checkpointed

    text = LLAMA.read_text() + DEEP.replace("(layers 4)", "(layers 8)")
    graph = _train_graph("deep", text, path=LLAMA).train_graph

    def peak_keeping(every):
        return _peak(recompute_graph(graph, _checkpointed(graph, "loss", every)))

    every_cut, every_second = peak_keeping(1), peak_keeping(2)
    assert every_second < every_cut  # longer segments, half the cuts kept
    done = fit(graph, lambda g: _peak(g) <= every_second, matmul_flops)
    # Every second cut, with what its room allows kept back (none beyond the budget).
    assert done is not None and done.fits and _peak(done.graph) <= every_second


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("example", ["gpt", "llama"])
def test_a_graph_checkpointed_at_its_cuts_computes_the_same_bits(example, every):
    from sexpgpu.ir.recompute import _checkpointed

    graph = _train_graph(path=ROOT / "examples" / f"{example}.lisp").train_graph
    rewritten = recompute_graph(graph, _checkpointed(graph, "loss", every))
    feeds = _feeds(graph)
    before, after = CpuProgram(graph)(feeds), CpuProgram(rewritten)(feeds)
    for name in graph.outputs:
        assert np.array_equal(before[name], after[name]), name


def test_checkpointing_keeps_back_what_its_room_allows():
    # Past the walk's reach, checkpointing at the cuts leaves room below the budget:
    # the recomputed values that cost the most work per byte (products) are kept back,
    # the latest in the forward first, as many as still fit.
    from sexpgpu.ir.recompute import _checkpointed

    text = LLAMA.read_text() + DEEP.replace("(layers 4)", "(layers 8)")
    graph = _train_graph("deep", text, path=LLAMA).train_graph
    walk_last = _peak(recompute_graph(graph, [r for m in moves(graph) for r in m.roots]))
    checkpointed = recompute_graph(graph, _checkpointed(graph, "loss"))
    budget = (_peak(checkpointed) + walk_last) // 2
    assert _peak(checkpointed) < budget < walk_last
    done = fit(graph, lambda g: _peak(g) <= budget, matmul_flops)
    assert done is not None and done.fits and _peak(done.graph) <= budget
    assert done.base_flops < done.flops < matmul_flops(checkpointed)
    feeds = _feeds(graph)
    before, after = CpuProgram(graph)(feeds), CpuProgram(done.graph)(feeds)
    for name in graph.outputs:
        assert np.array_equal(before[name], after[name]), name
