"""Retry and split under injected allocation failures."""

import weakref

import numpy as np
import pytest

from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.oom import (
    FailureInjector,
    SimulatedAllocationFailure,
    SplitState,
    add_up,
    call_with_retry,
    call_with_split,
    concat,
    is_allocation_failure,
    run_with_split,
)


class Releases:
    """Counts cache releases instead of calling the real one."""

    def __init__(self):
        self.count = 0

    def __call__(self):
        self.count += 1


def test_injector_fails_the_chosen_calls():
    inject = FailureInjector(calls=[2, 4])
    outcomes = []
    for _ in range(5):
        try:
            inject.check()
            outcomes.append("ok")
        except SimulatedAllocationFailure as err:
            outcomes.append(str(err))
    assert outcomes == [
        "ok",
        "simulated allocation failure (call 2)",
        "ok",
        "simulated allocation failure (call 4)",
        "ok",
    ]
    assert (inject.count, inject.failures) == (5, 2)


def test_injector_fails_large_sizes():
    inject = FailureInjector(larger_than=8)
    inject.check(8)
    with pytest.raises(SimulatedAllocationFailure, match=r"call 2, size 9"):
        inject.check(9)


def test_allocation_failures_are_recognised_alike():
    torch = pytest.importorskip("torch")
    assert is_allocation_failure(SimulatedAllocationFailure("x"))
    assert is_allocation_failure(MemoryError())
    assert is_allocation_failure(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert is_allocation_failure(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling ..."))
    assert not is_allocation_failure(RuntimeError("shape mismatch"))
    assert not is_allocation_failure(ValueError("out of range"))


def square_rows(inject):
    def fn(piece):
        inject.check(len(piece))
        return piece**2

    return fn


def test_no_failure_no_split():
    batch = np.arange(10.0)
    state = SplitState()
    releases = Releases()
    out = run_with_split(square_rows(FailureInjector()), batch, state, release=releases)
    assert np.array_equal(out, batch**2)
    assert (state.parts, state.events, releases.count) == (1, [], 0)


def test_one_failure_is_retried_after_releasing_the_caches():
    batch = np.arange(10.0)
    state = SplitState()
    releases = Releases()
    inject = FailureInjector(calls=[1])
    out = run_with_split(square_rows(inject), batch, state, what="step", release=releases)
    assert np.array_equal(out, batch**2)
    assert state.parts == 1 and releases.count == 1 and inject.count == 2
    assert state.events == [
        "memory: allocation failed in step of 10 rows (simulated allocation failure "
        "(call 1, size 10)); released the caches and retried"
    ]


def test_the_batch_is_split_in_halves_until_it_fits_and_the_split_is_kept():
    batch = np.arange(13.0)
    state = SplitState()
    releases = Releases()
    inject = FailureInjector(larger_than=4)  # more than 4 rows never fit
    out = run_with_split(square_rows(inject), batch, state, what="sweep", release=releases)
    assert np.array_equal(out, batch**2)
    assert state.parts == 4  # pieces of at most ceil(13 / 4) = 4 rows
    assert state.events[1:] == [
        "memory: allocation failed in sweep of 13 rows; splitting it into 2 pieces of at "
        "most 7 rows",
        "memory: allocation failed in sweep of 7 rows; splitting it into 4 pieces of at "
        "most 4 rows",
    ]
    # The next call starts with the remembered split and fails no more.
    failures = inject.failures
    out = run_with_split(square_rows(inject), batch * 2, state, release=releases)
    assert np.array_equal(out, (batch * 2) ** 2)
    assert inject.failures == failures and state.parts == 4


def test_sums_and_trees():
    x = np.arange(12.0).reshape(6, 2)
    y = np.arange(6.0)
    state = SplitState(parts=3)

    def fn(piece):
        xs, ys = piece
        return {"grad": xs.T @ ys, "count": len(ys)}

    out = run_with_split(fn, (x, y), state, add_up)
    assert np.allclose(out["grad"], x.T @ y) and out["count"] == 6


def test_torch_pieces_are_concatenated():
    torch = pytest.importorskip("torch")
    batch = torch.arange(9.0)
    state = SplitState(parts=2)
    assert torch.equal(run_with_split(lambda p: p + 1, batch, state, concat), batch + 1)


def test_one_row_that_does_not_fit_is_e_mem_001():
    state = SplitState()
    inject = FailureInjector(larger_than=0)
    with pytest.raises(SexpgpuError) as info:
        run_with_split(
            square_rows(inject), np.arange(4.0), state, what="kernel", release=Releases()
        )
    err = info.value
    assert err.code == "E-MEM-001"
    assert err.message == (
        "allocation failed in kernel even for one row at a time: simulated allocation "
        "failure (call 4, size 1)"
    )
    assert err.location == "kernel"
    assert isinstance(err.__cause__, SimulatedAllocationFailure)
    assert state.parts == 4


def test_other_errors_pass_through():
    def fn(piece):
        raise KeyError("not memory")

    with pytest.raises(KeyError):
        run_with_split(fn, np.arange(3), SplitState(), release=Releases())


def test_empty_batch():
    out = run_with_split(lambda p: p * 2, np.zeros((0, 3)), SplitState())
    assert out.shape == (0, 3)


def test_call_with_retry():
    inject = FailureInjector(calls=[1])
    state = SplitState()
    releases = Releases()

    def fn():
        inject.check()
        return 42

    assert call_with_retry(fn, state, what="init", release=releases) == 42
    assert releases.count == 1
    assert state.events == [
        "memory: allocation failed in init (simulated allocation failure (call 1)); "
        "released the caches and retried"
    ]
    always = FailureInjector(calls=[1, 2])
    with pytest.raises(SimulatedAllocationFailure):
        call_with_retry(always.check, release=releases)


def test_real_release_runs_without_a_gpu():
    out = run_with_split(square_rows(FailureInjector(calls=[1])), np.arange(3.0), SplitState())
    assert np.array_equal(out, np.arange(3.0) ** 2)


class Block:
    """Stands for an array a failed call allocated (NumPy's arrays take no weak references)."""


@pytest.mark.parametrize("how", ["split", "retry", "rows"])
def test_what_a_failed_call_allocated_is_free_when_the_caches_are_released(how):
    # The failure's traceback holds the failed call's frames, and they its arrays:
    # a release while they are held frees nothing (a GPU's whole activations).
    held, alive_at_release = [], []

    def fn(*_):
        block = Block()
        held.append(weakref.ref(block))
        if len(held) == 1:
            raise SimulatedAllocationFailure("simulated allocation failure")
        return np.zeros(1)

    def release():
        alive_at_release.append(held[0]() is not None)

    if how == "split":
        call_with_split(fn, SplitState(), what="step", can_split=lambda _: True, release=release)
    elif how == "retry":
        call_with_retry(fn, release=release)
    else:
        run_with_split(fn, np.arange(4.0), SplitState(), release=release)
    assert alive_at_release == [False]
