"""The thin layer's product in one pass (`sexpgpu.tn.thin`), under Triton's interpreter on the CPU.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so the cases
run in a pytest of their own with it set (`test_the_kernel_under_the_interpreter`);
in this process they skip. On a GPU the compiled kernel is checked by the
device tests (``tests/tn/test_tn_devices.py -m gpu``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tn_helpers import make_stack, run_src
from triton_interpreted import INTERPRETED, run_interpreted

from sexpgpu.runtime.devices import parse_device
from sexpgpu.tn import thin
from sexpgpu.tn.backend import NumpyBackend, TorchBackend
from sexpgpu.tn.contractions import right_block

pytest.importorskip("triton")

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]
TOL = {np.float32: 1e-5, np.float64: 1e-12, np.complex64: 1e-5, np.complex128: 1e-12}


def test_the_kernel_under_the_interpreter():
    run_interpreted(__file__)


@pytest.fixture
def interpreted(monkeypatch):
    """The calls of the kernel, on CPU tensors under Triton's interpreter."""
    if not INTERPRETED:
        pytest.skip("runs under TRITON_INTERPRET=1 (see the module docstring)")
    calls = []
    real = thin.thin_product

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(thin, "thin_product", counted)
    return calls


def _draw(rng, shape, dtype):
    x = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        x = x + 1j * rng.standard_normal(shape)
    return torch.from_numpy(x.astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_thin_product_equals_einsum_for_any_strides(interpreted, dtype):
    rng = np.random.default_rng(0)
    e, r, rows, x, y, m, w = 3, 3, 150, 2, 2, 5, 3  # rows past a block; r y, m not powers of 2
    z = _draw(rng, (e, rows, y, r, x), dtype).permute(0, 3, 1, 4, 2)  # (e, r, l, x, y), strided
    g = _draw(rng, (m, r, y, w), dtype)
    out = torch.full((w, rows, e, m, x), np.nan, dtype=z.dtype).permute(2, 4, 0, 1, 3)
    thin.thin_product(z, g, out)
    expected = torch.einsum("erlxy,mryw->exwlm", z, g)
    assert torch.allclose(out, expected, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.complex64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("thin_layer", [0, 1])
def test_right_block_with_a_thin_layer_equals_numpys(interpreted, dtype, thin_layer):
    """The wide layer first, then the thin one in one pass: top-down and bottom-up."""
    rng = np.random.default_rng(1)
    wide, narrow, e = 12, 3, 7
    bonds = [wide, narrow] if thin_layer == 1 else [narrow, wide]
    cores = [_draw(rng, (b, b, 2, 2), dtype).numpy() for b in bonds]
    proj = _draw(rng, (e, *bonds), dtype).numpy()
    expected = right_block(NumpyBackend(), proj, cores)
    xp = TorchBackend(parse_device("cpu"))
    got = right_block(xp, torch.from_numpy(proj), [torch.from_numpy(c) for c in cores])
    assert interpreted, "the thin layer's product did not take the kernel"
    assert got.is_contiguous() and got.shape == expected.shape
    np.testing.assert_allclose(got.numpy(), expected, rtol=TOL[dtype], atol=TOL[dtype])


def test_right_block_of_two_wide_layers_keeps_the_gemms(interpreted):
    rng = np.random.default_rng(2)
    cores = [_draw(rng, (40, 40, 2, 2), np.float64).numpy() for _ in range(2)]
    proj = _draw(rng, (3, 40, 40), np.float64).numpy()
    xp = TorchBackend(parse_device("cpu"))
    got = right_block(xp, torch.from_numpy(proj), [torch.from_numpy(c) for c in cores])
    assert not interpreted
    np.testing.assert_allclose(got.numpy(), right_block(NumpyBackend(), proj, cores), rtol=1e-12)


def test_a_sweep_through_the_kernel_equals_numpys(interpreted):
    # bonds 6 and 3: too wide together for the CPU sweep to merge them (merge.THIN_BOND)
    stack = make_stack("OO", 5, np.random.default_rng(3), np.complex128, bond=3)
    stack[0] = make_stack("O", 5, np.random.default_rng(4), np.complex128, bond=6)[0]
    numpy_out = run_src(stack, 8, seed=4)
    torch_out = run_src(stack, 8, seed=4, backend="torch")
    assert interpreted
    for a, b in zip(torch_out, numpy_out, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
