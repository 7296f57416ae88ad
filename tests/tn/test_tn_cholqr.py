"""CholeskyQR2 of the sketches (torch backend, on the CPU) and its Householder fallback."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from tn_helpers import EXACT_TOL, dense_stack, make_stack, random_mps, rel_error, run_src

import sexpgpu.tn.cholqr as cholqr
from sexpgpu.runtime.devices import Device
from sexpgpu.tn import Resources
from sexpgpu.tn.backend import TorchBackend
from sexpgpu.tn.cholqr import cholesky_qr2
from sexpgpu.tn.sweep import basis

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]
# ||Q^H Q - I||_F and ||Y - Q R||_F / ||Y||_F a dtype's QR may show.
TOL = {np.float32: 1e-5, np.float64: 1e-13, np.complex64: 1e-5, np.complex128: 1e-13}


def ids(dtype):
    return np.dtype(dtype).name


def _conditioned(m, n, kappa, dtype, seed=0):
    """A random ``(m, n)`` matrix with singular values from 1 down to ``1/kappa``."""
    rng = np.random.default_rng(seed)
    complex_ = np.dtype(dtype).kind == "c"

    def draw(*shape):
        a = rng.standard_normal(shape)
        return a + 1j * rng.standard_normal(shape) if complex_ else a

    u, _ = np.linalg.qr(draw(m, n))
    v, _ = np.linalg.qr(draw(n, n))
    s = np.logspace(0, -np.log10(kappa), n)
    return torch.from_numpy(((u * s) @ v.conj().T).astype(dtype))


def _check_qr(y, q, r, dtype):
    eye = torch.eye(q.shape[1], dtype=q.dtype)
    assert q.dtype == y.dtype and q.shape == y.shape
    assert torch.linalg.matrix_norm(q.mH @ q - eye) < TOL[dtype]
    assert torch.linalg.matrix_norm(y - q @ r) < TOL[dtype] * torch.linalg.matrix_norm(y)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("kappa", [10.0, 1e5])
def test_cholesky_qr2_matches_householder(dtype, kappa):
    y = _conditioned(300, 80, kappa, dtype)
    q, r, failed = cholesky_qr2(y, with_r=True)
    assert not failed
    _check_qr(y, q, r, dtype)
    diagonal = torch.view_as_real(r.diagonal()) if r.is_complex() else r.diagonal()[:, None]
    assert torch.all(diagonal[:, 0] > 0) and torch.all(diagonal[:, 1:] == 0)
    # Householder QR with R's diagonal made positive: the same factors, to rounding
    qh, rh = TorchBackend(Device("cpu", 0)).qr(y)
    assert torch.linalg.matrix_norm(q - qh) < 1e3 * kappa * TOL[dtype]
    assert torch.linalg.matrix_norm(r - rh) < 1e3 * kappa * TOL[dtype]


@pytest.mark.parametrize(
    ("dtype", "kappa", "second"),
    [
        (np.complex64, 10.0, "none"),
        (np.float64, 10.0, "first order"),
        (np.complex64, 1e5, "first order"),
        (np.complex128, 1e5, "full"),
    ],
    ids=["complex64-well", "float64-well", "complex64-ill", "complex128-ill"],
)
def test_the_second_pass_is_the_cheapest_exact_to_rounding(monkeypatch, dtype, kappa, second):
    # ||Q1^H Q1 - I|| grows like u kappa^2 (u of double: single sketches are
    # factored in double). At kappa 10 it is below single's rounding (no second
    # pass) and its square below double's (first order); at 1e5 only its square
    # is below single's rounding.
    calls = {"cholesky": 0, "gemm": 0}
    one_pass, addmm = cholqr._cholesky_qr, torch.addmm

    def counted(name, fn):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    monkeypatch.setattr(cholqr, "_cholesky_qr", counted("cholesky", one_pass))
    monkeypatch.setattr(torch, "addmm", counted("gemm", addmm))
    y = _conditioned(300, 80, kappa, dtype, seed=3)
    q, r, failed = cholesky_qr2(y, with_r=True)
    expected = {"none": (1, 0), "first order": (1, 1), "full": (2, 0)}[second]
    assert (calls["cholesky"], calls["gemm"]) == expected and not failed
    _check_qr(y, q, r, dtype)
    qh, _rh = TorchBackend(Device("cpu", 0)).qr(y)
    assert torch.linalg.matrix_norm(q - qh) < 1e3 * kappa * TOL[dtype]


def _rank_deficient(m, n, rank, dtype):
    """Exactly of rank ``rank``: its last columns repeat its first ones, one is zero."""
    y = _conditioned(m, n, 10.0, dtype)
    y[:, rank:] = y[:, : n - rank]
    y[:, -1] = 0
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_cholesky_qr2_fails_on_a_rank_deficient_or_ill_conditioned_sketch(dtype):
    singular = _rank_deficient(200, 40, 25, dtype)
    cases = [singular, singular + 0 * float("nan")]
    if dtype in (np.float64, np.complex128):  # single sketches are factored in double
        cases.append(_conditioned(200, 40, 1e13, dtype))
    for y in cases:
        _q, _r, failed = cholesky_qr2(y, with_r=False)
        assert failed.dtype == torch.bool and failed.shape == ()
        assert failed


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("cutoff", [0.0, 1e-3])
def test_basis_falls_back_to_householder(dtype, cutoff):
    xp = TorchBackend(Device("cpu", 0))
    y = _rank_deficient(120, 30, 20, dtype)
    q, failed = basis(xp, y, cutoff, cap=30)
    if cutoff > 0:  # the SVD path reads the flag itself and falls back at once
        assert failed is None
        assert q.shape == (120, 20)
    else:
        assert xp.flag(failed)()
        q, failed = basis(xp, y, cutoff, cap=30, exact=True)
        assert failed is None
    eye = torch.eye(q.shape[1], dtype=q.dtype)
    assert torch.linalg.matrix_norm(q.mH @ q - eye) < TOL[dtype]
    residual = y - q @ (q.mH @ y)  # the basis holds the sketch's range
    assert torch.linalg.matrix_norm(residual) < 10 * TOL[dtype] * torch.linalg.matrix_norm(y)


def _padded_mps(n, bond, padded, rng, dtype):
    """A bond-``bond`` MPS padded with zeros to bond ``padded``: its cuts have rank ``bond``."""
    out = []
    for j, site in enumerate(random_mps(n, bond, rng, dtype)):
        shape = list(site.shape)
        if j > 0:
            shape[0] = min(padded, 2**j, 2 ** (n - j))
        if j < n - 1:
            shape[-2] = min(padded, 2 ** (j + 1), 2 ** (n - 1 - j))
        big = np.zeros(shape, dtype)
        big[tuple(slice(0, s) for s in site.shape)] = site
        out.append(big)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_rank_deficient_sketches_fall_back_and_agree(caplog, dtype):
    rng = np.random.default_rng(7)
    stack = [*make_stack("O", 8, rng, dtype, bond=2), _padded_mps(8, 2, 8, rng, dtype)]
    # sketch width 10 against a rank bound of 16 and an exact rank of at most 4
    with caplog.at_level(logging.DEBUG, logger="sexpgpu.tn"):
        torch_out = run_src(stack, 10, seed=3, backend="torch")
    assert "CholeskyQR2 failed; Householder QR" in caplog.text
    numpy_out = run_src(stack, 10, seed=3)
    assert [a.shape for a in torch_out] == [a.shape for a in numpy_out]
    target = dense_stack(stack)
    assert rel_error(torch_out, target) < EXACT_TOL[dtype]
    assert rel_error(numpy_out, target) < EXACT_TOL[dtype]
    two = run_src(stack, 10, seed=3, backend="torch", resources=Resources(devices=2))
    assert rel_error(two, target) < EXACT_TOL[dtype]
    one = run_src(stack, 10, seed=3, backend="torch", resources=Resources(devices=1))
    for a, b in zip(one, torch_out, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128], ids=ids)
def test_ill_conditioned_sketches_match_householder(caplog, dtype):
    # a steeply decaying spectrum: the sketches' condition numbers run from 4 to
    # 1e16, some factored by CholeskyQR2, the worst by Householder QR
    rng = np.random.default_rng(8)
    stack = make_stack("OS", 10, rng, dtype, chi=16, bond=2, decay=2.5)
    with caplog.at_level(logging.DEBUG, logger="sexpgpu.tn"):
        torch_out = run_src(stack, 12, seed=2, backend="torch")
    assert 0 < caplog.text.count("CholeskyQR2 failed") < 6
    numpy_out = run_src(stack, 12, seed=2)
    target = dense_stack(stack)
    e_torch, e_numpy = rel_error(torch_out, target), rel_error(numpy_out, target)
    assert abs(e_torch - e_numpy) <= 1e-3 * e_numpy + 1e-12


@pytest.mark.parametrize("dtype", [np.float32, np.complex64], ids=ids)
def test_single_sketches_in_their_own_precision_factor_the_well_conditioned_and_fail_the_rest(
    dtype,
):
    """``wide=False`` (a GPU whose double precision is slow): orthonormal to single's rounding
    where ``kappa <~ 3e3``; beyond, the check fails and the caller falls back to Householder."""
    y = _conditioned(300, 80, 10.0, dtype)
    q, r, failed = cholesky_qr2(y, with_r=True, wide=False)
    assert not failed
    _check_qr(y, q, r, dtype)
    _q, _r, failed = cholesky_qr2(_conditioned(300, 80, 1e6, dtype), with_r=False, wide=False)
    assert failed  # factored in double, the same sketch passes
    assert not cholesky_qr2(_conditioned(300, 80, 1e6, dtype), with_r=False)[2]
