"""The torch backend and several devices, simulated on the CPU; real GPUs under ``-m gpu``."""

from __future__ import annotations

import functools
import logging
import threading

import numpy as np
import pytest
import torch
from tn_helpers import EXACT_TOL, dense_stack, make_stack, rel_error, run_src

import sexpgpu.tn.backend as backend_module
import sexpgpu.tn.engine as engine
from sexpgpu.runtime.devices import Device
from sexpgpu.runtime.group import GroupAborted
from sexpgpu.tn import Resources, src
from sexpgpu.tn.backend import PRODUCT_COPY_BYTES, TorchBackend
from sexpgpu.tn.plan import Budgets, make_plan, minimum_budgets
from sexpgpu.tn.trains import normalize_stack

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]
CLOSE = {np.float32: 2e-4, np.float64: 1e-10, np.complex64: 2e-4, np.complex128: 1e-10}

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _close(a, b, dtype):
    assert [x.shape for x in a] == [y.shape for y in b]
    target = np.sqrt(sum(np.vdot(y, y).real for y in b))
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        assert np.linalg.norm(x - y) <= CLOSE[dtype] * max(1.0, target)


_run = functools.partial(run_src, seed=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", ["OS", "OO", "SOO", "OOS"])
def test_torch_backend_matches_numpy(shape, dtype):
    stack = make_stack(shape, 6, np.random.default_rng(2), dtype, chi=6, bond=2)
    numpy_out = _run(stack, 4, oversample=1.5)
    torch_out = _run(stack, 4, oversample=1.5, backend="torch")
    assert all(type(o) is np.ndarray for o in torch_out)
    _close(torch_out, numpy_out, dtype)
    exact = _run(stack, 64, backend="torch")
    assert rel_error(exact, dense_stack(stack)) < EXACT_TOL[dtype]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_simulated_devices_split_the_sketch_and_agree(backend, ranks):
    stack = make_stack("OOS", 7, np.random.default_rng(5), np.complex128, chi=8, bond=2)
    one = _run(stack, 5, backend=backend, oversample=1.4)
    many = _run(stack, 5, backend=backend, oversample=1.4, resources=Resources(devices=ranks))
    _close(many, one, np.complex128)
    exact = _run(stack, 64, backend=backend, resources=Resources(devices=ranks))
    assert rel_error(exact, dense_stack(stack)) < 1e-12


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_one_device_in_a_group_gives_the_single_device_bits(backend):
    stack = make_stack("OS", 6, np.random.default_rng(7), chi=8, bond=3)
    solo = _run(stack, 5, backend=backend)
    _same(_run(stack, 5, backend=backend, resources=Resources(devices=1)), solo)
    _same(_run(stack, 5, backend=backend, resources=Resources(devices=[3])), solo)


def test_more_devices_than_sketch_columns():
    stack = make_stack("OS", 5, np.random.default_rng(1), chi=6, bond=2)
    one = _run(stack, 2)
    _close(_run(stack, 2, resources=Resources(devices=4)), one, np.float64)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_ranks_agree_on_the_cutoff_rank(backend):
    rng = np.random.default_rng(3)
    stack = make_stack("OS", 7, rng, chi=10, bond=3, decay=1.5)
    one = _run(stack, 8, backend=backend, cutoff=1e-3)
    many = _run(stack, 8, backend=backend, cutoff=1e-3, resources=Resources(devices=3))
    assert [o.shape for o in many] == [o.shape for o in one]
    assert max(o.shape[0] for o in one[1:]) < 8  # the cutoff did cut


def test_a_failing_rank_aborts_the_group_without_hanging(monkeypatch):
    import sexpgpu.tn.sweep as sweep_module

    real = sweep_module.right_block

    def broken(xp, proj, cores, *rest):
        if threading.current_thread().name == "sexpgpu-rank-1":
            raise ValueError("rank 1 broke")
        return real(xp, proj, cores, *rest)

    monkeypatch.setattr(sweep_module, "right_block", broken)
    stack = make_stack("OS", 6, np.random.default_rng(1), chi=6, bond=2)
    with pytest.raises((ValueError, GroupAborted), match="rank 1 broke"):
        _run(stack, 4, resources=Resources(devices=3))


def test_plan_and_peaks_are_logged_per_rank(caplog):
    stack = make_stack("OS", 6, np.random.default_rng(1), chi=6, bond=2)
    with caplog.at_level(logging.DEBUG, logger="sexpgpu.tn"):
        _run(stack, 4, resources=Resources(devices=2), backend="torch")
    text = caplog.text
    assert "SRC plan" in text and "devices=cpu:0,cpu:1" in text and "ranks=2" in text
    assert "SRC peaks, rank 0" in text and "SRC peaks, rank 1" in text


def test_torch_is_not_imported_by_the_numpy_sweep():
    import subprocess
    import sys

    code = (
        "import numpy as np, sys; from sexpgpu.tn import src, Resources;"
        "r = np.random.default_rng(0);"
        "psi = [r.standard_normal((2, 2))] + [r.standard_normal((2, 2, 2))] * 3 + "
        "[r.standard_normal((2, 2))];"
        "src(psi, chi_out=2, resources=Resources(devices=2)); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _complex64(rng, *shape):
    return torch.from_numpy((rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype("c8"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
def test_double_products_round_a_double_product_once(device):
    rng = np.random.default_rng(0)
    xp = TorchBackend(Device(device, 0), products="double")
    plain = TorchBackend(Device(device, 0), products="single")
    a, b = _complex64(rng, 600, 520).to(device), _complex64(rng, 520, 530).to(device)
    wide = torch.mm(a.to(torch.complex128), b.to(torch.complex128)).to(torch.complex64)
    assert torch.equal(xp.dot(a, b), wide) and not torch.equal(plain.dot(a, b), wide)
    x, y = torch.stack([a, 2 * a]), torch.stack([b, b])
    assert torch.equal(xp.matmul(x, y), torch.bmm(x.cdouble(), y.cdouble()).cfloat())
    # a small inner dimension, or another dtype: the plain product
    assert torch.equal(xp.dot(a[:, :100], b[:100]), torch.mm(a[:, :100], b[:100]))
    assert torch.equal(xp.dot(a.cdouble(), b.cdouble()), torch.mm(a.cdouble(), b.cdouble()))
    assert xp.product_slack(np.dtype("c8")) == PRODUCT_COPY_BYTES
    assert xp.product_slack(np.dtype("c16")) == plain.product_slack(np.dtype("c8")) == 0
    with pytest.raises(ValueError, match="products='split'"):
        TorchBackend(Device(device, 0), products="split")


def test_the_plan_reserves_the_product_slack():
    stack = make_stack("OS", 6, np.random.default_rng(1), np.complex64, chi=6, bond=3)
    st = normalize_stack(stack, "src", ["t0", "t1"])
    work, big = np.dtype("c8"), Budgets(1 << 40, 1 << 34, "gpu_memory", "host_memory", "x", False)
    for slack in (0, 1 << 20):
        plan = make_plan(st, 6, work, 1, big, slack)
        assert plan.work_device == make_plan(st, 6, work, 1, big).work_device + slack
    lean, _host = minimum_budgets(st, 6, work, 1, 1 << 20)
    assert lean == minimum_budgets(st, 6, work)[0] + (1 << 20)


def test_a_sweep_of_double_products_matches_the_exact_product(monkeypatch):
    stack = make_stack("OO", 6, np.random.default_rng(2), np.complex64, chi=6, bond=3)
    plain = _run(stack, 64, backend="torch")
    monkeypatch.setattr(backend_module, "_COPY_DIM", 1)  # every product of the toy sweep
    monkeypatch.setattr(engine, "TorchBackend", functools.partial(TorchBackend, products="double"))
    wide = _run(stack, 64, backend="torch")
    assert any(not np.array_equal(x, y) for x, y in zip(wide, plain, strict=True))
    assert rel_error(wide, dense_stack(stack)) < EXACT_TOL[np.complex64]


# ----- on a GPU (python -m pytest -m gpu tests/tn) ------------------------------------------


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", ["OS", "OO", "SOO", "OOS"])
def test_gpu_matches_cpu_and_the_exact_product(shape, dtype):
    stack = make_stack(shape, 8, np.random.default_rng(11), dtype, chi=8, bond=3)
    cpu = src(*stack, chi_out=6, seed=3, oversample=1.5)
    for device in ("gpu", "cuda"):
        gpu = src(*stack, chi_out=6, seed=3, oversample=1.5, device=device)
        assert all(type(o) is np.ndarray for o in gpu)
        _close(gpu, cpu, dtype)
    exact = src(*stack, chi_out=256, seed=3, device="gpu")
    assert rel_error(exact, dense_stack(stack)) < EXACT_TOL[dtype]


@pytest.mark.gpu
@cuda
def test_gpu_lazy_inputs_and_out_of_core_budgets_give_the_same_bits(tmp_path, caplog):
    stack = make_stack("OOS", 10, np.random.default_rng(2), np.complex128, chi=16, bond=3)
    mm = []
    for i, train in enumerate(stack):
        sites = []
        for j, site in enumerate(train):
            np.save(tmp_path / f"{i}-{j}.npy", site)
            sites.append(np.load(tmp_path / f"{i}-{j}.npy", mmap_mode="r"))
        mm.append(sites)
    large = src(*stack, chi_out=12, seed=0, device="gpu")
    st = normalize_stack(stack, "src", ["a", "b", "c"])
    device_least, host_least = minimum_budgets(st, 12, np.dtype(np.complex128))
    with caplog.at_level(logging.DEBUG, logger="sexpgpu.tn"):
        tiny = src(
            *mm,
            chi_out=12,
            seed=0,
            device="gpu",
            resources=Resources(
                gpu_memory=device_least, host_memory=host_least, scratch_dir=tmp_path / "scratch"
            ),
        )
    _same(large, tiny)
    assert "environments: disk" in caplog.text and "Z recomputed" in caplog.text
    assert "SRC peaks, rank 0: device" in caplog.text
    # pinned host memory, when there is room for it
    with caplog.at_level(logging.DEBUG, logger="sexpgpu.tn"):
        pinned = src(
            *stack,
            chi_out=12,
            seed=0,
            device="gpu",
            resources=Resources(gpu_memory=device_least, host_memory="1GiB"),
        )
    _same(large, pinned)
    assert "environments: host" in caplog.text
    with pytest.raises(MemoryError, match="gpu_memory budget"):
        src(*stack, chi_out=12, seed=0, device="gpu", resources=Resources(gpu_memory="1kB"))


@pytest.mark.gpu
@cuda
def test_gpu_devices_split_and_agree():
    count = torch.cuda.device_count()
    stack = make_stack("OOS", 9, np.random.default_rng(8), np.complex128, chi=10, bond=3)
    one = src(*stack, chi_out=7, seed=1, device="gpu")
    _same(src(*stack, chi_out=7, seed=1, device="gpu", resources=Resources(devices=1)), one)
    # several ranks on one GPU still exercise the gathers; real peers when there are several
    ids = list(range(count)) if count > 1 else None
    if ids:
        many = src(*stack, chi_out=7, seed=1, device="gpu", resources=Resources(devices=ids))
        _close(many, one, np.complex128)
    exact = src(*stack, chi_out=512, seed=1, device="gpu", resources=Resources(devices=ids or 1))
    assert rel_error(exact, dense_stack(stack)) < 1e-12


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("site", [2, 7], ids=["left-to-right", "last-right-to-left"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_gpu_refuses_a_non_finite_site_with_the_cpu_error(bad, site):
    stack = make_stack("OS", 8, np.random.default_rng(5), np.complex64, chi=8, bond=3)
    stack[1][site].flat[2] = bad
    with pytest.raises(ValueError) as on_cpu:
        src(*stack, chi_out=6, seed=0)
    with pytest.raises(ValueError) as on_gpu:
        src(*stack, chi_out=6, seed=0, device="gpu")  # checked by a sum on the device
    assert str(on_gpu.value) == str(on_cpu.value)
    assert f"(train 1, site {site}) holds 1 NaN or infinite value(s)" in str(on_gpu.value)


def test_a_gpus_precision_follows_how_fast_its_double_precision_runs(monkeypatch):
    gpu, fast = Device("cuda", 0), {}
    monkeypatch.setattr(backend_module, "wide_pays", lambda index: fast[index])
    fast[0] = True  # an H200: ZGEMM on the FP64 tensor cores, as fast as CGEMM
    assert backend_module.precision(gpu) == ("double", True)
    fast[0] = False  # FP64 at a small fraction of FP32: neither products nor Gram matrices
    assert backend_module.precision(gpu) == ("single", False)
    monkeypatch.setattr(backend_module, "GPU_PRODUCTS", "double")  # set: the products only
    assert backend_module.precision(gpu) == ("double", False)
    # the host never times anything: single products, double Gram matrices
    monkeypatch.setattr(backend_module, "wide_pays", lambda index: pytest.fail("timed"))
    assert backend_module.precision(Device("cpu", 0)) == ("single", True)


@pytest.mark.gpu
@cuda
def test_this_gpu_runs_complex64_products_in_double_no_slower_than_twice():
    """The GPUs the benchmarks ran on (H100, H200) keep the double products."""
    backend_module.wide_pays.cache_clear()
    assert backend_module.wide_pays(0), torch.cuda.get_device_name(0)
    assert TorchBackend(Device("cuda", 0)).products == ("double", True)
