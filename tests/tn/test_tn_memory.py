"""Budgets, tiers, the plan log, out-of-memory recovery, output sinks, large inputs."""

from __future__ import annotations

import functools
import logging

import h5py
import numpy as np
import pytest
from tn_helpers import dense_stack, make_stack, rel_error, run_src

from sexpgpu.runtime.oom import FailureInjector
from sexpgpu.tn import Resources, src
from sexpgpu.tn.plan import minimum_budgets
from sexpgpu.tn.sketch import work_dtype
from sexpgpu.tn.trains import normalize_stack
from sexpgpu.tn.trim import prepare


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


_run = functools.partial(run_src, seed=1)


def _least(stack, size, ranks=1):
    st = normalize_stack(stack, "src", [f"t{i}" for i in range(len(stack))])
    work = work_dtype(st.dtype, st.dtype)
    return sum(minimum_budgets(prepare(st, work), size, work, ranks))  # as a CPU sweep runs it


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("shape", ["OS", "OO", "SOO"])
def test_tiny_and_large_budgets_give_the_same_bits(tmp_path, caplog, shape, backend):
    stack = make_stack(shape, 8, np.random.default_rng(3), np.complex128, chi=8, bond=3)
    large = _run(stack, 6, backend=backend, resources=Resources(host_memory="8GiB"))
    tiny = Resources(host_memory=_least(stack, 6), scratch_dir=tmp_path / "scratch")
    with caplog.at_level(logging.DEBUG, logger="sexpgpu.tn"):
        small = _run(stack, 6, backend=backend, resources=tiny)
    assert "Z recomputed" in caplog.text
    assert "environments: disk" in caplog.text
    assert "SRC peaks, rank 0" in caplog.text
    assert list((tmp_path / "scratch").iterdir()) == []  # scratch files removed
    _same(large, small)
    assert rel_error(small, dense_stack(stack)) < 1.0


def test_a_budget_below_the_working_set_is_refused_saying_by_how_much():
    stack = make_stack("OS", 6, np.random.default_rng(0), chi=8, bond=3)
    with pytest.raises(
        MemoryError, match=r"host_memory budget is 1000 B.*exceeds the budget by"
    ) as info:
        src(*stack, chi_out=4, seed=0, resources=Resources(host_memory="1kB"))
    assert "1000 B" in str(info.value)
    least = _least(stack, 4)
    with pytest.raises(MemoryError, match=r"by 1 B \(1 B\)"):
        src(*stack, chi_out=4, seed=0, resources=Resources(host_memory=least - 1))
    src(*stack, chi_out=4, seed=0, resources=Resources(host_memory=least))


def test_budget_left_over_keeps_environments_in_memory(caplog):
    stack = make_stack("OOS", 6, np.random.default_rng(4), chi=8, bond=2)
    with caplog.at_level(logging.DEBUG, logger="sexpgpu.tn"):
        src(*stack, chi_out=5, seed=0, resources=Resources(host_memory="1GiB"))
    assert "Z held" in caplog.text
    assert "environments: host" in caplog.text and "disk" not in caplog.text


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_injected_allocation_failures_split_the_batch_and_keep_the_split(caplog, backend):
    stack = make_stack("OS", 7, np.random.default_rng(6), chi=8, bond=3)
    whole = _run(stack, 5, backend=backend)
    inject = FailureInjector(larger_than=2)  # any piece of more than 2 rows fails
    with caplog.at_level(logging.DEBUG):
        halved = _run(stack, 5, backend=backend, inject=inject)
    assert inject.failures > 0
    text = caplog.text
    assert "released the caches and retried" in text
    assert "splitting it into 2 pieces of at most 3 rows" in text
    assert "splitting it into 4 pieces of at most 2 rows" in text
    # the split is kept: the sites after the first fail no more
    assert "site 0's left-to-right product of 5 rows" in text
    assert not any(f"site {j}'s left-to-right" in text for j in range(1, 6))
    assert "SRC rank 0: memory: allocation failed" in text
    for a, b in zip(whole, halved, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_torch_out_of_memory_error_is_recovered_like_memory_error(monkeypatch):
    import torch

    import sexpgpu.tn.sweep as sweep_module

    stack = make_stack("OS", 6, np.random.default_rng(6), chi=8, bond=3)
    whole = _run(stack, 5, backend="torch")
    real = sweep_module.env_step
    calls = {"failed": 0}

    def fragile(xp, env, omega, cores):
        if env.shape[0] > 2:
            calls["failed"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(xp, env, omega, cores)

    monkeypatch.setattr(sweep_module, "env_step", fragile)
    halved = _run(stack, 5, backend="torch")
    assert calls["failed"] >= 2
    for a, b in zip(whole, halved, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_one_row_that_still_fails_is_e_mem_001():
    from sexpgpu.errors import SexpgpuError

    stack = make_stack("OS", 5, np.random.default_rng(1), chi=6, bond=2)
    with pytest.raises(SexpgpuError, match="E-MEM-001"):
        _run(stack, 4, inject=FailureInjector(larger_than=0))


@pytest.mark.parametrize("oversample", [1.0, 2.0])
def test_output_sinks_receive_the_same_cores(tmp_path, oversample):
    stack = make_stack("OOS", 6, np.random.default_rng(9), np.complex128, chi=6, bond=2)
    reference = src(*stack, chi_out=4, seed=2, oversample=oversample)
    res = Resources(scratch_dir=tmp_path / "scratch")
    on_disk = src(
        *stack, chi_out=4, seed=2, oversample=oversample, out=tmp_path / "npy", resources=res
    )
    assert all(isinstance(c, np.memmap) for c in on_disk)
    _same(reference, on_disk)
    with h5py.File(tmp_path / "out.h5", "w") as f:
        _same(
            reference,
            [
                d[...]
                for d in src(
                    *stack, chi_out=4, seed=2, oversample=oversample, out=f.create_group("psi")
                )
            ],
        )
    zarr = pytest.importorskip("zarr")  # the tn-io extra; a GPU machine may lack it
    group = zarr.open_group(str(tmp_path / "out.zarr"), mode="w")
    got = src(*stack, chi_out=4, seed=2, oversample=oversample, out=group)
    _same(reference, [d[...] for d in got])
    scratch = tmp_path / "scratch"  # used by the truncation pass, then emptied
    assert not scratch.exists() or list(scratch.iterdir()) == []


def test_out_must_be_a_group_or_a_path():
    stack = make_stack("OS", 4, np.random.default_rng(0))
    with pytest.raises(TypeError, match="out must be an HDF5 or zarr group"):
        src(*stack, chi_out=2, out=[])


def test_large_in_memory_inputs_warn_and_name_the_lazy_alternatives(caplog):
    # long enough that the inputs outweigh half of one site's working set
    stack = make_stack("OS", 24, np.random.default_rng(2), chi=8, bond=3)
    with caplog.at_level(logging.WARNING, logger="sexpgpu.tn"):
        src(*stack, chi_out=4, seed=0, resources=Resources(host_memory=_least(stack, 4)))
    assert "np.memmap" in caplog.text and "h5py or zarr" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sexpgpu.tn"):
        src(*stack, chi_out=4, seed=0)
    assert caplog.text == ""
