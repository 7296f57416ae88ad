"""sexpgpu.tn against src-method 0.5.0 on the same inputs: similar error, same layout."""

from __future__ import annotations

import numpy as np
import pytest
import src_method
from tn_helpers import dense, dense_stack, make_stack, rel_error

import sexpgpu.tn as tn

SEEDS = range(4)


@pytest.mark.parametrize("shape", ["S", "O", "OS", "OO", "OOS", "SO"])
@pytest.mark.parametrize("oversample", [1.0, None], ids=["plain", "paper"])
def test_error_similar_to_src_method(shape, oversample):
    n, chi = 7, 4
    stack = make_stack(shape, n, np.random.default_rng(21), chi=10, bond=3, decay=0.3)
    target = dense_stack(stack)
    ours, theirs = [], []
    for seed in SEEDS:
        a = tn.src(*stack, chi_out=chi, seed=seed, oversample=oversample)
        b = src_method.src(*stack, chi_out=chi, seed=seed, oversample=oversample)
        assert [x.ndim for x in a] == [x.ndim for x in b]
        assert all(x.shape[-2:] == y.shape[-2:] for x, y in zip(a[1:-1], b[1:-1], strict=True))
        ours.append(rel_error(a, target))
        theirs.append(rel_error(b, target))
    # averaged over seeds, neither is more than 1.5x worse than the other
    mine, peer = np.mean(ours), np.mean(theirs)
    floor = 1e-12
    assert mine <= 1.5 * peer + floor
    assert peer <= 1.5 * mine + floor


def test_exact_products_agree_with_src_method():
    stack = make_stack("OOS", 6, np.random.default_rng(3), np.complex128, chi=6, bond=2)
    a = tn.src(*stack, chi_out=64, seed=0)
    b = src_method.src(*stack, chi_out=64, seed=0)
    target = dense_stack(stack)
    assert rel_error(a, target) < 1e-12
    np.testing.assert_allclose(dense(a), dense(b), atol=1e-12 * np.linalg.norm(target))


@pytest.mark.parametrize("shape", ["S", "O", "OS", "OO", "OOS", "SO", "SOO", "OOO"])
@pytest.mark.parametrize("dtype", [np.float32, np.complex128], ids=["f32", "c128"])
def test_same_seed_same_product_as_src_method(shape, dtype):
    # Both draw the sketches from numpy's default_rng in site order, so a switch of
    # import keeps results, up to rounding.
    stack = make_stack(shape, 6, np.random.default_rng(0), dtype, chi=8, bond=3, decay=0.2)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    for kwargs in ({}, {"oversample": None}, {"cutoff": 1e-3}):
        ours = dense(tn.src(*stack, chi_out=5, seed=7, **kwargs))
        theirs = dense(src_method.src(*stack, chi_out=5, seed=7, **kwargs))
        assert np.linalg.norm(ours - theirs) <= tol * np.linalg.norm(theirs)
