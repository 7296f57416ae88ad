"""Complex products by three real GEMMs (torch backend, on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tn_helpers import dense_stack, make_stack, rel_error, run_src

import sexpgpu.tn.gauss as gauss
from sexpgpu.runtime.devices import Device
from sexpgpu.tn.backend import TorchBackend

# ||gauss_mm(a, b) - a b||_F / (||a||_F ||b||_F) a dtype's product may show.
TOL = {torch.complex64: 1e-6, torch.complex128: 1e-14}
ROUNDING = {np.complex64: 1e-5, np.complex128: 1e-13}


def _operand(rows, cols, dtype, layout, gen):
    """A ``(rows, cols)`` complex tensor, C-contiguous, transposed, conjugated or strided."""
    if layout == "transposed":
        return torch.randn(cols, rows, dtype=dtype, generator=gen).mT
    if layout == "conjugated":  # an unresolved conjugate view
        return torch.randn(cols, rows, dtype=dtype, generator=gen).mH
    if layout == "strided":
        return torch.randn(rows, 2 * cols, dtype=dtype, generator=gen)[:, ::2]
    return torch.randn(rows, cols, dtype=dtype, generator=gen)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize("layout_a", ["plain", "transposed", "conjugated", "strided"])
@pytest.mark.parametrize("layout_b", ["plain", "transposed", "conjugated"])
def test_gauss_mm_is_the_complex_product(dtype, layout_a, layout_b):
    gen = torch.Generator().manual_seed(0)
    a = _operand(70, 50, dtype, layout_a, gen)
    b = _operand(50, 40, dtype, layout_b, gen)
    a_before, b_before = a.clone(), b.clone()
    got = gauss.gauss_mm(a, b)
    want = a.to(torch.complex128) @ b.to(torch.complex128)
    assert got.dtype == dtype and got.shape == (70, 40) and got.is_contiguous()
    scale = torch.linalg.norm(a.to(torch.complex128)) * torch.linalg.norm(b.to(torch.complex128))
    assert torch.linalg.norm(got.to(torch.complex128) - want) / scale < TOL[dtype]
    # the operands are read, never written (the sums are formed in their planes)
    assert torch.equal(a, a_before) and torch.equal(b, b_before)


def test_only_large_products_take_three_gemms():
    assert gauss.gauss_worth(1400, 1000, 4000)
    assert not gauss.gauss_worth(4000, 64, 1024)  # narrow: bound by memory
    assert not gauss.gauss_worth(600, 600, 600)  # too few multiply-adds to pay


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128], ids=lambda d: np.dtype(d).name)
def test_a_sweep_by_three_gemms_matches_one_by_complex_gemms(monkeypatch, dtype):
    rng = np.random.default_rng(4)
    stack = make_stack("OS", 8, rng, dtype, chi=8, bond=3)
    plain = run_src(stack, 12, seed=5, backend="torch")
    calls = []
    monkeypatch.setattr(gauss, "GAUSS_MIN_DIM", 1)
    monkeypatch.setattr(gauss, "GAUSS_MIN_MACS", 1)
    real_mm = gauss.gauss_mm
    monkeypatch.setattr(
        "sexpgpu.tn.backend.gauss_mm", lambda a, b: calls.append(1) or real_mm(a, b)
    )
    three = run_src(stack, 12, seed=5, backend="torch")
    assert calls  # every product went through gauss_mm
    assert [a.shape for a in three] == [a.shape for a in plain]
    # a truncated sweep: the same truncation, to the products' rounding
    assert rel_error(three, dense_stack([plain])) < ROUNDING[dtype]


def test_real_products_stay_real_gemms(monkeypatch):
    monkeypatch.setattr(gauss, "GAUSS_MIN_DIM", 1)
    monkeypatch.setattr(gauss, "GAUSS_MIN_MACS", 1)
    xp = TorchBackend(Device("cpu", 0))
    a, b = torch.randn(5, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    assert torch.equal(xp.dot(a, b), a @ b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_gauss_mm_on_the_gpu_at_the_sweeps_sizes(dtype):
    gen = torch.Generator("cuda").manual_seed(1)
    a = torch.randn(1400, 1000, dtype=dtype, device="cuda", generator=gen)
    b = torch.randn(4000, 1000, dtype=dtype, device="cuda", generator=gen).mT
    assert gauss.gauss_worth(1400, 1000, 4000)
    got = TorchBackend(Device("cuda", 0)).dot(a, b)
    want = a.to(torch.complex128) @ b.to(torch.complex128)
    scale = torch.linalg.norm(a.to(torch.complex128)) * torch.linalg.norm(b.to(torch.complex128))
    assert torch.linalg.norm(got.to(torch.complex128) - want) / scale < TOL[dtype]
