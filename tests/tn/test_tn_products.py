"""Complex products by the 3M method: the product, the backend's choice, the sweep, the plan."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import torch
from tn_helpers import EXACT_TOL, dense_stack, make_stack, rel_error, run_src

import sexpgpu.tn.engine as engine
import sexpgpu.tn.products as products
from sexpgpu.runtime.devices import Device
from sexpgpu.tn import Resources, src
from sexpgpu.tn.backend import NumpyBackend, TorchBackend
from sexpgpu.tn.plan import Budgets, make_plan, minimum_budgets
from sexpgpu.tn.products import matmul_3m, three_m_pays
from sexpgpu.tn.sketch import work_dtype
from sexpgpu.tn.trains import normalize_stack

COMPLEX = [np.complex64, np.complex128]
# ||3M - exact||_F / (||A||_F ||B||_F): rounding is about sqrt(k) u; a wrong sign
# or term is of order 1.
TOL = {np.complex64: 1e-6, np.complex128: 1e-15}
CLOSE = {np.complex64: 2e-4, np.complex128: 1e-10}

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
_run = functools.partial(run_src, seed=5)


def ids(dtype):
    return np.dtype(dtype).name


def _draw(rng, shape, dtype):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def _layouts(a, b):
    """The operand layouts the sweep hands a product: plain, transposed, adjoint views."""
    yield "plain", a, b
    yield "a transposed", a.mT.contiguous().mT, b
    yield "b transposed", a, b.mT.contiguous().mT
    yield "a an adjoint view", a.mH.contiguous().mH, b  # conjugate bit set
    yield "b sliced", a[:, :-1], b[:-1]


def _error(got, a, b):
    exact = np.asarray(a, np.complex128) @ np.asarray(b, np.complex128)
    scale = np.linalg.norm(a) * np.linalg.norm(b)
    return np.linalg.norm(got.numpy().astype(np.complex128) - exact) / scale


def _reference(a, b):
    return a.resolve_conj().numpy(), b.resolve_conj().numpy()


@pytest.mark.parametrize("dtype", COMPLEX, ids=ids)
def test_3m_matches_the_complex_product(dtype):
    rng = np.random.default_rng(0)
    a = torch.from_numpy(_draw(rng, (67, 150), dtype))
    b = torch.from_numpy(_draw(rng, (150, 41), dtype))
    for name, x, y in _layouts(a, b):
        got = matmul_3m(x, y)
        assert got.dtype == x.dtype and got.shape == (x.shape[0], y.shape[1]), name
        assert _error(got, *_reference(x, y)) < TOL[dtype], name
        plain = _error(torch.mm(x, y), *_reference(x, y))
        assert _error(got, *_reference(x, y)) < 10 * plain + TOL[dtype] / 10, name


@pytest.mark.parametrize("dtype", COMPLEX, ids=ids)
def test_3m_keeps_real_and_imaginary_parts_apart(dtype):
    # Real times imaginary is purely imaginary, imaginary times imaginary real:
    # each part of the result comes from other terms of the method.
    rng = np.random.default_rng(1)
    real = torch.from_numpy(rng.standard_normal((30, 20)).astype(dtype))
    imag = torch.from_numpy((1j * rng.standard_normal((20, 10))).astype(dtype))
    for a, b in ((real, imag), (imag.mT.contiguous(), imag), (real, real.mT.contiguous())):
        got = matmul_3m(a, b)
        assert _error(got, a.numpy(), b.numpy()) < TOL[dtype]


@pytest.mark.parametrize("dtype", COMPLEX, ids=ids)
def test_3m_batched_matches_the_batched_product(dtype):
    rng = np.random.default_rng(2)
    a = torch.from_numpy(_draw(rng, (5, 12, 33), dtype))
    b = torch.from_numpy(_draw(rng, (5, 33, 7), dtype))
    for x in (a, a.permute(0, 2, 1).contiguous().permute(0, 2, 1)):
        got = matmul_3m(x, b)
        exact = np.matmul(x.numpy().astype(np.complex128), b.numpy().astype(np.complex128))
        scale = np.linalg.norm(x.numpy()) * np.linalg.norm(b.numpy())
        assert np.linalg.norm(got.numpy() - exact) / scale < TOL[dtype]


def test_3m_pays_only_where_it_measured_faster():
    # H200, chi=1000 (sexpgpu/tn/products.py): 1.11x at 4000x4000x1000 in complex64
    assert three_m_pays(4000, 4000, 1000, itemsize=8)
    assert three_m_pays(8192, 8192, 2048, itemsize=16)
    # 1.05x in complex128, within noise; 0.86x at the sweep's tiles of Z
    assert not three_m_pays(4000, 4000, 1000, itemsize=16)
    assert not three_m_pays(1396, 1000, 4000, itemsize=8)
    # memory bound: the planes would cost more than the flops saved
    assert not three_m_pays(4000, 4000, 16, itemsize=8)
    assert not three_m_pays(100, 100, 100, itemsize=8)
    assert not three_m_pays(1, 4000, 4000, batch=1000, itemsize=8)


def test_the_backend_chooses_by_mode_dtype_and_device(monkeypatch):
    rng = np.random.default_rng(3)
    a = torch.from_numpy(_draw(rng, (40, 30), np.complex64))
    b = torch.from_numpy(_draw(rng, (30, 20), np.complex64))
    xp = TorchBackend(Device("cpu", 0))
    assert xp.three_m == "auto" and not xp.splits_products(np.dtype(np.complex64))
    assert torch.equal(xp.dot(a, b), torch.mm(a, b))  # auto: a GPU's choice only
    monkeypatch.setattr(products, "THREE_M", "always")
    forced = TorchBackend(Device("cpu", 0))
    assert forced.splits_products(np.dtype(np.complex128))
    assert not forced.splits_products(np.dtype(np.float32))
    assert torch.equal(forced.dot(a, b), matmul_3m(a, b))
    assert not torch.equal(forced.dot(a, b), torch.mm(a, b))  # it did take the other path
    batched = a[None].expand(3, -1, -1)
    by_batch = forced.matmul(batched, b[None].expand(3, -1, -1))[1]
    torch.testing.assert_close(by_batch, matmul_3m(a, b), rtol=1e-6, atol=1e-6)
    real = a.real.contiguous()
    assert torch.equal(forced.dot(real, b.real.contiguous()), real @ b.real)
    forced.three_m = "never"  # a backend can be switched alone
    assert torch.equal(forced.dot(a, b), torch.mm(a, b))
    assert not NumpyBackend().splits_products(np.dtype(np.complex64))


def _count_3m(monkeypatch):
    calls = []
    real = products.matmul_3m

    def counted(a, b):
        calls.append(tuple(a.shape))
        return real(a, b)

    monkeypatch.setattr(products, "matmul_3m", counted)
    return calls


@pytest.mark.parametrize("dtype", COMPLEX, ids=ids)
@pytest.mark.parametrize("shape", ["OS", "OO", "SOO"])
def test_the_sweep_by_3m_matches_the_exact_product(monkeypatch, shape, dtype):
    stack = make_stack(shape, 7, np.random.default_rng(6), dtype, chi=8, bond=3)
    target = dense_stack(stack)
    plain_exact = _run(stack, 64, backend="torch")
    plain = _run(stack, 5, backend="torch", oversample=1.4)
    calls = _count_3m(monkeypatch)
    monkeypatch.setattr(products, "THREE_M", "always")
    exact = _run(stack, 64, backend="torch")
    assert len(calls) > 10  # every complex product of the sweep took the 3M path
    assert rel_error(exact, target) < EXACT_TOL[dtype]
    assert rel_error(plain_exact, target) < EXACT_TOL[dtype]
    compressed = _run(stack, 5, backend="torch", oversample=1.4)
    norm = np.sqrt(sum(np.vdot(y, y).real for y in plain))
    for x, y in zip(compressed, plain, strict=True):
        assert x.shape == y.shape
        assert np.linalg.norm(x - y) <= CLOSE[dtype] * max(1.0, norm)


def test_the_plan_counts_the_3m_planes(monkeypatch, caplog, tmp_path):
    stack = make_stack("OS", 8, np.random.default_rng(3), np.complex128, chi=8, bond=3)
    st = normalize_stack(stack, "src", ["t0", "t1"])
    work = work_dtype(st.dtype, st.dtype)
    budgets = Budgets(1 << 40, 8 << 30, "gpu_memory", "host_memory", "Resources", shared=False)
    plain = make_plan(st, 6, work, 1, budgets)
    split = make_plan(st, 6, work, 1, budgets, three_m=True)
    assert split.work_device > plain.work_device
    assert sum(minimum_budgets(st, 6, work, three_m=True)) > sum(minimum_budgets(st, 6, work))
    monkeypatch.setattr(products, "THREE_M", "always")
    large = _run(stack, 6, backend="torch", resources=Resources(host_memory="8GiB"))
    least = sum(minimum_budgets(st, 6, work, three_m=True))
    with pytest.raises(MemoryError, match="host_memory budget"):
        _run(stack, 6, backend="torch", resources=Resources(host_memory=least - 1))
    tiny = Resources(host_memory=least, scratch_dir=tmp_path / "scratch")
    with caplog.at_level(logging.DEBUG, logger="sexpgpu.tn"):
        small = _run(stack, 6, backend="torch", resources=tiny)
    assert "complex products by 3M: counted" in caplog.text and "Z recomputed" in caplog.text
    for x, y in zip(small, large, strict=True):  # the same products whatever the budget
        np.testing.assert_array_equal(x, y)


def test_one_device_in_a_group_gives_the_same_bits_by_3m(monkeypatch):
    monkeypatch.setattr(products, "THREE_M", "always")
    stack = make_stack("OOS", 7, np.random.default_rng(9), np.complex64, chi=8, bond=2)
    solo = _run(stack, 5, backend="torch")
    group = _run(stack, 5, backend="torch", resources=Resources(devices=1))
    for x, y in zip(group, solo, strict=True):
        np.testing.assert_array_equal(x, y)
    many = _run(stack, 5, backend="torch", resources=Resources(devices=3))
    exact = _run(stack, 64, backend="torch", resources=Resources(devices=3))
    assert rel_error(exact, dense_stack(stack)) < EXACT_TOL[np.complex64]
    assert [x.shape for x in many] == [x.shape for x in solo]


# ----- on a GPU (python -m pytest -m gpu tests/tn) ------------------------------------------


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", COMPLEX, ids=ids)
def test_gpu_3m_is_chosen_for_a_wide_product_and_holds_its_planned_memory(dtype):
    xp = TorchBackend(Device("cuda", torch.cuda.current_device()))
    gen = torch.Generator("cuda").manual_seed(0)
    tdt = {np.complex64: torch.complex64, np.complex128: torch.complex128}[dtype]
    a = torch.randn(8192, 8192, dtype=tdt, device="cuda", generator=gen)
    b = torch.randn(8192, 2048, dtype=tdt, device="cuda", generator=gen)
    assert xp._by_three_m(a, b)
    assert not xp._by_three_m(a, b[:, :16])  # memory bound: one complex GEMM
    exact = a.to(torch.complex128) @ b.to(torch.complex128)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = xp.dot(a, b)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - got.numel() * got.element_size()
    operands = (a.numel() + b.numel() + got.numel()) * a.element_size()
    assert extra <= operands + (64 << 20)  # the planes, and cuBLAS's workspace
    scale = torch.linalg.norm(a) * torch.linalg.norm(b)
    assert torch.linalg.norm(got.to(torch.complex128) - exact) / scale < TOL[dtype]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", COMPLEX, ids=ids)
def test_gpu_sweep_by_3m_matches_and_stays_in_its_plan(monkeypatch, dtype):
    stack = make_stack("OOS", 8, np.random.default_rng(12), dtype, chi=16, bond=3)
    plain = src(*stack, chi_out=10, seed=3, device="gpu")
    seen = []
    log_peaks = engine._log_peaks

    def record(plan, reports):
        seen.append((plan, reports))
        log_peaks(plan, reports)

    monkeypatch.setattr(engine, "_log_peaks", record)
    monkeypatch.setattr(products, "THREE_M", "always")
    split = src(*stack, chi_out=10, seed=3, device="gpu")
    exact = src(*stack, chi_out=512, seed=3, device="gpu")
    assert rel_error(exact, dense_stack(stack)) < EXACT_TOL[dtype]
    norm = np.sqrt(sum(np.vdot(y, y).real for y in plain))
    for x, y in zip(split, plain, strict=True):
        assert np.linalg.norm(x - y) <= CLOSE[dtype] * max(1.0, norm)
    for plan, reports in seen:
        assert plan.three_m
        for report in reports:
            planned = plan.work_device + report.store_peak.get("device", 0) + plan.resident_bytes
            assert report.device_peak <= planned + (64 << 20)  # cuBLAS's workspace
