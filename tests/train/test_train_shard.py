"""Optimizer states sharded over ranks (ZeRO stage 1): bitwise an unsharded run, on every path.

Simulated cpu ranks through ``sexpgpu run``'s library side, for each optimizer
and across a resume in either direction; the cuda lowering on PyTorch's CPU
device; programs stepped by hand, on simulated ranks and (``-m gpu``) on
GPUs, where ranks share one GPU if there is only one; the plan's choice is
in tests/devices/test_shard.py, loopback nodes in test_train_nodes.py.
"""

import numpy as np
import pytest
from mlp_experiment import mlp_text
from run_reference import series

from sexpgpu.train import run_experiment
from sexpgpu.train.metrics import read_metrics

OPTIMIZERS = {
    "adamw": None,  # the experiment's own
    "sgd": "(sgd :lr 0.05 :momentum 0.9 :nesterov true)",
    "muon": "(muon :lr 0.1 :adamw-lr 1e-2 :weight-decay 0.1)",
}
ADAMW = "(adamw :lr 1e-2 :betas [0.9 0.95] :weight-decay 0.1)"


def _experiment(tmp_path, optimizer=None, microbatches=4):
    text = mlp_text(hidden=16, steps=6, every=3).replace(
        "(microbatches 2)", f"(microbatches {microbatches})"
    )
    text = text.replace(":seed 3", ":seed 3\n  :diagnostics ((grad-norm :every 1 :reduce max))")
    if optimizer is not None:
        text = text.replace(ADAMW, optimizer)
    path = tmp_path / "mlp.lisp"
    path.write_text(text)
    return str(path)


def _run(path, out, ranks, shard, **kw):
    environ = {
        "SEXPGPU_DEVICES": ",".join(map(str, range(ranks))),
        "SEXPGPU_SHARD_OPTIMIZER": shard,
    }
    return run_experiment(path, out=out, environ=environ, **kw)


def _notes(run_dir):
    return [
        r["value"] for r in read_metrics(run_dir / "metrics.jsonl") if r["name"] == "annotation"
    ]


def _same_checkpoints(a, b, steps=("step-3", "step-6")):
    """Both runs' checkpoints are the same files, byte for byte (state.json and all)."""
    for step in steps:
        for file in sorted((a / "checkpoints" / step).iterdir()):
            other = b / "checkpoints" / step / file.name
            assert file.read_bytes() == other.read_bytes(), (step, file.name)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sharded_states_train_bitwise_like_every_rank_keeping_all(tmp_path, optimizer, ranks):
    path = _experiment(tmp_path, OPTIMIZERS[optimizer])
    whole = _run(path, tmp_path / "whole", ranks, "0")
    shard = _run(path, tmp_path / "shard", ranks, "1")
    for k in whole.params:
        assert np.array_equal(whole.params[k], shard.params[k]), k
    for name in ("train/loss", "train/grad_norm", "diag/grad-norm"):
        assert series(tmp_path / "whole", name) == series(tmp_path / "shard", name), name
    _same_checkpoints(tmp_path / "whole", tmp_path / "shard")
    line = f"optimizer states: sharded over {ranks} ranks (SEXPGPU_SHARD_OPTIMIZER=1)"
    assert line in _notes(tmp_path / "shard")
    assert not [n for n in _notes(tmp_path / "whole") if n.startswith("optimizer states")]


@pytest.mark.parametrize("first, then", [("1", "0"), ("0", "1"), ("1", "1")])
def test_a_resume_crosses_between_sharded_and_whole_states(tmp_path, first, then):
    path = _experiment(tmp_path, microbatches=2)
    straight = _run(path, tmp_path / "straight", 2, "0")
    _run(path, tmp_path / "first", 2, first)
    step3 = tmp_path / "first" / "checkpoints" / "step-3"
    resumed = _run(path, tmp_path / "resumed", 2, then, resume=str(step3))
    assert resumed.resumed_from == 3
    for k in straight.params:
        assert np.array_equal(straight.params[k], resumed.params[k]), k
    assert series(tmp_path / "straight", "train/loss") == series(tmp_path / "resumed", "train/loss")
    _same_checkpoints(tmp_path / "straight", tmp_path / "resumed", steps=("step-6",))


