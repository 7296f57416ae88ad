"""Which rank owns which parameter's optimizer state, and when the plan shards it."""

import sys
from pathlib import Path

import numpy as np
import pytest

from sexpgpu.devices.cpu_device import CpuDevice
from sexpgpu.devices.shard import Shards, choose, master_elements, shard_line, shard_params
from sexpgpu.ir.compile import compile_run
from sexpgpu.lang import load_experiment_text
from sexpgpu.train import run_experiment
from sexpgpu.train.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from mlp_experiment import mlp_text


def _best_contiguous(counts, ranks):
    """The least largest run over every cut of `counts` into at most `ranks` runs (brute force)."""
    import itertools

    best = sum(counts)
    for cuts in itertools.combinations(range(1, len(counts)), min(ranks, len(counts)) - 1):
        edges = [0, *cuts, len(counts)]
        best = min(best, max(sum(counts[a:b]) for a, b in itertools.pairwise(edges)))
    return best


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_whole_parameters_in_order_one_contiguous_run_per_rank_the_least_largest(ranks):
    rng = np.random.default_rng(ranks)
    for _ in range(20):
        counts = [int(n) for n in rng.integers(1, 100, size=int(rng.integers(1, 9)))]
        sizes = {f"p{i}": n for i, n in enumerate(counts)}
        shards = shard_params(sizes, ranks)
        owners = list(shards.owner.values())
        assert list(shards.owner) == list(sizes)  # every parameter, in order
        assert owners == sorted(owners) and owners[-1] < ranks  # contiguous, in rank order
        assert sum(len(shards.of(r)) for r in range(ranks)) == len(sizes)
        assert shards.largest(sizes) == _best_contiguous(counts, ranks)


def test_a_rank_past_the_parameters_owns_nothing():
    shards = shard_params({"a": 10, "b": 1, "c": 1, "d": 1}, 3)
    assert shards.owner == {"a": 0, "b": 1, "c": 1, "d": 1}  # the least largest: 10
    assert shards.of(2) == []
    assert shard_params({"a": 5}, 4) == Shards(4, {"a": 0})
    assert shard_params({"a": 5}, 4).of(3) == []
    assert shard_params({}, 2).owner == {}


def test_a_rank_keeps_the_f32_of_its_own_copied_parameters_and_a_stand_in_for_the_rest():
    from types import SimpleNamespace

    sizes = {"a": 4, "b": 1, "c": 1, "d": 2, "e": 3, "f": 1}
    compiled = SimpleNamespace(params={k: SimpleNamespace(size=n) for k, n in sizes.items()})
    assert shard_params(sizes, 2).of(0) == ["a", "b", "c"]  # and d e f: 6 elements each
    assert master_elements(compiled, 1, list(sizes)) == 12  # unsharded: every f32
    # rank 0 keeps a b c and a stand-in the size of e (3); rank 1 d e f and one of a (4)
    assert master_elements(compiled, 2, list(sizes)) == max(6 + 3, 6 + 4)
    # b read as f32 too: every rank keeps it
    assert master_elements(compiled, 2, ["a", "c", "d", "e", "f"]) == max(6 + 3, 7 + 4)
    assert master_elements(compiled, 2, []) == 12  # an f32 step keeps every f32


class _Plans:
    """A device whose plans fit or recompute as told, recording the shards asked for."""

    def __init__(self, fits, recomputes=False):
        self.fits, self.recomputes, self.asked = fits, recomputes, []

    def plan(self, compiled, *, shards, **kw):
        self.asked.append(shards)
        memory = type("M", (), {"fits": self.fits or shards > 1})()
        return type("P", (), {"memory": memory, "recompute": "r" if self.recomputes else None})()


