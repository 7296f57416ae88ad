"""quimb objects in and out: the same numbers as the list path, names and tags kept."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

# a test dependency: a GPU machine without it skips this module, not errs
qtn = pytest.importorskip("quimb.tensor")
import torch  # noqa: E402
from quimb.tensor.tnag.core import (  # noqa: E402
    tensor_network_apply_op_op,
    tensor_network_apply_op_vec,
)

from sexpgpu.tn import apply, compress, compress_network, src  # noqa: E402

N = 7
DOCS = Path(__file__).resolve().parents[2] / "docs" / "tn.md"


def _mps(**kw):
    return qtn.MPS_rand_state(N, 5, seed=1, **kw)


def _mpo(**kw):
    return qtn.MPO_rand(N, 3, seed=2, **kw)


def _same(result, cores):
    assert len(result.arrays) == len(cores)
    for got, want in zip(result.arrays, cores, strict=True):
        got = got.cpu().numpy() if isinstance(got, torch.Tensor) else got
        np.testing.assert_array_equal(got, want)


def test_apply_to_a_quimb_mps_keeps_its_names_and_tags():
    psi = _mps(tags=["PSI"], site_ind_id="s{}", site_tag_id="Q{}")
    op = _mpo(upper_ind_id="s{}", lower_ind_id="s{}_in")
    result = apply(op, psi, 4, seed=0)
    assert isinstance(result, qtn.MatrixProductState)
    assert (result.site_ind_id, result.site_tag_id) == ("s{}", "Q{}")
    assert "PSI" in result.tags and result.site_tags == psi.site_tags
    assert [result.site_ind(j) for j in range(N)] == [psi.site_ind(j) for j in range(N)]
    _same(result, apply(op.arrays, psi.arrays, 4, seed=0))


def test_an_mpo_product_keeps_the_outer_legs_names():
    a = _mpo(upper_ind_id="a{}", lower_ind_id="m{}")
    b = _mpo(upper_ind_id="m{}", lower_ind_id="z{}")
    result = apply(a, b, 5, seed=3)
    assert isinstance(result, qtn.MatrixProductOperator)
    assert (result.upper_ind_id, result.lower_ind_id) == ("a{}", "z{}")
    _same(result, apply(a.arrays, b.arrays, 5, seed=3))


def test_compress_round_trip_and_mixed_stacks():
    psi = _mps(tags=["KET"])
    small = compress(psi, 3, seed=0)
    assert isinstance(small, qtn.MatrixProductState) and small.max_bond() <= 3
    assert small.tags == psi.tags and small.site_ind_id == psi.site_ind_id
    _same(small, compress(psi.arrays, 3, seed=0))
    # a quimb MPO and a list MPS: the result is quimb, on the MPO's names
    mixed = src(_mpo(), list(psi.arrays), chi_out=4, seed=0)
    assert isinstance(mixed, qtn.MatrixProductState)
    _same(mixed, src(_mpo().arrays, psi.arrays, chi_out=4, seed=0))
    # lists stay lists
    plain = compress(list(psi.arrays), 3, seed=0)
    assert isinstance(plain, list) and all(isinstance(c, np.ndarray) for c in plain)


def test_tensors_whose_indices_quimb_permuted_are_read_by_name():
    psi = _mps()
    turned = psi.copy()
    for j in (0, 3, N - 1):
        tensor = turned[turned.site_tag(j)]
        tensor.transpose_(*reversed(tensor.inds))
    _same(compress(turned, 3, seed=0), compress(psi.arrays, 3, seed=0))


def test_torch_backed_quimb_objects_come_back_on_torch():
    psi, op = _mps(), _mpo()
    held = psi.copy()
    held.apply_to_arrays(torch.from_numpy)
    result = apply(op, held, 4, seed=0)
    assert all(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in result.arrays)
    _same(result, apply(op.arrays, psi.arrays, 4, seed=0))


def test_torch_tensors_as_sites_are_read_and_the_result_is_numpy():
    psi = _mps()
    sites = [torch.from_numpy(a) for a in psi.arrays]
    result = compress(sites, 3, seed=0, device=None)  # None: where the sites are (here the CPU)
    assert all(isinstance(c, np.ndarray) for c in result)
    for got, want in zip(result, compress(psi.arrays, 3, seed=0), strict=True):
        np.testing.assert_array_equal(got, want)
    # a conjugated view is read with its conjugation
    bra = src([t.conj() for t in sites], _mpo().arrays, chi_out=4, seed=0)
    want = src([a.conj() for a in psi.arrays], _mpo().arrays, chi_out=4, seed=0)
    for got, ref in zip(bra, want, strict=True):
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("depth", [1, 2])
def test_compress_network_of_operators_on_a_state_equals_the_stack(depth):
    psi = _mps(tags=["PSI"])
    ops = [qtn.MPO_rand(N, 2, seed=10 + i) for i in range(depth)]
    network = psi
    for op in reversed(ops):
        network = tensor_network_apply_op_vec(op, network, contract=False)
    assert network.num_tensors == N * (depth + 1)
    result = compress_network(network, 6, seed=4)
    assert isinstance(result, qtn.MatrixProductState)
    assert result.site_ind_id == network.site_ind_id and "PSI" in result.tags
    assert set(result.outer_inds()) == set(network.outer_inds())
    _same(result, src(*(op.arrays for op in ops), psi.arrays, chi_out=6, seed=4))
    # close to the exact product: its overlap with the network
    fidelity = abs(result.H @ network) ** 2 / abs(network.H @ network) / abs(result.H @ result)
    assert fidelity > 0.9


def test_compress_network_of_operators_equals_the_stack():
    a, b = _mpo(), qtn.MPO_rand(N, 2, seed=5)
    network = tensor_network_apply_op_op(a, b, contract=False)
    result = compress_network(network, 5, seed=1, oversample=None)
    assert isinstance(result, qtn.MatrixProductOperator)
    assert (result.upper_ind_id, result.lower_ind_id) == (
        network.upper_ind_id,
        network.lower_ind_id,
    )
    _same(result, src(a.arrays, b.arrays, chi_out=5, seed=1, oversample=None))


def test_compress_network_refuses_what_is_not_a_stack_of_trains():
    psi = _mps()
    extra = psi.copy()
    extra |= qtn.rand_tensor((2,), ["dangling"], tags=["I0", "I1"])
    with pytest.raises(TypeError, match="compress_network: tn has a tensor with site tags"):
        compress_network(extra, 4)
    with pytest.raises(TypeError, match="not a 1D quimb network"):
        compress_network([np.ones(2)], 4)


def test_the_quimb_example_in_the_docs_runs():
    text = DOCS.read_text()
    block = re.search(r"<!-- tested: quimb example -->\n```python\n(.*?)```", text, re.S)
    assert block is not None, "docs/tn.md lost its tested quimb example"
    exec(compile(block.group(1), str(DOCS), "exec"), {})


@pytest.mark.gpu
def test_compress_network_on_the_gpu_takes_cuda_tensors():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    psi, op = _mps(), _mpo()
    network = tensor_network_apply_op_vec(op, psi, contract=False)
    network.apply_to_arrays(lambda a: torch.from_numpy(a).cuda())
    result = compress_network(network, 4, seed=0)  # device None: the GPU, where the arrays are
    assert all(a.is_cuda for a in result.arrays)
    # the same sketches; the GPU's QR may differ in the signs of its columns
    host = result.copy()
    host.apply_to_arrays(lambda t: t.cpu().numpy())
    want = qtn.MatrixProductState(src(op.arrays, psi.arrays, chi_out=4, seed=0))
    assert abs(abs(host.H @ want) / abs(want.H @ want) - 1) < 1e-8


@pytest.mark.gpu
def test_cupy_trains_run_on_the_gpu_and_quimb_keeps_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    psi, op = _mps(), _mpo()
    cores = apply(op.arrays, psi.arrays, 4, seed=0)  # the host's list path
    want = qtn.MatrixProductState(cores)

    def same_state(arrays):  # the GPU's QR may differ in the signs of its columns
        got = qtn.MatrixProductState(
            [cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a for a in arrays]
        )
        assert abs(abs(got.H @ want) / abs(want.H @ want) - 1) < 1e-8

    # a plain list holding CuPy arrays: device None runs on the GPU, the result is NumPy
    listed = apply([cupy.asarray(a) for a in op.arrays], psi.arrays, 4, seed=0)
    assert all(isinstance(a, np.ndarray) for a in listed)
    same_state(listed)
    # on the CPU each CuPy site is brought to the host as the sweep reads it: the same bits
    host = apply([cupy.asarray(a) for a in op.arrays], psi.arrays, 4, seed=0, device="cpu")
    for got, ref in zip(host, cores, strict=True):
        np.testing.assert_array_equal(got, ref)
    # quimb objects holding CuPy arrays come back holding CuPy arrays, names kept
    psi_gpu, op_gpu = psi.copy(), op.copy()
    psi_gpu.apply_to_arrays(cupy.asarray)
    op_gpu.apply_to_arrays(cupy.asarray)
    result = apply(op_gpu, psi_gpu, 4, seed=0)
    assert isinstance(result, qtn.MatrixProductState)
    assert all(isinstance(a, cupy.ndarray) for a in result.arrays)
    assert (result.site_ind_id, result.site_tag_id) == (psi.site_ind_id, psi.site_tag_id)
    same_state(result.arrays)
