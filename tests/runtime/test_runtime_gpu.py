"""The runtime on real GPUs: collectives between CUDA ranks, budgets, peaks, OOM.

Run on a GPU machine with ``pytest -m gpu tests/runtime``. With one GPU the
ranks share it; with several they sit on different GPUs, so the copies cross
devices. Skipped without CUDA.
"""

import functools
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sexpgpu.cli import main  # noqa: E402
from sexpgpu.runtime.config import RuntimeConfig  # noqa: E402
from sexpgpu.runtime.devices import Device, cuda_capability, require_capability  # noqa: E402
from sexpgpu.runtime.group import DeviceGroup, GroupAborted  # noqa: E402
from sexpgpu.runtime.memory import RESERVE, PeakTracker, detect_budget  # noqa: E402
from sexpgpu.runtime.oom import SplitState, is_allocation_failure, run_with_split  # noqa: E402
from sexpgpu.runtime.units import MiB  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_group(size: int) -> DeviceGroup:
    count = torch.cuda.device_count()
    return DeviceGroup([f"cuda:{r % count}" for r in range(size)], timeout=60)


def rank_tensors(size: int, shape=(13, 7), seed=0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(size)]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_all_reduce_on_gpus_is_bitwise_the_rank_order_sum(size):
    host = rank_tensors(size)
    reference = functools.reduce(torch.add, host)

    def step(ctx):
        device = ctx.device.torch_device()
        total = ctx.all_reduce(host[ctx.rank].to(device))
        assert total.device == device
        return total.cpu()

    for total in cuda_group(size).run(step):
        assert torch.equal(total, reference)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_broadcast_allgather_gather_scatter_on_gpus(size):
    host = rank_tensors(size, (5, 3), seed=1)
    chunks = list(torch.arange(3.0 * 11).reshape(11, 3).tensor_split(size))
    root = size - 1

    def step(ctx):
        device = ctx.device.torch_device()
        mine = host[ctx.rank].to(device)
        b = ctx.broadcast(mine, root=root)
        g = ctx.allgather(mine)
        ga = ctx.gather(mine, root=root)
        s = ctx.scatter([c.to(device) for c in chunks] if ctx.rank == root else None, root)
        assert b.device == device and s.device == device
        assert all(t.device == device for t in g)
        return b.cpu(), [t.cpu() for t in g], ga and [t.cpu() for t in ga], s.cpu()

    results = cuda_group(size).run(step)
    for rank, (b, g, ga, s) in enumerate(results):
        assert torch.equal(b, host[root])
        assert all(torch.equal(x, y) for x, y in zip(g, host, strict=True))
        assert (ga is None) == (rank != root)
        assert torch.equal(s, chunks[rank])


def test_work_on_a_side_stream_is_finished_before_others_read_it():
    size = 2
    a = torch.randn(2048, 2048)

    def step(ctx):
        device = ctx.device.torch_device()
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            x = a.to(device, non_blocking=True)
            for _ in range(8):  # long enough that a missing wait shows
                x = torch.tanh(x @ x / 2048)
            total = ctx.all_reduce(x)
        return x.cpu(), total.cpu()

    results = cuda_group(size).run(step)
    expected = functools.reduce(torch.add, [x for x, _ in results])
    for _, total in results:
        assert torch.equal(total, expected)


@pytest.mark.parametrize("size", [1, 2])
def test_exchanging_host_values_leaves_the_queued_work_queued(size):
    # A run's ranks exchange their step's numbers while the device computes the step.
    def step(ctx):
        torch.cuda._sleep(2_000_000_000)  # about a second of one kernel, queued
        done = torch.cuda.Event()
        done.record()
        everyone = ctx.allgather({"rank": ctx.rank, "events": ["a line"]})
        pending = not done.query()
        total = ctx.all_reduce(torch.ones(1, device=ctx.device.torch_device()))
        assert done.query()  # a tensor's collective waits for it
        return pending, everyone, float(total)

    for pending, everyone, total in cuda_group(size).run(step):
        assert pending
        assert everyone == [{"rank": r, "events": ["a line"]} for r in range(size)]
        assert total == size