@pytest.mark.parametrize(
    "setting, fits, recomputes, world, asked, shards",
    [
        (None, True, False, 4, [1], 1),  # it fits whole: nothing to gain
        (None, False, False, 4, [1, 4], 4),  # it does not fit whole
        (None, True, True, 4, [1, 4], 4),  # whole, it fits only recomputing: shard instead
        (True, True, False, 4, [4], 4),  # forced
        (False, False, False, 4, [1], 1),  # refused: the plan recomputes or E-MEM-001
        (True, True, False, 1, [1], 1),  # one rank has no one to share with
    ],
)
def test_the_plan_shards_where_the_whole_state_does_not_fit(
    setting, fits, recomputes, world, asked, shards
):
    device = _Plans(fits, recomputes)
    _, chosen = choose(device, None, setting, world, optimizer="adamw", ranks=world, memory=None)
    assert (device.asked, chosen) == (asked, shards)
    assert shard_line(1, None) == []
    assert shard_line(4, True) == [
        "optimizer states: sharded over 4 ranks (SEXPGPU_SHARD_OPTIMIZER=1)"
    ]


def _device(kind):
    if kind == "cpu":
        return CpuDevice()
    pytest.importorskip("torch")
    from sexpgpu.devices.cuda.device import CudaDevice

    return CudaDevice("cpu")  # the cuda lowering's planner, on PyTorch's CPU device


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_the_plan_counts_the_largest_shard_of_the_moments(kind):
    experiment = load_experiment_text(mlp_text(hidden=256))
    compiled = compile_run(experiment, experiment.run(None))
    device = _device(kind)
    plans = [
        device.plan(compiled, optimizer="adamw", ranks=2, memory=2**30, shards=n) for n in (1, 2)
    ]
    sizes = {k: info.size for k, info in compiled.params.items()}
    assert plans[0].memory.parts["optimizer"] == 2 * 4 * sum(sizes.values())
    assert plans[1].memory.parts["optimizer"] == 2 * 4 * 64 * 256  # the first weight alone
    assert plans[1].memory.parts["parameters"] == plans[0].memory.parts["parameters"]


# The MLP of 256 hidden units on 2 ranks plans 333,564 bytes whole, 310,956 sharded.
BETWEEN = "320000"


def test_a_run_shards_where_its_whole_state_would_not_fit_and_trains_the_same_bits(tmp_path):
    path = tmp_path / "mlp.lisp"
    path.write_text(mlp_text(hidden=256, steps=3, every=3))
    two = {"SEXPGPU_DEVICES": "0,1"}
    roomy = run_experiment(str(path), out=tmp_path / "roomy", environ=two)
    tight = run_experiment(
        str(path), out=tmp_path / "tight", environ=two | {"SEXPGPU_MEMORY": BETWEEN}
    )
    for k in roomy.params:
        assert np.array_equal(roomy.params[k], tight.params[k]), k
    notes = [r["value"] for r in read_metrics(tmp_path / "tight" / "metrics.jsonl")]
    assert "optimizer states: sharded over 2 ranks (the unsharded state does not fit)" in notes
    assert not [n for n in notes if str(n).startswith("recompute:")]
    assert [n for n in notes if str(n).startswith("memory: plan")] == [
        "memory: plan 303.7 KiB of 312.5 KiB "
        "(parameters 75.0 KiB, optimizer 128.0 KiB, activations 100.6 KiB)"
    ]


def test_explain_says_the_state_is_sharded(tmp_path, capsys):
    from sexpgpu.cli import main

    path = tmp_path / "mlp.lisp"
    path.write_text(mlp_text(hidden=256))
    environ = {"SEXPGPU_DEVICES": "0,1", "SEXPGPU_SHARD_OPTIMIZER": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environ.items():
            patch.setenv(name, value)
        assert main(["explain", str(path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "; optimizer states: sharded over 2 ranks (SEXPGPU_SHARD_OPTIMIZER=1)" in out


def test_check_says_the_state_is_sharded_over_the_simulated_ranks(tmp_path, capsys):
    from sexpgpu.cli import main

    path = tmp_path / "mlp.lisp"
    path.write_text(mlp_text(hidden=256))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SEXPGPU_DEVICES", "0,1")
        patch.setenv("SEXPGPU_MEMORY", BETWEEN)
        assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "    optimizer states: sharded over 2 ranks (the unsharded state does not fit) (cpu)" in out
    )
    assert "recompute:" not in out
