"""Data parallel on one node: simulated ranks, the collective seam, the NCCL path on stand-ins."""

import numpy as np
import pytest
from run_reference import series
from standin_program import Mlp, defdata, on_cpu

from sexpgpu.devices.collectives import (
    Comms,
    GroupSum,
    gather_over_ranks,
    local_sum,
    scatter_over_ranks,
    sum_over_ranks,
)
from sexpgpu.devices.shard import shard_params
from sexpgpu.devices.state import TrainState
from sexpgpu.errors import SexpgpuError
from sexpgpu.lang.runs import optimizer_spec
from sexpgpu.runtime.group import DeviceGroup
from sexpgpu.runtime.nodes import GradientCarry
from sexpgpu.train import load_checkpoint
from sexpgpu.train.loop import Trainer
from sexpgpu.train.settings import RunSettings

DIGITS = defdata("digits", "(digits)")
ADAMW = optimizer_spec("adamw", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _settings(**kw):
    base = dict(steps=6, batch=16, microbatches=4, seed=3, optimizer=ADAMW, clip=0.5)
    return RunSettings(**(base | kw))


def _trainer(tmp_path, settings, devices, name, make=None, **kw):
    return Trainer(
        make or (lambda rank: on_cpu(Mlp(batch=settings.batch))),
        DIGITS,
        settings,
        tmp_path / name,
        experiment_hash="h",
        devices=devices,
        target="y",
        **kw,
    )


def test_four_ranks_of_one_microbatch_train_bitwise_like_one_rank(tmp_path):
    s = _settings()
    one = _trainer(tmp_path, s, ("cpu:0",), "one").run()
    four = _trainer(tmp_path, s, tuple(f"cpu:{r}" for r in range(4)), "four").run()
    for k in one.params:  # one rank adds its 4 microbatches in the order the ranks do
        assert np.array_equal(one.params[k], four.params[k])
    assert series(tmp_path / "one", "train/loss") == series(tmp_path / "four", "train/loss")
    assert series(tmp_path / "four", "train/step_time_s").keys() == set(range(1, 7))


class _SkewedAt(TrainState):
    """Rank 1 nudges a parameter after its third update: the ranks no longer agree."""

    def __init__(self, kernels, rank):
        super().__init__(kernels)
        self.rank, self.updates = rank, 0

    def update(self, lr, clip):
        norm = super().update(lr, clip)
        self.updates += 1
        if self.rank == 1 and self.updates == 3:
            self.values["mlp/b2"] += np.float32(1e-3)
        return norm


def test_e_dp_004_skips_that_checkpoint_and_resume_takes_the_one_before(tmp_path):
    ck = {"checkpoint_every": 2, "checkpoint_location": "ck", "steps": 4}
    devices = ("cpu:0", "cpu:1")
    skewed = _trainer(
        tmp_path,
        _settings(**ck),
        devices,
        "run",
        make=lambda rank: _SkewedAt(Mlp(batch=16), rank),
    )
    with pytest.raises(SexpgpuError) as info:
        skewed.run()
    assert info.value.code == "E-DP-004"
    assert info.value.message == (
        "the ranks' parameters or optimizer states differ at step 4; checkpoint not written"
    )
    assert sorted(p.name for p in (tmp_path / "run" / "ck").iterdir()) == ["step-2"]
    resumed = _trainer(tmp_path, _settings(**ck), devices, "run", resume="latest").run()
    assert resumed.resumed_from == 2 and resumed.step == 4
    assert load_checkpoint(tmp_path / "run" / "ck").step == 4


# -- the collective seam -------------------------------------------------------------------


class FakeNccl:
    """``torch.cuda.nccl`` on CPU tensors: the rank-order sum written into every input."""

    def __init__(self):
        self.calls = []

    def all_reduce(self, inputs):
        self.calls.append(("all_reduce", [x.numel() for x in inputs]))
        total = inputs[0].clone()
        for x in inputs[1:]:
            total += x
        for x in inputs:
            x.copy_(total)

    def broadcast(self, inputs, root=0):
        self.calls.append(("broadcast", [x.numel() for x in inputs]))
        for x in inputs:
            x.copy_(inputs[root])

    def reduce_scatter(self, inputs, outputs):
        self.calls.append(("reduce_scatter", [x.numel() for x in inputs]))
        total = inputs[0].clone()
        for x in inputs[1:]:
            total += x
        for rank, out in enumerate(outputs):
            out.copy_(total[rank * out.numel() : (rank + 1) * out.numel()])

    def all_gather(self, inputs, outputs):
        self.calls.append(("all_gather", [x.numel() for x in inputs]))
        import torch

        for out in outputs:
            out.copy_(torch.cat(inputs))


class FakeLink:
    """Node 0 of two whose other node sends what this one does (for the seam's node path)."""

    nodes, node_rank, gradients = 2, 0, "f32"

    def sum(self, tensors, carry):
        return [t + t for t in tensors]

    def allgather(self, value):
        return [value, value]


def _grads(rank):
    import torch

    gen = torch.Generator().manual_seed(rank)
    return {
        "a": torch.randn(3, 5, generator=gen),
        "b": torch.randn(7, generator=gen),
        "c": torch.randn(2, 2, 2, generator=gen),
    }


@pytest.mark.parametrize("link", [None, FakeLink()])
def test_nccl_sum_is_the_group_sum_bucket_by_bucket(link):
    pytest.importorskip("torch")
    from sexpgpu.devices.cuda.collectives import NcclSum

    nccl = FakeNccl()

    def step(ctx, local):
        extra = {} if link is None else {"link": link, "carry": GradientCarry()}
        comms = Comms(ctx, local=local, **extra)
        return sum_over_ranks(comms, 0.5 * (ctx.rank + 1), _grads(ctx.rank))

    group = DeviceGroup(["cpu:0", "cpu:1", "cpu:2"])
    ours = group.run(lambda ctx: step(ctx, NcclSum(nccl, bucket_bytes=4 * 16)))
    theirs = group.run(lambda ctx: step(ctx, GroupSum()))
    for (loss, grads), (ref_loss, ref) in zip(ours, theirs, strict=True):
        assert loss == ref_loss == (3.0 if link is None else 6.0)
        assert grads.keys() == ref.keys()
        for k in ref:
            assert grads[k].shape == ref[k].shape and grads[k].equal(ref[k]), k
    # Buckets of at most 16 elements: a (15), then b and c (7 + 8); one call per bucket,
    # over the three ranks' buckets at once; with nodes, rank 0's sum is broadcast too.
    calls = [("all_reduce", [15] * 3), ("all_reduce", [15] * 3)]
    if link is not None:
        calls += [("broadcast", [15] * 3), ("broadcast", [15] * 3)]
    assert nccl.calls == calls


def test_nccl_reduce_scatter_and_all_gather_are_the_groups_shard_by_shard():
    pytest.importorskip("torch")
    from sexpgpu.devices.cuda.collectives import NcclSum

    nccl = FakeNccl()
    shards = shard_params({"a": 15, "b": 7, "c": 8}, 2)  # [a] [b c]: slots of 15 elements

    def step(ctx, local):
        comms = Comms(ctx, local=local)
        loss, own = scatter_over_ranks(comms, 0.5 * (ctx.rank + 1), _grads(ctx.rank), shards)
        values = {k: g * (ctx.rank + 1) for k, g in _grads(ctx.rank).items()}
        gather_over_ranks(comms, values, shards)  # in place: every entry its owner's
        return loss, own, values

    group = DeviceGroup(["cpu:0", "cpu:1"])
    ours = group.run(lambda ctx: step(ctx, NcclSum(nccl)))
    theirs = group.run(lambda ctx: step(ctx, GroupSum()))
    summed = {k: _grads(0)[k] + _grads(1)[k] for k in "abc"}
    for rank, ((loss, own, values), (ref_loss, ref_own, ref_values)) in enumerate(
        zip(ours, theirs, strict=True)
    ):
        assert loss == ref_loss == 1.5
        assert list(own) == list(ref_own) == shards.of(rank)
        assert all(own[k].equal(ref_own[k]) and own[k].equal(summed[k]) for k in own)
        for k in "abc":
            owner = shards.owner[k]
            assert values[k].equal(ref_values[k])
            assert values[k].equal(_grads(owner)[k] * (owner + 1))
    assert nccl.calls == [("reduce_scatter", [30, 30]), ("all_gather", [15, 15])]


def test_buckets_are_consecutive_and_bounded():
    from sexpgpu.devices.cuda.collectives import buckets

    assert buckets([15, 7, 8], 16) == [[0], [1, 2]]
    assert buckets([40, 1, 1], 16) == [[0], [1, 2]]  # one tensor larger than a bucket
    assert buckets([], 16) == []


def test_nccl_sum_falls_back_to_the_group_off_the_gpus():
    pytest.importorskip("torch")
    from sexpgpu.devices.cuda.collectives import NcclSum

    results = DeviceGroup(["cpu:0", "cpu:1"]).run(
        lambda ctx: NcclSum().all_reduce(ctx, 1.0, _grads(ctx.rank))  # CPU tensors: no NCCL
    )
    expected = {k: _grads(0)[k] + _grads(1)[k] for k in "abc"}
    for loss, grads in results:
        assert loss == 2.0
        assert all(grads[k].equal(expected[k]) for k in "abc")


def test_the_device_kind_chooses_the_local_sum():
    assert type(local_sum("cpu")).__name__ == "GroupSum"
    assert type(local_sum("cuda")).__name__ == "NcclSum"


class _Logged(TrainState):
    """Logs when each step's microbatches are queued, its update queued and its norm read.

    `asynchronous` says whether it stands for a device that only queues its work.
    """

    def __init__(self, kernels, log, asynchronous):
        super().__init__(kernels)
        self.log, self.steps, self._queues = log, 0, asynchronous

    @property
    def asynchronous(self):
        return self._queues

    def accumulate(self, batch):
        super().accumulate(batch)
        self.log.append(("accumulate", self.steps + 1))

    def update(self, lr, clip):
        norm = super().update(lr, clip)
        self.steps += 1
        self.log.append(("update", self.steps))
        return _Read(norm, self.steps, self.log)


class _Read:
    def __init__(self, value, step, log):
        self.value, self.step, self.log = value, step, log

    def __float__(self):
        self.log.append(("read", self.step))
        return float(self.value)


def _order(tmp_path, asynchronous):
    log = []
    s = _settings(microbatches=1, steps=5, eval_every=3, eval_batches=1)
    make = lambda rank: _Logged(Mlp(batch=16), log, asynchronous)  # noqa: E731
    _trainer(tmp_path, s, ("cpu:0",), "run", make=make).run()
    at = {event: i for i, event in enumerate(log)}
    assert len(at) == len(log) == 15
    return at


def test_the_next_steps_microbatches_are_queued_before_the_host_reads_a_step(tmp_path):
    at = _order(tmp_path, asynchronous=True)
    for n in (1, 2, 4):  # queued ahead: the host reads step n while step n + 1 computes
        assert at[("update", n)] < at[("accumulate", n + 1)] < at[("read", n)]
        assert at[("read", n)] < at[("update", n + 1)]
    assert at[("read", 3)] < at[("accumulate", 4)]  # it evaluates: nothing queued behind it
    assert at[("update", 5)] < at[("read", 5)]


def test_a_device_that_computes_as_called_reads_each_step_before_the_next(tmp_path):
    at = _order(tmp_path, asynchronous=False)
    for n in range(1, 5):
        assert at[("update", n)] < at[("read", n)] < at[("accumulate", n + 1)]
