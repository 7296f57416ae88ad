"""The SVD fallbacks for LAPACK's rare convergence failures, and the thin QR."""

from __future__ import annotations

import numpy as np
import pytest

from sexpgpu.tn import linalg


def _matrix():
    rng = np.random.default_rng(0)
    return rng.standard_normal((7, 5)) + 1j * rng.standard_normal((7, 5))


def _check(m, u, s, vh):
    np.testing.assert_allclose((u * s) @ vh, m, atol=1e-12)
    np.testing.assert_allclose(u.conj().T @ u, np.eye(s.size), atol=1e-12)
    np.testing.assert_allclose(s, np.linalg.svd(m, compute_uv=False), atol=1e-12)


def _failing(times):
    real = np.linalg.svd
    calls = []

    def svd(a, *args, **kwargs):
        calls.append(a.shape)
        if len(calls) <= times:
            raise np.linalg.LinAlgError("SVD did not converge")
        return real(a, *args, **kwargs)

    return svd


@pytest.mark.parametrize("failures", [0, 1, 2])
def test_svd_falls_back_when_lapack_does_not_converge(monkeypatch, failures):
    m = _matrix()
    expected = np.linalg.svd(m, compute_uv=False)
    monkeypatch.setattr(np.linalg, "svd", _failing(failures))
    u, s, vh = linalg.svd(m)
    monkeypatch.undo()
    _check(m, u, s, vh)
    np.testing.assert_allclose(s, expected, atol=1e-12)


def test_svd_by_eigh_without_scipy():
    m = _matrix()
    _check(m, *linalg._svd_by_eigh(m))
    _check(m.T, *linalg._svd_by_eigh(m.T))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
@pytest.mark.parametrize("shape", [(40, 12), (12, 40), (9, 9)])
def test_lapack_qr_is_a_thin_qr_with_q_in_fortran_order(dtype, shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) + (
        1j * rng.standard_normal(shape) if dtype in (np.complex64, np.complex128) else 0
    )
    x = x.astype(dtype)
    q, r = linalg.qr(x)
    k = min(shape)
    assert q.dtype == r.dtype == dtype and q.shape == (shape[0], k) and r.shape == (k, shape[1])
    tol = 1e-4 if dtype in (np.float32, np.complex64) else 1e-12
    np.testing.assert_allclose(q @ r, x, atol=tol * 10)
    np.testing.assert_allclose(q.conj().T @ q, np.eye(k), atol=tol)
    np.testing.assert_array_equal(r, np.triu(r))
    assert q.flags.f_contiguous  # its transpose, the output core, needs no copy
    _ref_q, ref_r = np.linalg.qr(x)  # the same factorization, up to rounding
    np.testing.assert_allclose(np.abs(np.diagonal(r)), np.abs(np.diagonal(ref_r)), rtol=tol * 100)
