"""SRC results against exact dense contraction followed by SVD truncation."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from tn_helpers import EXACT_TOL, dense, dense_stack, make_stack, rel_error, ttsvd_error

from sexpgpu.tn import apply, compress, src
from sexpgpu.tn.trains import normalize_stack

# Every stack shape: S an MPS, O an MPO, in mathematical order.
SHAPES = ["S", "O", "OS", "OO", "OOS", "SO", "SOO", "OOO"]
DTYPES = [np.float32, np.float64, np.complex64, np.complex128]


def _kind(shape: str) -> str:
    return "mps" if "S" in shape else "mpo"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES)
def test_exact_when_chi_out_reaches_the_rank(shape, dtype):
    rng = np.random.default_rng(len(shape) * 7 + DTYPES.index(dtype))
    stack = make_stack(shape, 5, rng, dtype)
    out = src(*stack, chi_out=64, seed=3)
    assert [o.dtype for o in out] == [np.dtype(dtype)] * 5
    assert [o.ndim for o in out] == [o.ndim for o in _template(stack, shape)]
    assert rel_error(out, dense_stack(stack)) < EXACT_TOL[dtype]


def _template(stack, shape):
    """A train of the result's kind, for the ranks of its sites."""
    return stack[-1] if shape[-1] == "S" else stack[0]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float64, np.complex128], ids=["f64", "c128"])
def test_error_within_a_small_factor_of_the_best(shape, dtype):
    n, chi = 7, 4
    rng = np.random.default_rng(11 + SHAPES.index(shape))
    stack = make_stack(shape, n, rng, dtype, chi=10, bond=3, decay=0.3)
    target = dense_stack(stack)
    best = ttsvd_error(target, n, chi, _kind(shape))
    floor = EXACT_TOL[dtype]
    for seed in range(3):
        oversampled = src(*stack, chi_out=chi, seed=seed, oversample=1.5)
        assert max(o.shape[0] for o in oversampled[1:]) <= chi
        assert rel_error(oversampled, target) <= 2.0 * best + floor
        plain = src(*stack, chi_out=chi, seed=seed)
        assert rel_error(plain, target) <= 8.0 * best + floor


@pytest.mark.parametrize("dtype", [np.float32, np.complex64], ids=["f32", "c64"])
def test_single_precision_error_near_the_best(dtype):
    n, chi = 6, 4
    stack = make_stack("OS", n, np.random.default_rng(5), dtype, chi=10, bond=3, decay=0.3)
    target = dense_stack(stack)
    best = ttsvd_error(target, n, chi, "mps")
    out = src(*stack, chi_out=chi, seed=0, oversample=None)
    assert out[0].dtype == np.dtype(dtype)
    assert rel_error(out, target) <= 2.0 * best + 1e-4


def test_same_seed_same_result_and_other_seed_differs():
    stack = make_stack("OS", 6, np.random.default_rng(2), chi=8, bond=3)
    a = apply(*stack, 3, seed=42)
    b = apply(*stack, 3, seed=42)
    c = apply(*stack, 3, seed=43)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(x.shape == y.shape and np.allclose(x, y) for x, y in zip(a, c, strict=True))
    gen = apply(*stack, 3, seed=np.random.default_rng(42))
    assert all(np.array_equal(x, y) for x, y in zip(a, gen, strict=True))


def _padded(train, kind):
    out = []
    for j, site in enumerate(train):
        s = site[..., None] if kind == "mps" else site
        s = s[None] if j == 0 else s
        s = s[:, None] if j == len(train) - 1 else s
        out.append(s)
    return out


def test_right_canonical_by_default_left_canonical_when_oversampled():
    stack = make_stack("OOS", 6, np.random.default_rng(9), np.complex128, chi=8, bond=2)
    right = _padded(src(*stack, chi_out=5, seed=0), "mps")
    for core in right[1:]:
        m = core.reshape(core.shape[0], -1)
        np.testing.assert_allclose(m @ m.conj().T, np.eye(m.shape[0]), atol=1e-12)
    left = _padded(src(*stack, chi_out=5, seed=0, oversample=2.0), "mps")
    for core in left[:-1]:
        m = core.transpose(0, 2, 3, 1).reshape(-1, core.shape[1])
        np.testing.assert_allclose(m.conj().T @ m, np.eye(m.shape[1]), atol=1e-12)


def test_dtype_rules():
    f32 = make_stack("OS", 5, np.random.default_rng(0), np.float32)
    assert src(*f32, chi_out=4, seed=0)[2].dtype == np.float32
    assert src(*f32, chi_out=4, seed=0, dtype=np.float64)[2].dtype == np.float64
    assert src(*f32, chi_out=4, seed=0, dtype=np.complex64)[2].dtype == np.complex64
    mixed = [f32[0], [s.astype(np.complex64) for s in f32[1]]]
    assert src(*mixed, chi_out=4, seed=0)[2].dtype == np.complex64
    ints = [[np.ones(s.shape, dtype=np.int64) for s in t] for t in f32]
    assert src(*ints, chi_out=4, seed=0)[2].dtype == np.float64


def test_cutoff_drops_small_singular_values():
    # An MPS of exact bond 2 padded to bond 6 with tiny noise: the cutoff finds 2.
    rng = np.random.default_rng(4)
    small = make_stack("S", 6, rng, chi=2)[0]
    noisy = []
    for j, site in enumerate(small):
        shape = list(site.shape)
        if j > 0:
            shape[0] = 6
        if j < 5:
            shape[1 if j > 0 else 0] = 6
        big = 1e-9 * rng.standard_normal(shape)
        big[tuple(slice(0, n) for n in site.shape)] += site
        noisy.append(big)
    for oversample in (1.0, 2.0):
        out = compress(noisy, 6, cutoff=1e-6, oversample=oversample, seed=0)
        assert max(o.shape[-2] for o in out[:-1]) == 2
        assert rel_error(out, dense(small)) < 1e-7
        assert max(o.shape[-2] for o in compress(noisy, 6, seed=0)[:-1]) > 2


