"""The SVD fallbacks for LAPACK's rare convergence failures."""

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
