"""One run over several nodes: `sexpgpu run` processes on loopback, summing over Gloo.

The nodes run on the cpu device (docs/devices.md, "Several nodes"): the same
rendezvous, cross-node sums, records and checkpoints as GPU nodes, with Gloo
in place of NCCL.
"""

import json
import signal
import time

import numpy as np
import pytest
from mlp_experiment import mlp_text
from node_helpers import finish, run_nodes, start_nodes
from run_reference import series

from sexpgpu.errors import SexpgpuError
from sexpgpu.train import load_checkpoint, run_experiment
from sexpgpu.train.metrics import read_metrics

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)

MLP = mlp_text(hidden=16, steps=6, every=3)


def _experiment(tmp_path, text=MLP, name="mlp.lisp"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _ok(results):
    assert [r.rc for r in results] == [0] * len(results), [r.err for r in results]


def _error(result, code):
    assert result.rc == 1, (result.rc, result.err)
    assert f"error[{code}]" in result.err, result.err
    assert "Traceback" not in result.err, result.err
    return result.err


def test_two_f32_nodes_train_bitwise_like_one_node_of_two_ranks(tmp_path):
    path = _experiment(tmp_path)
    a, b = tmp_path / "node0", tmp_path / "node1"
    _ok(
        run_nodes(
            [[path, "--out", str(a)], [path, "--out", str(b)]],
            envs=[{"SEXPGPU_NODE_GRADIENTS": "f32"}] * 2,
        )
    )
    assert not b.exists()  # node 1 writes no records
    ranks = run_experiment(path, out=tmp_path / "ranks", environ={"SEXPGPU_DEVICES": "0,1"})
    one = run_experiment(path, out=tmp_path / "one", environ={})
    nodes = load_checkpoint(a / "checkpoints")
    assert nodes.step == 6
    for k in ranks.params:  # one microbatch per rank: every sum is in one order
        assert np.array_equal(nodes.params[k], ranks.params[k])
        assert np.array_equal(nodes.params[k], one.params[k])
    losses = series(a, "train/loss")
    assert (
        losses == series(tmp_path / "ranks", "train/loss") == series(tmp_path / "one", "train/loss")
    )
    state = nodes.state
    assert (state["devices"], state["nodes"], state["node_gradients"]) == (1, 2, "f32")
    assert [x["rank"] for x in state["loaders"]] == [0, 1]
    assert not [k for k in nodes.optimizer if k.startswith("carry/")]  # f32 carries nothing
    notes = [r["value"] for r in read_metrics(a / "metrics.jsonl") if r["name"] == "annotation"]
    assert "nodes: 2, 1 device(s) each; gradients between nodes in f32" in notes
    assert json.loads((a / "status.json").read_text())["state"] == "done"


def test_bf16_nodes_carry_the_rounding_and_resume_exactly(tmp_path):
    path = _experiment(tmp_path)
    whole = tmp_path / "whole"
    _ok(run_nodes([[path, "--out", str(whole)]] * 2))  # bf16: the default
    steps = whole / "checkpoints"
    six, three = load_checkpoint(steps), load_checkpoint(steps / "step-3")
    assert six.state["node_gradients"] == "bf16"
    carries = [six.optimizer[f"carry/node-{n}"] for n in range(2)]
    size = sum(p.size for p in six.params.values())
    assert [c.shape for c in carries] == [(size,), (size,)]
    assert all(np.any(c != 0) and np.all(np.abs(c) < 1e-2) for c in carries)
    exact = run_experiment(path, out=tmp_path / "exact", environ={"SEXPGPU_DEVICES": "0,1"})
    for k in exact.params:  # rounded, close, not equal
        np.testing.assert_allclose(six.params[k], exact.params[k], atol=2e-2)  # adamw: ~lr
    assert any(not np.array_equal(six.params[k], exact.params[k]) for k in exact.params)

    # Resumed from step 3 on two nodes: bitwise the uninterrupted run, residuals and all.
    resumed = tmp_path / "resumed"
    resume = ["--resume", str(steps / "step-3"), "--out", str(resumed)]
    _ok(run_nodes([[path, *resume]] * 2))
    again = load_checkpoint(resumed / "checkpoints")
    assert again.step == 6
    for k in six.params:
        assert np.array_equal(again.params[k], six.params[k])
    for k in six.optimizer:
        assert np.array_equal(again.optimizer[k], six.optimizer[k]), k
    losses = series(whole, "train/loss")
    # A branch: its parent's steps up to 3 (run.json), then its own.
    assert series(resumed, "train/loss") == losses

    # Nodes that resume different checkpoints: E-DP-006 on both, naming the checkpoint.
    results = run_nodes(
        [
            [path, "--resume", str(steps / "step-3"), "--out", str(tmp_path / "x")],
            [path, "--resume", str(steps / "step-6"), "--out", str(tmp_path / "y")],
        ]
    )
    for r in results:
        err = _error(r, "E-DP-006")
        assert "node 1 differs from node 0 in checkpoint: 'step 6, parameters" in err
    # Resumed on one node: E-DP-002, naming both counts.
    with pytest.raises(SexpgpuError) as info:
        run_experiment(path, out=tmp_path / "z", resume=str(steps / "step-3"), environ={})
    assert info.value.code == "E-DP-002"
    assert info.value.message == (
        f"checkpoint {three.where} was written by 1 device(s) on 2 node(s); this run has 1 on 1"
    )
    assert info.value.location == "SEXPGPU_NODES"


@pytest.mark.parametrize(
    "node1, differs",
    [
        ({"SEXPGPU_NODE_GRADIENTS": "f32"}, "node gradients: 'f32' on node 1, 'bf16' on node 0"),
        ({"SEXPGPU_DEVICES": "0,1"}, "devices per node: 2 on node 1, 1 on node 0"),
        ({"SEXPGPU_SHARD_OPTIMIZER": "1"}, "optimizer states sharded: True on node 1, False on"),
    ],
)
def test_e_dp_006_a_node_that_differs(tmp_path, node1, differs):
    path = _experiment(tmp_path, MLP.replace("(microbatches 2)", "(microbatches 4)"))
    out = ["--out", str(tmp_path / "run")]
    results = run_nodes([[path, *out]] * 2, envs=[{}, node1])
    for r in results:
        assert f"error[E-DP-006]: node 1 differs from node 0 in {differs}" in _error(r, "E-DP-006")
    assert not (tmp_path / "run").exists()


def test_e_dp_007_a_node_that_never_arrives(tmp_path):
    path = _experiment(tmp_path)
    began = time.monotonic()
    [result] = run_nodes(
        [[path, "--out", str(tmp_path / "run")]], nodes=2, envs=[{"SEXPGPU_NODE_TIMEOUT": "2"}]
    )
    err = _error(result, "E-DP-007")
    assert "node 0 waited 2 s at SEXPGPU_RENDEZVOUS=127.0.0.1:" in err
    assert "but not all 2 nodes arrived" in err
    assert time.monotonic() - began < 60
    assert not (tmp_path / "run").exists()


def test_e_dp_007_a_node_killed_mid_run_stops_the_others(tmp_path):
    path = _experiment(tmp_path, MLP.replace("(steps 6)", "(steps 100000)"))
    run_dir = tmp_path / "run"
    procs = start_nodes([[path, "--out", str(run_dir)], [path, "--out", str(tmp_path / "n1")]])
    try:
        deadline = time.monotonic() + 120
        while (
            len(series(run_dir, "train/loss") if (run_dir / "metrics.jsonl").exists() else {}) < 3
        ):
            assert procs[0].poll() is None, procs[0].communicate()
            assert time.monotonic() < deadline, "no step 3 in 120 s"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        [node0] = finish(procs[:1], deadline=60)
    finally:
        finish(procs, deadline=1)
    assert time.monotonic() - killed < 30  # bounded: no hang, well inside the node timeout
    err = _error(node0, "E-DP-007")
    assert "node 0: another node left the run" in err
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] >= 1  # rewritten at most once a second


