"""DeviceGroup on simulated CPU ranks: collectives against NumPy, and aborts."""

import functools
import random
import threading
import time

import numpy as np
import pytest

from sexpgpu.runtime.config import RuntimeConfig
from sexpgpu.runtime.devices import Device
from sexpgpu.runtime.group import (
    CollectiveMismatch,
    DeviceGroup,
    GroupAborted,
    GroupTimeout,
)

SIZES = range(1, 9)


def cpu_group(size: int, timeout: float = 10.0) -> DeviceGroup:
    return DeviceGroup([f"cpu:{r}" for r in range(size)], timeout=timeout)


def wait_until(condition, seconds: float = 30.0) -> bool:
    """Poll `condition` until it holds or `seconds` pass (slow CI machines need time)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def rank_data(size: int, shape=(7, 3), dtype=np.float64, seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + size)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(size)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64])
def test_all_reduce_is_the_rank_order_sum(size, dtype):
    data = rank_data(size, (13, 5), dtype=dtype)
    reference = functools.reduce(np.add, data)
    results = cpu_group(size).run(lambda ctx: ctx.all_reduce(data[ctx.rank]))
    for result in results:
        assert result.dtype == reference.dtype
        assert np.array_equal(result, reference)  # bitwise: the same order of sums


@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter_is_each_chunk_of_the_rank_order_sum(size):
    # Rank r sends chunk c of (c + 2, 3) rows; rank c receives the sum over ranks, bitwise
    # the all-reduce's (the same order of additions).
    rng = np.random.default_rng(size)
    chunks = [[(c + 2, 3) for c in range(size)] for _ in range(size)]
    data = [[rng.standard_normal(shape).astype(np.float32) for shape in row] for row in chunks]
    results = cpu_group(size).run(lambda ctx: ctx.reduce_scatter(data[ctx.rank]))
    for c, result in enumerate(results):
        reference = functools.reduce(np.add, [data[r][c] for r in range(size)])
        assert np.array_equal(result, reference)
        assert all(result is not data[r][c] for r in range(size))  # a copy, never the input
    with pytest.raises(ValueError, match="reduce_scatter needs 2 chunks, got 1"):
        cpu_group(2).run(lambda ctx: ctx.reduce_scatter([np.zeros(1)]))


@pytest.mark.parametrize("size", SIZES)
def test_broadcast_from_every_root(size):
    data = rank_data(size, (3, 11))
    for root in range(size):
        results = cpu_group(size).run(lambda ctx, root=root: ctx.broadcast(data[ctx.rank], root))
        assert all(np.array_equal(r, data[root]) for r in results)


@pytest.mark.parametrize("size", SIZES)
def test_allgather(size):
    # Ranks hold pieces of different lengths, as an uneven split does.
    data = np.array_split(np.arange(29.0), size)
    results = cpu_group(size).run(lambda ctx: ctx.allgather(data[ctx.rank]))
    for gathered in results:
        assert len(gathered) == size
        assert np.array_equal(np.concatenate(gathered), np.arange(29.0))


@pytest.mark.parametrize("size", SIZES)
def test_gather_to_the_last_rank(size):
    data = rank_data(size, (5,))
    root = size - 1
    results = cpu_group(size).run(lambda ctx: ctx.gather(data[ctx.rank], root=root))
    assert all(r is None for r in results[:root])
    assert len(results[root]) == size
    assert all(np.array_equal(a, b) for a, b in zip(results[root], data, strict=True))


@pytest.mark.parametrize("size", SIZES)
def test_scatter_odd_chunks(size):
    whole = np.arange(3 * 17).reshape(17, 3)
    chunks = np.array_split(whole, size)
    root = size // 2

    def scatter(ctx):
        return ctx.scatter(chunks if ctx.rank == root else None, root=root)

    results = cpu_group(size).run(scatter)
    assert all(np.array_equal(r, c) for r, c in zip(results, chunks, strict=True))
    assert np.array_equal(np.concatenate(results), whole)


def test_collectives_take_trees_and_numbers():
    def step(ctx):
        grads = {"w": np.full((2, 3), ctx.rank + 1.0), "b": [np.ones(3), ctx.rank]}
        return ctx.all_reduce(grads), ctx.broadcast(("cfg", {"lr": 0.1 * ctx.rank}), root=2)

    results = cpu_group(3).run(step)
    for total, config in results:
        assert np.array_equal(total["w"], np.full((2, 3), 6.0))
        assert np.array_equal(total["b"][0], np.full(3, 3.0))
        assert total["b"][1] == 3
        assert config == ("cfg", {"lr": 0.1 * 2})


def test_results_never_alias_another_ranks_data():
    source = [np.zeros(4), np.ones(4)]

    def step(ctx):
        out = ctx.broadcast(source[ctx.rank], root=0)
        out += 10 * (ctx.rank + 1)  # each rank changes its own copy
        ctx.barrier()
        return out, ctx.allgather(source[ctx.rank])

    (b0, g0), (b1, g1) = cpu_group(2).run(step)
    assert np.array_equal(b0, np.full(4, 10.0)) and np.array_equal(b1, np.full(4, 20.0))
    assert np.array_equal(source[0], np.zeros(4))
    assert g0[1] is not g1[1] and g0[0] is not source[0]


def test_sums_do_not_depend_on_thread_timing():
    size = 6
    data = rank_data(size, (101,), np.float32, seed=3)
    reference = functools.reduce(np.add, data)

    def step(ctx, seed):
        jitter = random.Random(seed * 100 + ctx.rank)
        total = data[ctx.rank]
        for _ in range(5):
            time.sleep(jitter.random() * 0.002)
            total = ctx.all_reduce(total) / np.float32(size)
        return ctx.all_reduce(data[ctx.rank]), total

    runs = [cpu_group(size).run(lambda ctx, s=s: step(ctx, s)) for s in range(4)]
    for results in runs:
        for first, repeated in results:
            assert first.tobytes() == reference.tobytes()
            assert repeated.tobytes() == runs[0][0][1].tobytes()


def test_torch_tensors_on_simulated_ranks():
    torch = pytest.importorskip("torch")
    data = [torch.arange(5, dtype=torch.float64) * (r + 1) for r in range(3)]
    results = cpu_group(3).run(lambda ctx: ctx.all_reduce(data[ctx.rank]))
    for result in results:
        assert torch.equal(result, torch.arange(5, dtype=torch.float64) * 6)
        assert result.data_ptr() not in {d.data_ptr() for d in data}


def test_ranks_know_their_place():
    group = DeviceGroup(RuntimeConfig.from_env({"SEXPGPU_DEVICES": "0,1,2"}).local_devices)
    assert repr(group) == "DeviceGroup([cpu:0, cpu:1, cpu:2])"
    seen = group.run(lambda ctx: (ctx.rank, ctx.size, ctx.device, threading.current_thread().name))
    assert seen == [(r, 3, Device("cpu", r), f"sexpgpu-rank-{r}") for r in range(3)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one device"):
        DeviceGroup([])
    with pytest.raises(ValueError, match="needs 2 chunks, got 3 chunks"):
        cpu_group(2).run(lambda ctx: ctx.scatter([1, 2, 3] if ctx.rank == 0 else None))
    with pytest.raises(ValueError, match="root 5 is not a rank of a group of 2"):
        cpu_group(2).run(lambda ctx: ctx.broadcast(1, root=5))


class Boom(Exception):
    pass


def failing_step(where: str, bad_rank: int, seen: dict):
    """A step of three collectives where `bad_rank` raises at `where`."""

    def step(ctx):
        try:
            if where == "before" and ctx.rank == bad_rank:
                raise Boom(f"rank {ctx.rank}")
            x = ctx.all_reduce(np.ones(3))
            if where == "between" and ctx.rank == bad_rank:
                raise Boom(f"rank {ctx.rank}")
            x = ctx.broadcast(x, root=0)
            ctx.allgather(x)
            if where == "after" and ctx.rank == bad_rank:
                raise Boom(f"rank {ctx.rank}")
            ctx.barrier()
            return "done"
        except GroupAborted as err:
            seen[ctx.rank] = err
            raise

    return step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["before", "between", "after"])
@pytest.mark.parametrize("size", [2, 3, 5])
def test_a_failing_rank_aborts_the_group(where, size):
    for bad_rank in range(size):
        seen: dict = {}
        start = time.monotonic()
        with pytest.raises(Boom, match=f"rank {bad_rank}") as info:
            # A long timeout: the abort, not the timeout, must release the ranks.
            cpu_group(size, timeout=60).run(failing_step(where, bad_rank, seen))
        assert time.monotonic() - start < 20  # far below the timeout, even on a loaded machine
        assert info.value.__notes__ == [f"raised on rank {bad_rank} (cpu:{bad_rank}) of {size}"]
        assert set(seen) == set(range(size)) - {bad_rank}
        for err in seen.values():
            assert err.failed_rank == bad_rank
            assert str(err) == f"rank {bad_rank} (cpu:{bad_rank}) failed with Boom: rank {bad_rank}"


@pytest.mark.timeout(60)
def test_a_rank_busy_in_its_own_work_sees_the_abort_at_its_next_collective():
    seen = {}

    def step(ctx):
        if ctx.rank == 0:
            raise Boom("early")
        # busy in its own work, not waiting at a barrier, when rank 0 fails
        assert wait_until(lambda: ctx.aborted)
        try:
            ctx.all_reduce(1.0)
        except GroupAborted as err:
            seen[ctx.rank] = err
            raise

    with pytest.raises(Boom):
        cpu_group(3, timeout=60).run(step)
    assert sorted(seen) == [1, 2]


@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_times_out():
    def step(ctx):
        if ctx.rank == 2:
            wait_until(lambda: ctx.aborted)  # stuck in its own work, past the timeout
            return None
        ctx.all_reduce(np.zeros(2))

    start = time.monotonic()
    with pytest.raises(GroupTimeout) as info:
        # long enough for ranks 0, 1 and 3 to reach the all-reduce on a loaded machine
        cpu_group(4, timeout=2.0).run(step)
    assert info.value.missing == (2,)
    assert "in all_reduce for rank(s) 2, which never arrived" in str(info.value)
    assert time.monotonic() - start < 30


@pytest.mark.timeout(60)
def test_different_collectives_on_different_ranks():
    def step(ctx):
        return ctx.all_reduce(1) if ctx.rank == 0 else ctx.broadcast(1, root=0)

    with pytest.raises(CollectiveMismatch, match="collective 1 differs between ranks") as info:
        cpu_group(2, timeout=60).run(step)
    assert "rank 0: all_reduce(root=0), rank 1: broadcast(root=0)" in str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay_rank", [0, 1])
def test_a_rank_that_returns_early_is_a_mismatch(delay_rank):
    def step(ctx):
        ctx.barrier()
        if ctx.rank == 1:
            if delay_rank == 1:
                time.sleep(0.1)  # rank 0 waits at the barrier first
            return None
        if delay_rank == 0:
            time.sleep(0.1)  # rank 1 has returned before rank 0 arrives
        ctx.barrier()

    with pytest.raises(
        CollectiveMismatch,
        match=r"rank 1 returned after 1 collectives|"
        r"rank 0 called barrier \(collective 2\), but rank 1 returned",
    ):
        cpu_group(2, timeout=60).run(step)


@pytest.mark.timeout(60)
def test_ctx_check_raises_after_an_abort():
    checked = threading.Event()

    def step(ctx):
        if ctx.rank == 1:
            raise Boom("x")
        assert wait_until(lambda: ctx.aborted)
        with pytest.raises(GroupAborted, match="rank 1"):
            ctx.check()
        checked.set()

    with pytest.raises(Boom):
        cpu_group(2).run(step)
    assert checked.is_set()


def test_groups_run_again_after_a_failure():
    group = cpu_group(3)
    with pytest.raises(Boom):
        group.run(failing_step("between", 1, {}))
    assert group.run(lambda ctx: ctx.all_reduce(ctx.rank)) == [3, 3, 3]


def test_all_reduce_promotes_and_broadcasts_as_numpy_does():
    data = [
        np.ones((1, 3), np.float32),
        np.full((2, 3), 0.1, np.float64),
        np.arange(3, dtype=np.int64),
    ]
    reference = functools.reduce(np.add, data)
    results = cpu_group(3).run(lambda ctx: ctx.all_reduce(data[ctx.rank]))
    for result in results:
        assert result.dtype == np.float64 and result.tobytes() == reference.tobytes()
    assert np.array_equal(data[0], np.ones((1, 3)))  # inputs are never written


@pytest.mark.timeout(60)
def test_a_failure_inside_a_collective_aborts_the_group():
    seen = {}

    def step(ctx):
        shape = (3,) if ctx.rank != 2 else (4,)  # rank 0's sum fails on rank 2's part
        try:
            return ctx.all_reduce(np.ones(shape))
        except GroupAborted as err:
            seen[ctx.rank] = err.failed_rank
            raise

    with pytest.raises(ValueError, match="broadcast") as info:
        cpu_group(4, timeout=60).run(step)
    assert info.value.__notes__ == ["raised on rank 0 (cpu:0) of 4"]
    assert seen == {1: 0, 2: 0, 3: 0}


def test_share_hands_every_rank_the_others_values_themselves():
    data = [np.arange(3) + r for r in range(3)]

    def step(ctx):
        everyone = ctx.share(data[ctx.rank])
        if ctx.rank == 0:  # one thread works on every rank's array, as NCCL does
            for x in everyone:
                x *= 10
        ctx.barrier()
        return [x is data[r] for r, x in enumerate(everyone)]

    assert cpu_group(3).run(step) == [[True] * 3] * 3
    assert [list(x) for x in data] == [[0, 10, 20], [10, 20, 30], [20, 30, 40]]
