"""Bonds above their rank bound, trimmed before the sweep (sexpgpu.tn.trim)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from tn_helpers import dense_stack, random_mpo

from sexpgpu.tn import src
from sexpgpu.tn.merge import merge_thin_layers
from sexpgpu.tn.trains import normalize_stack
from sexpgpu.tn.trim import trim_stack, trimmed_bonds


def _uniform_mps(n, chi, rng, dtype=np.complex128):
    """An MPS of bond ``chi`` at every cut, as quimb's MPS_rand_state makes it."""
    sites = []
    for j in range(n):
        shape = [chi] * (j > 0) + [chi] * (j < n - 1) + [2]
        sites.append((rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype))
    return sites


def _stack_sites(stack):
    """The stack's layers in the user's layout, read back through `Layer.read`'s inverse."""
    return [[layer.sites[j] for j in range(len(layer))] for layer in stack.layers]


def test_the_bounds_follow_the_physical_legs_from_both_ends():
    shapes = [(1, 16, 2, 1)] + [(16, 16, 2, 1)] * 6 + [(16, 1, 2, 1)]
    assert trimmed_bonds(shapes) == [2, 4, 8, 16, 8, 4, 2]
    # an MPO of bond 4 is within its bound (u d = 4) everywhere
    assert trimmed_bonds([(1, 4, 2, 2)] + [(4, 4, 2, 2)] * 3 + [(4, 1, 2, 2)]) == [4] * 4


@pytest.mark.parametrize("n", [3, 4, 9])
def test_trimming_keeps_the_product_and_the_cut_ranks(n):
    rng = np.random.default_rng(n)
    trains = [random_mpo(n, 5, rng, np.complex128), _uniform_mps(n, 12, rng)]
    stack = normalize_stack(trains, "src", ["a", "b"])
    trimmed = trim_stack(stack, np.dtype(np.complex128), max_bytes=1 << 30)
    assert trimmed is not stack
    bonds = [[s[1] for s in trimmed.shapes(j)] for j in range(n - 1)]
    assert all(b[1] <= min(2 ** (j + 1), 2 ** (n - 1 - j)) for j, b in enumerate(bonds))
    assert trimmed.cut_ranks == stack.cut_ranks
    want = dense_stack(trains)
    got = dense_stack(_stack_sites(trimmed))
    np.testing.assert_allclose(got, want, atol=1e-12 * np.linalg.norm(want))


def test_a_bra_stack_is_trimmed_in_its_own_layout():
    rng = np.random.default_rng(3)
    trains = [_uniform_mps(6, 9, rng), random_mpo(6, 7, rng, np.complex128)]
    stack = normalize_stack(trains, "src", ["a", "b"])  # phi^T A: the MPO is read transposed
    trimmed = trim_stack(stack, np.dtype(np.complex128), max_bytes=1 << 30)
    assert trimmed is not stack and trimmed.layers[0].transposed
    sites = _stack_sites(trimmed)
    want = dense_stack(trains)
    got = dense_stack([sites[1], sites[0]])
    np.testing.assert_allclose(got, want, atol=1e-12 * np.linalg.norm(want))


def test_a_stack_within_its_bounds_or_over_the_budget_is_left_alone(caplog):
    rng = np.random.default_rng(4)
    within = normalize_stack([random_mpo(5, 4, rng)], "compress", ["tensor"])
    assert trim_stack(within, np.dtype(np.float64), max_bytes=1 << 30) is within
    wide = normalize_stack([_uniform_mps(6, 9, rng)], "compress", ["tensor"])
    with caplog.at_level(logging.DEBUG, logger="sexpgpu.tn.trim"):
        assert trim_stack(wide, np.dtype(np.complex128), max_bytes=100) is wide
    assert "not trimmed" in caplog.text


def test_the_sweep_of_a_wide_stack_matches_its_trimmed_twin():
    """Trimming happens inside `src`: a stack trimmed beforehand gives the same result."""
    rng = np.random.default_rng(5)
    trains = [random_mpo(10, 3, rng, np.complex128), _uniform_mps(10, 16, rng)]
    stack = normalize_stack(trains, "src", ["a", "b"])
    twin = _stack_sites(trim_stack(stack, np.dtype(np.complex128), max_bytes=1 << 30))
    a = src(*trains, chi_out=8, seed=1)
    b = src(*twin, chi_out=8, seed=1)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-10)
    want = dense_stack(trains)
    assert np.linalg.norm(dense_stack([a]) - want) < np.linalg.norm(want)


def test_a_non_finite_boundary_site_is_refused_before_trimming():
    rng = np.random.default_rng(6)
    sites = _uniform_mps(5, 8, rng)
    sites[0][0, 0] = np.nan
    with pytest.raises(ValueError, match="site 0\\) holds 1 NaN"):
        src(sites, chi_out=4, seed=0)


def test_thin_operator_layers_merge_into_one_with_the_same_product():
    rng = np.random.default_rng(7)
    u2, u1 = random_mpo(6, 4, rng, np.complex128), random_mpo(6, 4, rng, np.complex128)
    psi = _uniform_mps(6, 3, rng)
    stack = normalize_stack([u2, u1, psi], "src", ["a", "b", "c"])
    merged = merge_thin_layers(stack, np.dtype(np.complex128))
    assert [layer.kind for layer in merged.layers] == ["mpo", "mps"]
    assert [s[1] for s in merged.shapes(2)] == [16, 3]
    assert merged.cut_ranks == stack.cut_ranks
    want = dense_stack([u2, u1, psi])
    got = dense_stack(_stack_sites(merged))
    np.testing.assert_allclose(got, want, atol=1e-12 * np.linalg.norm(want))


def test_a_bra_of_thin_operators_merges_in_ket_form():
    rng = np.random.default_rng(8)
    phi, a1, a2 = _uniform_mps(5, 2, rng), random_mpo(5, 2, rng), random_mpo(5, 3, rng)
    stack = normalize_stack([phi, a1, a2], "src", ["a", "b", "c"])  # phi^T A1 A2
    merged = merge_thin_layers(stack, np.dtype(np.complex128))
    assert len(merged.layers) == 2 and not merged.layers[0].transposed
    sites = _stack_sites(merged)
    # the merged ket-form operator is (A1 A2)^T
    want = dense_stack([phi, a1, a2])
    got = dense_stack([phi, [np.swapaxes(s, -2, -1) for s in sites[0]]])
    np.testing.assert_allclose(got, want, atol=1e-12 * np.linalg.norm(want))


def test_wide_operators_and_states_stay_separate():
    rng = np.random.default_rng(9)
    wide = normalize_stack([random_mpo(5, 8, rng), random_mpo(5, 4, rng)], "src", ["a", "b"])
    assert merge_thin_layers(wide, np.dtype(np.float64)) is wide
    mps = normalize_stack([random_mpo(5, 2, rng), _uniform_mps(5, 2, rng)], "src", ["a", "b"])
    assert merge_thin_layers(mps, np.dtype(np.complex128)) is mps


def test_a_merged_stack_compresses_as_the_separate_one():
    rng = np.random.default_rng(10)
    trains = [random_mpo(8, 2, rng), random_mpo(8, 3, rng), _uniform_mps(8, 6, rng)]
    result = src(*trains, chi_out=6, seed=2)
    stack = normalize_stack(trains, "src", ["a", "b", "c"])
    merged = merge_thin_layers(stack, np.dtype(np.complex128))
    twin = src(*_stack_sites(merged), chi_out=6, seed=2)
    for x, y in zip(result, twin, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-10)