def test_a_failing_gpu_rank_aborts_the_group():
    seen = {}

    def step(ctx):
        x = torch.ones(4, device=ctx.device.torch_device())
        if ctx.rank == 1:
            raise KeyError("rank 1")
        try:
            ctx.all_reduce(x)
        except GroupAborted as err:
            seen[ctx.rank] = err.failed_rank
            raise

    with pytest.raises(KeyError):
        cuda_group(3).run(step)
    assert seen == {0: 1, 2: 1}


def test_config_sees_the_gpus():
    config = RuntimeConfig.from_env({}, "cuda")
    assert config.devices == tuple(range(torch.cuda.device_count()))
    require_capability(config.local_devices)  # the lent machines are Ampere or newer
    assert cuda_capability(0) >= (8, 0)


def test_budget_is_free_memory_less_the_reserve():
    free_before, _ = torch.cuda.mem_get_info(0)
    budget = detect_budget("cuda:0")
    free_after, _ = torch.cuda.mem_get_info(0)
    assert budget.source == "free GPU memory"
    assert free_after - RESERVE - 64 * MiB <= budget.nbytes <= free_before - RESERVE + 64 * MiB
    assert detect_budget("cuda:0", 40 * 2**30).source == "SEXPGPU_MEMORY"


def test_peak_tracker_reads_the_allocator():
    # what earlier tests of the process still hold counts in every peak
    held = torch.cuda.memory_allocated(0)
    tracker = PeakTracker(Device("cuda", 0))
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
    del x
    assert tracker.peak >= held + 256 * MiB
    tracker.reset()
    assert tracker.peak < held + 256 * MiB


def test_a_real_out_of_memory_is_split():
    free, _ = torch.cuda.mem_get_info(0)
    row = free // 3  # 8 rows never fit, 4 rows never fit, 2 rows do

    def fn(piece):
        buffer = torch.empty(len(piece) * row, dtype=torch.uint8, device="cuda:0")
        del buffer
        return piece * 2

    batch = torch.arange(8.0, device="cuda:0")
    state = SplitState()
    out = run_with_split(fn, batch, state, what="test")
    assert torch.equal(out, batch * 2)
    assert state.parts == 4
    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        torch.empty(4 * free, dtype=torch.uint8, device="cuda:0")
    assert is_allocation_failure(info.value)


def test_doctor_meets_the_cuda_floor(capsys, monkeypatch):
    for name in list(os.environ):
        if name.startswith("SEXPGPU_"):
            monkeypatch.delenv(name)
    assert main(["doctor", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "  ok    GPU 0 " in out and "capability" in out
    assert out.endswith("the cuda floor is met\n")
    assert np.all([" FAIL " not in line for line in out.splitlines()])


NCCL_WORKER = r"""
import json, sys
import torch
from sexpgpu.runtime.config import RuntimeConfig
from sexpgpu.runtime.nodes import GradientCarry, NodeLink

rank, port = int(sys.argv[1]), int(sys.argv[2])
config = RuntimeConfig(device="cuda", devices=(0,), nodes=2, node_rank=rank,
                       rendezvous=("127.0.0.1", port))
link = NodeLink.open(config, {"experiment": "e"}, timeout=120)
gen = torch.Generator().manual_seed(rank)
grads = [torch.randn(33, 7, generator=gen).cuda(), torch.randn(5, generator=gen).cuda()]
summed = link.sum(grads, GradientCarry())
assert all(s.device.type == "cuda" for s in summed)
link.close()
print(json.dumps([[g.cpu().tolist() for g in grads], [s.cpu().tolist() for s in summed]]))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_nodes_over_nccl_sum_like_one_node_of_two_gpus():
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", NCCL_WORKER, str(rank), str(port)],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    (g0, s0), (g1, s1) = [json.loads(out) for out, _ in outs]
    # One node of two GPUs: the DeviceGroup's all-reduce of the same gradients.
    group = DeviceGroup(["cuda:0", "cuda:1"])
    host = [[torch.tensor(x) for x in g] for g in (g0, g1)]
    one_node = group.run(
        lambda ctx: [
            t.cpu() for t in ctx.all_reduce([x.cuda(ctx.device.index) for x in host[ctx.rank]])
        ]
    )[0]
    for summed in (s0, s1):
        for got, want in zip(summed, one_node, strict=True):
            assert torch.equal(torch.tensor(got), want)
