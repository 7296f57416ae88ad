"""What the host does between the passes: cores kept on the device, the core writer, staging."""

from __future__ import annotations

import functools
import logging
import re

import numpy as np
import pytest
from tn_helpers import make_stack, run_src

import sexpgpu.tn.engine as engine
import sexpgpu.tn.sweep as sweep
from sexpgpu.runtime.devices import Device
from sexpgpu.tn import Resources
from sexpgpu.tn.backend import TorchBackend, copy_parallel
from sexpgpu.tn.feed import _settle, read_site
from sexpgpu.tn.plan import Budgets, make_plan, minimum_budgets
from sexpgpu.tn.sink import CoreWriter, DatasetSink, MemorySink
from sexpgpu.tn.sketch import work_dtype
from sexpgpu.tn.trains import normalize_stack

_run = functools.partial(run_src, seed=2)
N, CHI = 7, 6


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _budgets(device: int) -> Budgets:
    """A GPU's budgets: device memory apart from the host's."""
    return Budgets(device, 8 << 30, "gpu_memory", "host_memory", "Resources", shared=False)


class Counted:
    """An array-like site that counts its reads."""

    def __init__(self, data: np.ndarray, key: tuple[int, int], reads: list) -> None:
        self._data, self._key, self._reads = data, key, reads
        self.shape, self.dtype = data.shape, data.dtype

    def __array__(self, dtype=None, copy=None):
        self._reads.append(self._key)
        return self._data.copy() if dtype is None else self._data.astype(dtype)


def _stack_and_budgets(ranks: int = 1):
    stack = make_stack("OS", N, np.random.default_rng(4), np.complex128, chi=CHI, bond=3)
    st = normalize_stack(stack, "src", ["t0", "t1"])
    work = work_dtype(st.dtype, st.dtype)
    lean, _host = minimum_budgets(st, CHI, work, ranks)
    large = make_plan(st, CHI, work, ranks, _budgets(1 << 40))
    assert large.resident == frozenset(range(N - 1))  # every site of the first pass
    # the smallest budget that keeps every core, less half of them
    lo, hi = lean, 1 << 40
    while hi - lo > 1:
        mid = (lo + hi) // 2
        everything = len(make_plan(st, CHI, work, ranks, _budgets(mid)).resident) == N - 1
        lo, hi = (lo, mid) if everything else (mid, hi)
    middle = hi - large.resident_bytes // 2
    return stack, st, work, {"tiny": lean, "middle": middle, "large": 1 << 40}


@pytest.mark.parametrize("ranks", [None, 2])
def test_cores_kept_between_the_passes_by_budget_give_the_same_bits(monkeypatch, caplog, ranks):
    stack, st, work, budgets = _stack_and_budgets(ranks or 1)
    results, kept = {}, {}
    for name, device in budgets.items():
        plan = make_plan(st, CHI, work, ranks or 1, _budgets(device))
        kept[name] = plan.resident
        monkeypatch.setattr(engine, "budgets_for", lambda *_a, d=device: _budgets(d))
        reads: list = []
        lazy = [[Counted(s, (i, j), reads) for j, s in enumerate(t)] for i, t in enumerate(stack)]
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="sexpgpu.tn"):
            results[name] = _run(lazy, CHI, backend="torch", resources=Resources(devices=ranks))
        line = re.search(r"input cores kept between the passes: (\d+) sites", caplog.text)
        assert line and int(line.group(1)) == len(plan.resident)
        # every site once left to right; right to left only those not kept
        again = sorted({j for _i, j in reads[len(reads) - 2 * (N - len(plan.resident)) :]})
        assert sorted(reads) == sorted(
            [(i, j) for i in range(2) for j in range(N - 1)]
            + [(i, j) for i in range(2) for j in range(N) if j not in plan.resident]
        )
        assert again == [j for j in range(N) if j not in plan.resident]
    assert kept["tiny"] == frozenset()
    assert 0 < len(kept["middle"]) < N - 1
    assert kept["large"] == frozenset(range(N - 1))
    _same(results["tiny"], results["large"])
    _same(results["middle"], results["large"])


def test_a_host_backend_keeps_no_cores():
    _stack, st, work, _b = _stack_and_budgets()
    shared = Budgets(1 << 40, 1 << 40, "host_memory", "host_memory", "Resources", shared=True)
    plan = make_plan(st, CHI, work, 1, shared)
    assert plan.resident == frozenset() and plan.resident_bytes == 0