def test_two_nodes_of_two_ranks_train_like_four_ranks(tmp_path):
    text = MLP.replace("(microbatches 2)", "(microbatches 4)").replace(
        ":seed 3", ":seed 3\n  :diagnostics ((grad-norm :every 2 :reduce max))"
    )
    path = _experiment(tmp_path, text)
    env = {"SEXPGPU_DEVICES": "0,1", "SEXPGPU_NODE_GRADIENTS": "f32"}
    _ok(run_nodes([[path, "--out", str(tmp_path / "nodes")]] * 2, envs=[env, env]))
    four = run_experiment(path, out=tmp_path / "four", environ={"SEXPGPU_DEVICES": "0,1,2,3"})
    nodes = load_checkpoint(tmp_path / "nodes" / "checkpoints")
    assert [x["rank"] for x in nodes.state["loaders"]] == [0, 1, 2, 3]
    for k in four.params:  # (g0 + g1) + (g2 + g3) against ((g0 + g1) + g2) + g3
        np.testing.assert_allclose(nodes.params[k], four.params[k], rtol=1e-5, atol=1e-6)
    ours, theirs = (
        series(tmp_path / "nodes", "diag/grad-norm"),
        series(tmp_path / "four", "diag/grad-norm"),
    )
    assert sorted(ours) == [2, 4, 6]
    np.testing.assert_allclose([ours[s] for s in ours], [theirs[s] for s in ours], rtol=1e-5)


def _same_files(a, b, steps):
    for step in steps:
        for file in sorted((a / step).iterdir()):
            assert file.read_bytes() == (b / step / file.name).read_bytes(), (step, file.name)


def test_two_nodes_of_two_ranks_shard_the_state_bitwise_like_keeping_it_all(tmp_path):
    # bf16 between nodes: each node's contribution is rounded as a whole, carry and all.
    path = _experiment(tmp_path, MLP.replace("(microbatches 2)", "(microbatches 4)"))
    whole, shard, resumed = (tmp_path / d for d in ("whole", "shard", "resumed"))
    env = {"SEXPGPU_DEVICES": "0,1", "SEXPGPU_SHARD_OPTIMIZER": "0"}
    sharded = env | {"SEXPGPU_SHARD_OPTIMIZER": "1"}
    _ok(run_nodes([[path, "--out", str(whole)]] * 2, envs=[env, env]))
    _ok(run_nodes([[path, "--out", str(shard)]] * 2, envs=[sharded, sharded]))
    _same_files(whole / "checkpoints", shard / "checkpoints", ["step-3", "step-6"])
    assert series(whole, "train/loss") == series(shard, "train/loss")
    notes = [r["value"] for r in read_metrics(shard / "metrics.jsonl") if r["name"] == "annotation"]
    assert "optimizer states: sharded over 4 ranks (SEXPGPU_SHARD_OPTIMIZER=1)" in notes

    # The unsharded run's step 3 resumed sharded: the same step 6.
    step3 = whole / "checkpoints" / "step-3"
    _ok(run_nodes([[path, "--resume", str(step3), "--out", str(resumed)]] * 2, envs=[sharded] * 2))
    _same_files(whole / "checkpoints", resumed / "checkpoints", ["step-6"])
