"""Sharded f32 master weights where the fused bf16 step reads bf16 copies: bitwise unsharded.

The cuda lowering on PyTorch's CPU device, its training step compiled (as on
a GPU) so that it reads the parameters' bf16 copies; simulated ranks. A
rank keeps the f32 of its own shard's parameters alone and the copies of the
others'; evaluation, diagnostics, checkpoints and the run's result gather
the f32 from the owners. Everything must be the unsharded run's, bit for bit.
"""

import shutil

import numpy as np
import pytest
from mlp_experiment import mlp_text
from run_reference import series

from sexpgpu.train import run_experiment

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler for Inductor")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One compile cache for the module: the runs share one compiled step."""
    folder = tmp_path_factory.getbasetemp() / "master-shards-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder / "sexpgpu" / "inductor"))
    monkeypatch.delenv("SEXPGPU_CACHE", raising=False)


@pytest.fixture(autouse=True)
def _queues_like_a_gpu(monkeypatch):
    """Streams that say they queue, as a GPU's: a run queues each step behind the last's numbers."""
    from sexpgpu.devices.cuda.stream import TorchStream

    made = TorchStream.__init__

    def queuing(self, device):
        made(self, device)
        self.asynchronous = True

    monkeypatch.setattr(TorchStream, "__init__", queuing)


def _experiment(tmp_path, microbatches):
    text = mlp_text(hidden=16, steps=6, every=3).replace(
        "(microbatches 2)", f"(microbatches {microbatches})"
    )
    text = text.replace(
        ":seed 3",
        ':seed 3\n  :dtype "bf16"\n  :eval (every 2 :batches 2)\n'
        "  :diagnostics ((activation-rms :every 3))",
    )
    path = tmp_path / "mlp.lisp"
    path.write_text(text)
    return str(path)


def _device():
    from sexpgpu.devices.cuda.device import CudaDevice

    return CudaDevice("cpu", fuse=True)


def _run(path, out, ranks, shard, **kw):
    from device_seam import device_named

    environ = {
        "SEXPGPU_DEVICES": ",".join(map(str, range(ranks))),
        "SEXPGPU_SHARD_OPTIMIZER": shard,
    }
    with device_named("cpu", _device()):
        return run_experiment(path, out=out, environ=environ, **kw)


def _same_runs(a, b, ranks_a, ranks_b, steps=("step-3", "step-6")):
    for k in ranks_a.params:
        assert np.array_equal(ranks_a.params[k], ranks_b.params[k]), k
    for name in ("train/loss", "train/grad_norm", "eval/loss", "diag/activation-rms/mlp"):
        assert series(a, name) == series(b, name), name
    assert series(a, "eval/loss")  # evaluated, not vacuous
    for step in steps:
        for file in sorted((a / "checkpoints" / step).iterdir()):
            other = b / "checkpoints" / step / file.name
            assert file.read_bytes() == other.read_bytes(), (step, file.name)


@pytest.mark.parametrize("ranks", [2, 4])  # of 4: two ranks own no parameter
def test_sharded_master_weights_train_bitwise_like_every_rank_keeping_all(tmp_path, ranks):
    path = _experiment(tmp_path, ranks)
    whole = _run(path, tmp_path / "whole", ranks, "0")
    shard = _run(path, tmp_path / "shard", ranks, "1")
    _same_runs(tmp_path / "whole", tmp_path / "shard", whole, shard)


@pytest.mark.parametrize("first, then", [("1", "0"), ("0", "1")])
def test_a_resume_crosses_between_sharded_and_whole_master_weights(tmp_path, first, then):
    path = _experiment(tmp_path, 2)
    straight = _run(path, tmp_path / "straight", 2, "0")
    _run(path, tmp_path / "first", 2, first)
    step3 = tmp_path / "first" / "checkpoints" / "step-3"
    resumed = _run(path, tmp_path / "resumed", 2, then, resume=str(step3))
    assert resumed.resumed_from == 3
    _same_runs(tmp_path / "straight", tmp_path / "resumed", straight, resumed, steps=("step-6",))


def test_each_rank_keeps_the_f32_of_its_own_shard_and_copies_of_the_rest():
    from sexpgpu.devices.collectives import Comms
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment_text
    from sexpgpu.runtime.group import DeviceGroup

    text = mlp_text(hidden=16).replace(":seed 3", ':seed 3 :dtype "bf16"')
    experiment = load_experiment_text(text)
    run = experiment.run(None)
    compiled = compile_run(experiment, run)
    device = _device()
    plan = device.plan(compiled, optimizer="adamw", ranks=2, memory=None, microbatches=1, shards=2)
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.standard_normal(compiled.inputs["x"][0]).astype(np.float32),
        "y": rng.integers(0, 10, compiled.inputs["y"][0]).astype(np.int32),
    }

    def rank(ctx):
        comms = Comms(ctx)
        program = device.load(plan, ctx.device)
        program.start(run.optimizer, seed=1, state=None, shard_over=comms)
        program.accumulate(batch)
        program.reduce(comms, ctx.size)
        program.update(1e-2, 0.5)
        owned = program.shards.of(comms.rank)
        kept, alone = sorted(program.values), sorted(program.copies_alone)
        # In pieces (op by op, after an allocation failed): the copies widened, as the f32.
        fed = {**program.values, **program._stand_ins}
        pieces = program.graphs.accumulate_pieces(fed, batch, None, 2)
        program.gather_params()
        whole = program.host_params()
        exact = program.graphs.accumulate_pieces(program._f32(), batch, None, 2)
        assert float(pieces.loss) == float(exact.loss)
        for k, g in exact.grads.items():
            assert torch.equal(pieces.grads[k], g), k
        return owned, kept, alone, whole, program.evaluate(batch, "y").loss

    got = DeviceGroup(("cpu:0", "cpu:1")).run(rank)
    params = sorted(compiled.params)
    for owned, kept, alone, _, _ in got:
        assert kept == sorted(owned) and alone == sorted(set(params) - set(owned))
    (*_, whole0, loss0), (*_, whole1, loss1) = got
    assert sorted(whole0) == params and loss0 == loss1
    for k in params:  # every rank holds every f32 parameter once gathered
        assert np.array_equal(whole0[k], whole1[k]), k


@pytest.mark.gpu
def test_the_plan_counts_a_gpu_s_own_master_weights():
    """Where it measures the step (a GPU), the plan's `parameters` are the rank's f32 alone."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from sexpgpu.devices.cuda.device import CudaDevice
    from sexpgpu.devices.shard import master_elements
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment_text

    # Two hidden layers of one size: a rank's shard never holds every large weight (with
    # one, the stand-in for it costs what sharding saves).
    text = mlp_text(hidden=64).replace(":seed 3", ':seed 3 :dtype "bf16"')
    text = text.replace("(linear hidden) tanh", "(linear hidden) tanh (linear hidden) tanh")
    experiment = load_experiment_text(text)
    compiled = compile_run(experiment, experiment.run(None))
    device = CudaDevice("cuda")
    whole = device.plan(compiled, optimizer="adamw", ranks=2, memory=None, shards=1)
    shard = device.plan(compiled, optimizer="adamw", ranks=2, memory=None, shards=2)
    assert whole.memory.parts["parameters"] == 4 * compiled.param_count
    only = shard.fused.copies_only
    assert sorted(only) == sorted(compiled.params)  # every weight and bias
    expected = 4 * master_elements(compiled, 2, only)
    assert shard.memory.parts["parameters"] == expected < 4 * compiled.param_count
