"""The bf16 copies of parameters the fused step reads (`sexpgpu.devices.cuda.param_copies`)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sexpgpu.devices.cuda.param_copies import ParamCopies  # noqa: E402

BF16 = torch.bfloat16


def test_a_copy_is_the_cast_and_follows_in_place_writes():
    copies, p, q = ParamCopies(), torch.randn(5, 3), torch.randn(2)
    first, other = copies.current([p, q])
    assert torch.equal(first, p.to(BF16)) and torch.equal(other, q.to(BF16))
    p.mul_(3)  # counts up p's version
    again, same = copies.current([p, q])
    assert again is first and torch.equal(again, p.to(BF16))
    assert same is other and torch.equal(same, q.to(BF16))
    assert copies.nbytes == 2 * (p.numel() + q.numel())


def test_a_write_that_bypasses_the_version_counter_must_write_the_copy():
    copies, p = ParamCopies(), torch.randn(4)
    (copy,) = copies.current([p])
    (written,) = copies.written_with([p])
    assert written is copy
    p.data.add_(1.0)  # as the update's kernel writes: p's version stays
    written.copy_(p.data)
    assert torch.equal(copies.current([p])[0], p.to(BF16))
    assert copies.written_with([torch.randn(4)]) == [None]  # no copy of a stranger


def test_refresh_casts_again_after_a_write_that_made_no_copy():
    copies, p = ParamCopies(), torch.randn(6)
    copies.current([p])
    torch._fused_adamw_(
        [p], [torch.ones(6)], [torch.zeros(6)], [torch.zeros(6)], [], [torch.ones(())],
        lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
    )  # fmt: skip
    copies.refresh([p])
    assert torch.equal(copies.current([p])[0], p.to(BF16))


def test_copies_belong_to_the_tensor_not_its_address():
    copies = ParamCopies()
    p = torch.zeros(8)
    copies.current([p])
    del p
    q = torch.ones(8)  # may reuse the freed memory
    assert torch.equal(copies.current([q])[0], q.to(BF16))
    assert copies.nbytes == 2 * 8  # the dead parameter's copy went


MLP = """
(defdata digits (digits) :split 0.9)
(defmodel mlp (x) (-> x (linear 32) gelu (linear 10)))
(defrun train :model mlp :data digits :loss (cross-entropy (mlp x) y)
  :optimizer (adamw :lr 1e-2 :weight-decay 0.1) :batch 16 :steps 4 :seed 3 :dtype "bf16")
"""


class _OneRank:
    size, rank = 1, 0


def _program(fuse: bool):
    from sexpgpu.devices.cuda.device import CudaDevice
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment_text
    from sexpgpu.runtime.devices import Device

    experiment = load_experiment_text(MLP, "mlp.lisp")
    compiled = compile_run(experiment, experiment.run())
    device = CudaDevice("cpu", fuse=fuse)
    plan = device.plan(compiled, optimizer="adamw", ranks=1, memory=None)
    program = device.load(plan, Device("cpu", 0))
    program.start(experiment.run().optimizer, seed=1, state=None)
    return compiled, program


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler for Inductor")
def test_a_fused_bf16_step_reads_the_copies_the_update_keeps():
    compiled, fused = _program(fuse=True)
    _, eager = _program(fuse=False)
    step = fused.graphs.fused
    assert sorted(step.copied) == sorted(compiled.params)  # every weight and bias is cast
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = {"x": rng.standard_normal((16, 64)).astype(np.float32)}
        batch["y"] = rng.integers(0, 10, 16).astype(np.int32)
        losses = []
        for program in (fused, eager):
            program.accumulate(batch)
            losses.append(program.reduce(_OneRank(), 1))
            program.update(1e-2, None)
        np.testing.assert_allclose(float(losses[0]), float(losses[1]), rtol=1e-2)
        for name in step.copied:  # current without a cast of their own: the update wrote them
            p = fused.values[name]
            copies = fused.graphs.copies  # the step reads them, the update writes them
            assert torch.equal(copies._entry(p).copy, p.to(BF16))
            assert copies._entry(p).version == p._version


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler for Inductor")
def test_a_step_without_copies_casts_its_parameters_itself():
    # What a plan that recomputes to fit compiles: bf16 copies kept all step would take
    # memory it has not got.
    from sexpgpu.devices.cuda.fused import FusedGraph
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment_text

    experiment = load_experiment_text(MLP, "mlp.lisp")
    compiled = compile_run(experiment, experiment.run())
    graph, device = compiled.train_graph, torch.device("cpu")
    params = {k: torch.from_numpy(v) for k, v in compiled.init_params(0).items()}
    rng = np.random.default_rng(1)
    batch = {"x": torch.from_numpy(rng.standard_normal((16, 64)).astype(np.float32))}
    batch["y"] = torch.from_numpy(rng.integers(0, 10, 16).astype(np.int32))
    sums = {}
    for copies in (True, False):
        step = FusedGraph(
            graph, device, sums=list(graph.outputs), examples={**batch, **params}, copies=copies
        )
        assert bool(step.copied) is copies
        buffers = step.zero_buffers()
        step({**batch, **params}, buffers)
        sums[copies] = buffers
    for name, value in sums[True].items():
        assert torch.equal(value, sums[False][name]), name