def test_the_writer_copies_a_staged_core_out_of_its_reused_buffer():
    sink = MemorySink()
    buffer = np.zeros((2, 3))
    with CoreWriter(sink, staged=True) as writer:
        for j in range(3):
            buffer[...] = j  # one page-locked buffer reused for every core
            writer.put(j, lambda: buffer)
            writer._drain()  # the test reuses the buffer at once: let the write finish
    for j in range(3):
        core = sink.get(j)
        assert core is not buffer
        np.testing.assert_array_equal(core, np.full((2, 3), j))


def test_the_writer_hands_views_to_a_sink_that_writes_them_out(tmp_path):
    sink = DatasetSink(tmp_path / "out", 3, "mps")
    cores = [np.full((1 if j == 0 else 2, 1 if j == 2 else 2, 2, 1), float(j)) for j in range(3)]
    with CoreWriter(sink, staged=True) as writer:
        for j, core in enumerate(cores):
            writer.put(j, lambda core=core: core)
    for j, written in enumerate(sink.result()):
        assert np.all(written == j)


def test_a_failing_write_raises_in_the_sweep():
    class Broken(MemorySink):
        def put(self, j, core):
            raise OSError(f"disk full at core {j}")

    writer = CoreWriter(Broken(), staged=False)
    with pytest.raises(OSError, match="disk full at core 0"), writer:
        writer.put(0, lambda: np.zeros(1))
        writer.put(1, lambda: np.zeros(1))  # waits for core 0, which failed


def test_the_staging_copy_copies_in_slices():
    src = np.random.default_rng(0).standard_normal(3 << 20)  # 24 MiB: three threads' slices
    dst = np.empty_like(src)
    copy_parallel(dst, src)
    np.testing.assert_array_equal(dst, src)


def _bad_stack(site: int, bad: float):
    stack = make_stack("OS", N, np.random.default_rng(4), np.complex128, chi=CHI, bond=3)
    stack[0][site].flat[3] = bad
    return stack


@pytest.mark.parametrize("site", [2, N - 1], ids=["left-to-right", "last-right-to-left"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_site_checked_on_the_device_raises_the_host_error(monkeypatch, bad, site):
    with pytest.raises(ValueError) as on_host:
        _run(_bad_stack(site, bad), CHI)
    assert str(on_host.value) == (
        f"src: trains[0] (train 0, site {site}) holds 1 NaN or infinite value(s); the result "
        "would be NaN. Check the input (a failed earlier step, an overflow)."
    )
    steps = []  # right-to-left sites computed
    rtl_step = sweep._rtl_step
    monkeypatch.setattr(sweep, "_rtl_step", lambda *a: steps.append(a[5]) or rtl_step(*a))
    reads: list = []
    stack = _bad_stack(site, bad)
    lazy = [[Counted(s, (i, j), reads) for j, s in enumerate(t)] for i, t in enumerate(stack)]
    with pytest.raises(ValueError) as on_device:
        _run(lazy, CHI, backend="torch")
    assert str(on_device.value) == str(on_host.value)
    first_pass = [(i, j) for j in range(N - 1) for i in range(2)]
    if site < N - 1:
        # checked once, after the pass, which ran to its end: then the bad site read again
        assert reads == [*first_pass, (0, site)] and steps == []
    else:
        # the first site of the right-to-left pass: checked before it is computed (the
        # next site may be read meanwhile)
        rest = reads[len(first_pass) :]
        assert reads[: len(first_pass)] == first_pass and steps == []
        assert rest.count((0, site)) == 2 and rest.count((1, site)) == 1


def test_the_device_check_reads_the_sums_once_and_lets_an_overflow_pass():
    big = np.full((4, 2), 1e308)  # the sum overflows; every entry is finite
    nan = np.ones((4, 4, 2))
    nan[1, 2, 0] = np.nan
    st = normalize_stack([[big, np.ones((4, 4, 2)), nan, np.ones((4, 2))]], "src", ["t0"])
    xp = TorchBackend(Device("cpu", 0))
    unread = []
    for j in range(4):
        (core,) = read_site(st, j, np.dtype(np.float64), check=False)
        _tensor, token, total = xp.upload_async(core, check=True)
        assert token is None and total.shape == ()
        unread.append((j, total))
        assert xp.upload_async(core)[2] is None  # unchecked
    assert xp.finite([t for _j, t in unread]) == [False, True, False, True]
    _settle(xp, st, unread[:2])  # site 0 is read again with the full check, and passes
    with pytest.raises(ValueError, match=r"t0 \(train 0, site 2\) holds 1 NaN"):
        _settle(xp, st, unread)
    assert unread == []
