"""Lazy inputs (memmap, HDF5, zarr), reading order, and the quimb round trip."""

from __future__ import annotations

import weakref

import h5py
import numpy as np
import pytest
import quimb.tensor as qtn
from tn_helpers import dense_stack, make_stack, rel_error

from sexpgpu.tn import apply, compress, src


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def _to_memmap(stack, root):
    out = []
    for i, train in enumerate(stack):
        sites = []
        for j, site in enumerate(train):
            mm = np.lib.format.open_memmap(
                root / f"t{i}s{j}.npy", mode="w+", dtype=site.dtype, shape=site.shape
            )
            mm[...] = site
            mm.flush()
            sites.append(np.load(root / f"t{i}s{j}.npy", mmap_mode="r"))
        out.append(sites)
    return out


def _to_zarr(stack, root):
    zarr = pytest.importorskip("zarr")  # the tn-io extra; a GPU machine may lack it
    group = zarr.open_group(str(root / "stack.zarr"), mode="w")
    out = []
    for i, train in enumerate(stack):
        sites = []
        for j, site in enumerate(train):
            arr = group.create_array(f"t{i}s{j}", shape=site.shape, dtype=site.dtype)
            arr[...] = site
            sites.append(arr)
        out.append(sites)
    return out


@pytest.mark.parametrize("shape", ["OS", "SOO", "OO"])
def test_memmap_hdf5_and_zarr_give_the_same_result_as_arrays(tmp_path, shape):
    stack = make_stack(shape, 5, np.random.default_rng(8), np.complex128, chi=6, bond=2)
    reference = src(*stack, chi_out=4, seed=5)
    _same(src(*_to_memmap(stack, tmp_path), chi_out=4, seed=5), reference)
    _same(src(*_to_zarr(stack, tmp_path), chi_out=4, seed=5), reference)
    with h5py.File(tmp_path / "stack.h5", "w") as f:
        for i, train in enumerate(stack):
            for j, site in enumerate(train):
                f[f"t{i}/s{j}"] = site
    with h5py.File(tmp_path / "stack.h5", "r") as f:
        lazy = [[f[f"t{i}/s{j}"] for j in range(len(t))] for i, t in enumerate(stack)]
        _same(src(*lazy, chi_out=4, seed=5), reference)


class Tracker:
    """Records which sites are read, in order, and how many reads are alive."""

    def __init__(self) -> None:
        self.log: list[tuple[int, int]] = []
        self.alive = 0
        self.peak = 0

    def read(self, key: tuple[int, int], data: np.ndarray) -> np.ndarray:
        self.log.append(key)
        out = data.copy()  # a fresh array per read, as a file would give
        self.alive += 1
        self.peak = max(self.peak, self.alive)
        weakref.finalize(out, self._release)
        return out

    def _release(self) -> None:
        self.alive -= 1


class CountingSite:
    """An array-like site that reports its reads to a `Tracker`."""

    def __init__(self, data: np.ndarray, key: tuple[int, int], tracker: Tracker) -> None:
        self._data, self._key, self._tracker = data, key, tracker
        self.shape, self.dtype = data.shape, data.dtype

    def __array__(self, dtype=None, copy=None):
        out = self._tracker.read(self._key, self._data)
        return out if dtype is None else out.astype(dtype)


def test_sites_are_read_when_the_sweep_reaches_them():
    n = 7
    stack = make_stack("OS", n, np.random.default_rng(1), chi=6, bond=2)
    tracker = Tracker()
    lazy = [
        [CountingSite(s, (i, j), tracker) for j, s in enumerate(t)] for i, t in enumerate(stack)
    ]
    out = src(*lazy, chi_out=4, seed=0)
    _same(out, src(*stack, chi_out=4, seed=0))
    sites = [j for i, j in tracker.log if i == 0]
    # left to right up to the last but one site, then right to left from the last
    assert sites == [*range(n - 1), *range(n - 1, -1, -1)]
    assert sorted(tracker.log) == sorted(
        (i, j) for i in range(2) for j in [*range(n - 1), *range(n)]
    )
    # never more than two sites of each train alive at once (the one computing
    # and the next, read ahead), and all released
    assert tracker.peak <= 2 * len(stack)
    assert tracker.alive == 0


def test_quimb_round_trip_mpo_and_mps():
    mpo = qtn.MPO_rand(6, 3, phys_dim=2, seed=1)
    mps = qtn.MPS_rand_state(6, 5, phys_dim=2, seed=2)
    prod = qtn.MatrixProductOperator(apply(mpo.arrays, mpo.arrays, 64, seed=0))
    np.testing.assert_allclose(prod.to_dense(), mpo.to_dense() @ mpo.to_dense(), atol=1e-10)
    ket = qtn.MatrixProductState(apply(mpo.arrays, mps.arrays, 64, seed=0))
    np.testing.assert_allclose(ket.to_dense(), mpo.to_dense() @ mps.to_dense(), atol=1e-10)
    small = qtn.MatrixProductState(compress(list(mps.arrays), 3, seed=0))
    assert small.max_bond() == 3
    fidelity = abs(small.H @ mps) / (small.norm() * mps.norm())
    assert fidelity > 0.5
    bra = src([t.conj() for t in mps.arrays], mpo.arrays, chi_out=64, seed=0)
    expected = mps.to_dense().conj().T @ mpo.to_dense()
    np.testing.assert_allclose(qtn.MatrixProductState(bra).to_dense().T, expected, atol=1e-10)


def test_results_are_plain_arrays_and_inputs_are_untouched():
    stack = make_stack("OOS", 5, np.random.default_rng(2), chi=6)
    copies = [[s.copy() for s in t] for t in stack]
    out = src(*stack, chi_out=3, seed=0, oversample=None)
    assert all(type(o) is np.ndarray and o.flags.c_contiguous for o in out)
    for train, saved in zip(stack, copies, strict=True):
        for a, b in zip(train, saved, strict=True):
            np.testing.assert_array_equal(a, b)
    assert rel_error(src(*stack, chi_out=64, seed=0), dense_stack(stack)) < 1e-12
