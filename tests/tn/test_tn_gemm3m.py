"""Complex products by the 3M method of NumPy's BLAS (`sexpgpu.tn.gemm3m`) against ``np.dot``."""

from __future__ import annotations

import numpy as np
import pytest

from sexpgpu.tn import gemm3m

TOL = {np.complex64: 2e-6, np.complex128: 1e-14}


@pytest.fixture
def taken(monkeypatch):
    """The 3M GEMM taken wherever it pays by shape, whatever this machine's trial says."""
    monkeypatch.setattr(gemm3m, "_pinned", {"D": True, "F": True})


def _draw(rng, shape, dtype):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def _layouts(x):
    """``x`` row-major, column-major, and as a view inside a wider array."""
    wide = np.zeros((x.shape[0], x.shape[1] + 3), x.dtype)
    wide[:, 1:-2] = x
    return {"C": np.ascontiguousarray(x), "F": np.asfortranarray(x), "view": wide[:, 1:-2]}


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(200, 64, 120), (64, 300, 64), (41, 40, 1000)])
def test_the_3m_product_equals_numpys_in_every_layout(dtype, shape, taken):
    if not gemm3m.available(np.dtype(dtype)):
        pytest.skip("NumPy's BLAS here has no 3M GEMM")
    m, k, n = shape
    rng = np.random.default_rng(0)
    a, b = _draw(rng, (m, k), dtype), _draw(rng, (k, n), dtype)
    want = a.astype(np.complex128) @ b.astype(np.complex128)
    scale = np.abs(a).max() * np.abs(b).max() * k
    for la, x in _layouts(a).items():
        for lb, y in _layouts(b).items():
            got = gemm3m.dot(x, y)
            assert got.dtype == dtype and got.shape == (m, n) and got.flags.c_contiguous
            assert np.abs(got - want).max() <= TOL[dtype] * scale, (la, lb)


def test_small_real_mixed_and_strided_products_are_numpys():
    rng = np.random.default_rng(1)
    a, b = _draw(rng, (100, 80), np.complex128), _draw(rng, (80, 90), np.complex128)
    cases = [
        (a[:, :30], b[:30]),  # a side below MIN_SIDE
        (a.real.copy(), b.real.copy()),  # real
        (a.astype(np.complex64), b),  # mixed dtypes
        (a[:, ::2], b[:40]),  # no unit stride
        (a.real, b.real),  # strided real views
    ]
    for x, y in cases:
        np.testing.assert_array_equal(gemm3m.dot(x, y), np.dot(x, y))


def test_the_3m_product_is_taken_where_it_pays(monkeypatch, taken):
    if not gemm3m.available(np.dtype(np.complex128)):
        pytest.skip("NumPy's BLAS here has no 3M GEMM")
    calls = []
    real = np.dot
    monkeypatch.setattr(np, "dot", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    rng = np.random.default_rng(2)
    a, b = _draw(rng, (128, 64), np.complex128), _draw(rng, (64, 128), np.complex128)
    gemm3m.dot(a, b)
    assert not calls
    gemm3m.dot(a[:, :32], b[:32])
    assert calls


def test_a_result_written_into_out_is_the_product(taken):
    rng = np.random.default_rng(3)
    a, b = _draw(rng, (90, 60), np.complex128), _draw(rng, (60, 70), np.complex128)
    for x, y in [(a, b), (a[:, :30], b[:30])]:  # the 3M GEMM where it is found, and np.dot
        out = np.full((x.shape[0], y.shape[1]), np.nan, np.complex128)
        assert gemm3m.dot(x, y, out) is out
        np.testing.assert_allclose(out, x @ y, rtol=1e-13, atol=1e-13)


def test_the_host_backend_reuses_a_named_scratch_buffer():
    from sexpgpu.tn.backend import NumpyBackend

    xp, rng = NumpyBackend(), np.random.default_rng(4)
    a, b = _draw(rng, (80, 50), np.complex128), _draw(rng, (50, 60), np.complex128)
    first = xp.dot(a, b, scratch="w")
    np.testing.assert_allclose(first, a @ b, rtol=1e-13, atol=1e-13)
    second = xp.dot(b.T, a.T, scratch="w")  # smaller: the same memory, viewed anew
    assert np.shares_memory(first, second)
    np.testing.assert_allclose(second, b.T @ a.T, rtol=1e-13, atol=1e-13)
    stacked = xp.matmul(np.stack([a, a]), np.stack([b, b]), scratch="m")
    np.testing.assert_allclose(stacked[1], a @ b, rtol=1e-13, atol=1e-13)
    assert not np.shares_memory(xp.dot(a, b), first)  # unnamed: its own array


@pytest.fixture
def fresh_choice():
    """The process's own choice made anew in the test and after it."""
    gemm3m._decided.cache_clear()
    yield
    gemm3m._decided.cache_clear()


def test_the_machine_decides_once_unless_set_or_pinned(monkeypatch, fresh_choice):
    if not gemm3m.available(np.dtype(np.complex128)):
        pytest.skip("NumPy's BLAS here has no 3M GEMM")
    monkeypatch.setattr(gemm3m, "_pinned", {})
    measured = gemm3m.choices()
    assert set(measured) == {"D", "F"} and gemm3m.choices() == measured  # timed once
    calls = []
    real = np.dot
    monkeypatch.setattr(np, "dot", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    rng = np.random.default_rng(5)
    a, b = _draw(rng, (128, 64), np.complex128), _draw(rng, (64, 128), np.complex128)
    for setting, plain in (("0", True), ("1", False)):
        monkeypatch.setenv(gemm3m.ENV, setting)
        gemm3m._decided.cache_clear()  # the setting is read once per process
        calls.clear()
        gemm3m.dot(a, b)
        assert bool(calls) == plain, setting
    gemm3m.pin({"D": False})  # another process's choice wins over the setting
    calls.clear()
    gemm3m.dot(a, b)
    assert calls and gemm3m.choices()["D"] is False


def test_a_setting_other_than_0_or_1_is_refused_before_any_work(monkeypatch, fresh_choice):
    from sexpgpu.tn import src

    monkeypatch.setenv(gemm3m.ENV, "yes")
    rng = np.random.default_rng(6)
    train = [_draw(rng, (1, 2, 3), np.complex128), _draw(rng, (3, 2, 1), np.complex128)]
    with pytest.raises(ValueError, match="SEXPGPU_GEMM3M must be 0"):
        src(train, train, chi_out=2, seed=0)