@pytest.mark.parametrize("shape", ["S", "O", "OS", "OO", "SO", "OOS"])
def test_two_site_stacks_are_exact_with_a_warning(shape, caplog):
    stack = make_stack(shape, 2, np.random.default_rng(1), chi=4)
    target = dense_stack(stack)
    with caplog.at_level(logging.WARNING, logger="sexpgpu.tn"):
        out = src(*stack, chi_out=64, seed=0)
    assert "contracted and truncated exactly" in caplog.text
    assert rel_error(out, target) < 1e-12
    # truncated: the best rank-1 approximation across the single cut
    one = src(*stack, chi_out=1)
    assert one[0].shape[0] == 1
    matrix = target.reshape(int(np.sqrt(target.size)), -1)
    if _kind(shape) == "mpo":
        u, d = int(np.sqrt(target.shape[0])), int(np.sqrt(target.shape[1]))
        matrix = target.reshape(u, u, d, d).transpose(0, 2, 1, 3).reshape(u * d, u * d)
    sv = np.linalg.svd(matrix, compute_uv=False)
    best = np.sqrt((sv[1:] ** 2).sum()) / np.linalg.norm(sv)
    assert rel_error(one, target) == pytest.approx(best, rel=1e-8)


def _raw_train(rng, n, bond, legs):
    """A train with the same bond everywhere (bigger than the edges need)."""
    sites = []
    for j in range(n):
        left = [bond] if j > 0 else []
        right = [bond] if j < n - 1 else []
        sites.append(rng.standard_normal((*left, *right, *legs)))
    return sites


def test_rectangular_legs_and_oversized_edge_bonds_are_exact():
    rng = np.random.default_rng(12)
    a = _raw_train(rng, 5, 2, (2, 3))  # u=2, d=3
    b = _raw_train(rng, 5, 3, (3, 2))
    psi = _raw_train(rng, 5, 4, (2,))
    phi = _raw_train(rng, 5, 3, (2,))
    for stack in ([a, b], [a, b, psi], [phi, a, b], [b, a], [phi, a], [a]):
        out = src(*stack, chi_out=200, seed=0)
        assert rel_error(out, dense_stack(stack)) < 1e-12
        # bonds never exceed the exact rank bound at the edges
        assert out[0].shape[0] <= np.prod(out[0].shape[1:])


@pytest.mark.parametrize("shape", ["OS", "OO", "SOO"])
def test_capped_cuts_take_their_basis_from_qr_alone(shape, monkeypatch):
    # chi_out above every cut's rank bound: each site sketches with only its
    # first `cap` columns, whose QR is already the basis, so no SVD runs.
    from sexpgpu.tn.backend import NumpyBackend

    stack = make_stack(shape, 6, np.random.default_rng(4), np.complex128)

    def no_svd(self, x):
        raise AssertionError("an SVD ran where the rank cap alone binds")

    monkeypatch.setattr(NumpyBackend, "svd", no_svd)
    out = src(*stack, chi_out=200, seed=1)
    assert rel_error(out, dense_stack(stack)) < EXACT_TOL[np.complex128]
    monkeypatch.undo()
    # a cutoff reads the whole sketch's singular values, and keeps the exact product
    cut = src(*stack, chi_out=200, seed=1, cutoff=1e-14)
    assert rel_error(cut, dense_stack(stack)) < EXACT_TOL[np.complex128]


@pytest.mark.parametrize("shape", ["OS", "OO", "SOO"])
def test_the_first_pass_makes_only_the_columns_the_second_reads(shape, monkeypatch):
    # chi_out above the cut ranks near the right end: a right-to-left site reads
    # the first cap columns of C_j, and none where its basis is its whole space
    # (the bond to its right times the physical legs within chi and the cap);
    # column c of C_{j+1} comes from column c of C_j alone, so C_j needs the
    # widest width of sites j..n-1.
    from sexpgpu.tn.store import EnvironmentStore

    stack = make_stack(shape, 7, np.random.default_rng(5), np.complex128)
    rows: dict[int, int] = {}
    real_put = EnvironmentStore.put

    def put(self, j, env):
        rows[j] = env.shape[0]
        real_put(self, j, env)

    monkeypatch.setattr(EnvironmentStore, "put", put)
    chi = 12
    out = src(*stack, chi_out=chi, seed=3)
    st = normalize_stack(stack, "src", [f"t{i}" for i in range(len(stack))])
    caps, n = st.cut_ranks, st.n_sites
    widths, bond = {}, 1
    for j in range(n - 1, 0, -1):
        phys = st.shapes(j)[0][2] * st.shapes(j)[-1][3]
        whole = bond * phys <= min(chi, caps[j - 1])
        widths[j] = 0 if whole else min(chi, caps[j - 1])
        bond = min(bond * phys, chi, caps[j - 1])
    want = {j: max(widths[k] for k in range(j, n)) for j in range(1, n)}
    assert rows == {j: w for j, w in want.items() if w > 0}
    assert want[n - 1] == 0 and rows  # the last site keeps its whole space, others sketch
    monkeypatch.undo()
    # with a cutoff every site sketches with every column; the product agrees
    full = src(*stack, chi_out=chi, seed=3, cutoff=1e-300)
    dense_ref = dense_stack(stack)
    assert abs(rel_error(out, dense_ref) - rel_error(full, dense_ref)) < 1e-8
    np.testing.assert_allclose(dense(out), dense(full), atol=1e-10 * np.linalg.norm(dense_ref))