@pytest.mark.parametrize("ranks", [2, 4])  # of 4: two ranks own no parameter
def test_the_cuda_lowering_shards_as_it_keeps_all(tmp_path, ranks):
    pytest.importorskip("torch")
    from device_seam import device_named

    from sexpgpu.devices.cuda.device import CudaDevice

    path = _experiment(tmp_path, microbatches=ranks)
    with device_named("cpu", CudaDevice("cpu")):
        whole = _run(path, tmp_path / "whole", ranks, "0")
        shard = _run(path, tmp_path / "shard", ranks, "1")
    for k in whole.params:
        assert np.array_equal(whole.params[k], shard.params[k]), k
    assert series(tmp_path / "whole", "train/loss") == series(tmp_path / "shard", "train/loss")
    _same_checkpoints(tmp_path / "whole", tmp_path / "shard")


def _steps(devices, shard, make, compiled, steps=3):
    """`steps` of programs on `devices`, the state sharded or not: every rank's parameters."""
    from sexpgpu.devices.collectives import Comms, GroupSum
    from sexpgpu.lang.runs import optimizer_spec
    from sexpgpu.runtime.group import DeviceGroup

    spec = optimizer_spec("adamw", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.standard_normal(compiled.inputs["x"][0]).astype(np.float32),
            "y": rng.integers(0, 10, compiled.inputs["y"][0]).astype(np.int32),
        }
        for _ in range(steps * len(devices))
    ]

    def rank(ctx):
        # Ranks sharing one GPU (or on simulated ranks) sum through the group's copies.
        comms = Comms(ctx, local=GroupSum()) if len(set(devices)) < len(devices) else Comms(ctx)
        program = make(ctx.device)
        program.start(spec, seed=1, state=None, shard_over=comms if shard else None)
        for step in range(steps):
            program.accumulate(batches[step * ctx.size + ctx.rank])
            program.reduce(comms, ctx.size)
            float(program.update(1e-2, 0.5))
        state = program.host_state()
        return state.params, state.moments

    return DeviceGroup(devices).run(rank)


@pytest.mark.parametrize(
    "kind, devices",
    [
        ("cpu", ("cpu:0", "cpu:1")),
        pytest.param("cuda", None, marks=pytest.mark.gpu),
    ],
)
def test_programs_shard_their_state_and_agree_with_programs_that_keep_it_all(kind, devices):
    from sexpgpu.devices.base import get_device
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment_text

    if kind == "cuda":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        count = torch.cuda.device_count()
        devices = tuple(f"cuda:{r % count}" for r in range(2))  # one GPU: both ranks on it
    experiment = load_experiment_text(mlp_text(hidden=16))
    compiled = compile_run(experiment, experiment.run(None))
    device = get_device(kind)
    plan = device.plan(compiled, optimizer="adamw", ranks=2, memory=None, microbatches=1, shards=2)
    make = lambda where: device.load(plan, where)  # noqa: E731
    whole = _steps(devices, False, make, compiled)
    shard = _steps(devices, True, make, compiled)
    # Bitwise on the host; a GPU's fused step may sum in another order from call to call.
    same = np.array_equal if kind == "cpu" else _close
    for (params, _), (ref_params, _) in zip(shard, whole, strict=True):
        for k in ref_params:
            assert same(params[k], ref_params[k]), k
    assert shard[1][1] == {}  # rank 1 holds no one's moments on the host
    assert list(shard[0][1]) == list(whole[0][1])  # rank 0 gathered them, in order
    for k, v in whole[0][1].items():
        assert same(shard[0][1][k], v), k


def _close(a, b):
    return np.allclose(a, b, rtol=1e-4, atol=1e-6)
