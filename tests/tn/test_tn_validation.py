"""Every malformed call raises TypeError or ValueError naming where and how to fix it."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import quimb.tensor as qtn
import src_method
import torch
from quimb.tensor.tnag.core import tensor_network_apply_op_vec
from tn_helpers import dense_stack, random_mpo, random_mps, rel_error

from sexpgpu.tn import Resources, apply, compress, src
from sexpgpu.tn.resources import parse_bytes

N = 5


def _mpo(**kw):
    return random_mpo(N, 2, np.random.default_rng(0), **kw)


def _mps(**kw):
    return random_mps(N, 4, np.random.default_rng(1), **kw)


def _bad_bond():
    a = _mpo()
    a[2] = np.zeros((3, 2, 2, 2))  # left bond 3, site 1 has right bond 2
    return a


def _periodic_mps():
    return [np.ones((2, 2, 2)) for _ in range(N)]


def _periodic_mpo():
    return [np.ones((2, 2, 2, 2)) for _ in range(N)]


def _bad_rank():
    a = _mpo()
    a[2] = a[2][..., 0]
    return a


def _phys3():
    return random_mps(N, 4, np.random.default_rng(1), phys=3)


# (id, call on a library module, exception, words the message must hold,
#  whether src-method 0.5.0 raises the same type)
CASES = [
    ("chi_float", lambda m: m.apply(_mpo(), _mps(), 2.5), TypeError, ["chi_out"], True),
    ("chi_str", lambda m: m.compress(_mps(), "8"), TypeError, ["chi_out"], True),
    ("chi_bool", lambda m: m.compress(_mps(), True), TypeError, ["chi_out"], True),
    ("chi_zero", lambda m: m.apply(_mpo(), _mps(), 0), ValueError, ["chi_out"], True),
    ("chi_neg", lambda m: m.src(_mps(), chi_out=-3), ValueError, ["chi_out"], True),
    ("cutoff_one", lambda m: m.compress(_mps(), 4, cutoff=1.0), ValueError, ["cutoff"], True),
    ("cutoff_neg", lambda m: m.compress(_mps(), 4, cutoff=-0.1), ValueError, ["cutoff"], True),
    ("cutoff_str", lambda m: m.compress(_mps(), 4, cutoff="0"), ValueError, ["cutoff"], True),
    (
        "over_small",
        lambda m: m.compress(_mps(), 4, oversample=0.5),
        ValueError,
        ["oversample"],
        True,
    ),
    (
        "over_inf",
        lambda m: m.compress(_mps(), 4, oversample=float("inf")),
        ValueError,
        ["oversample"],
        True,
    ),
    (
        "over_nan",
        lambda m: m.compress(_mps(), 4, oversample=float("nan")),
        ValueError,
        ["oversample"],
        True,
    ),
    ("empty_stack", lambda m: m.src(chi_out=4), ValueError, ["empty"], True),
    (
        "lengths",
        lambda m: m.src(_mpo(), random_mps(4, 4, np.random.default_rng(1)), chi_out=4),
        ValueError,
        ["trains[1]", "train 1", "4 sites", "5"],
        True,
    ),
    (
        "legs",
        lambda m: m.apply(_mpo(), _phys3(), 4),
        ValueError,
        ["left_tensor", "train 0", "site 0", "d=2", "u=3"],
        True,
    ),
    (
        "bonds",
        lambda m: m.src(_mpo(), _bad_bond(), _mps(), chi_out=4),
        ValueError,
        ["trains[1]", "train 1", "site 1", "right bond 2", "left bond 3"],
        False,
    ),
    (
        "mps_middle",
        lambda m: m.src(_mpo(), _mps(), _mpo(), chi_out=4),
        TypeError,
        ["trains[1]", "train 1", "middle"],
        True,
    ),
    (
        "mps_both_ends",
        lambda m: m.src(_mps(), _mpo(), _mps(), chi_out=4),
        TypeError,
        ["both ends"],
        True,
    ),
    (
        "closed_mps",
        lambda m: m.compress(_periodic_mps(), 4),
        ValueError,
        ["tensor", "train 0", "site 1", "periodic"],
        True,
    ),
    (
        "closed_mpo",
        lambda m: m.src(_mpo(), _periodic_mpo(), chi_out=4),
        TypeError,
        ["trains[1]", "train 1", "site 0", "periodic"],
        True,
    ),
    (
        "bad_rank",
        lambda m: m.apply(_mpo(), _bad_rank(), 4),
        ValueError,
        ["right_tensor", "train 1", "site 2", "rank 3"],
        False,
    ),
    ("device", lambda m: m.compress(_mps(), 4, device="tpu"), ValueError, ["device", "tpu"], True),
    (
        "mps_left_in_apply",
        lambda m: m.apply(_mps(), _mpo(), 4),
        TypeError,
        ["left_tensor", "MPO"],
        True,
    ),
    (
        "quimb_lazy_network",
        lambda m: m.compress(
            tensor_network_apply_op_vec(
                qtn.MPO_rand(N, 2), qtn.MPS_rand_state(N, 3), contract=False
            ),
            4,
        ),
        TypeError,
        ["tensor", "train 0", "lazy network", "compress_network"],
        False,
    ),
    (
        "quimb_network_not_a_train",
        lambda m: m.compress(qtn.TensorNetwork([qtn.rand_tensor((2, 2), "ab")]), 4),
        TypeError,
        ["tensor", "train 0", ".arrays"],
        False,
    ),
    (
        "float16_sites",
        lambda m: m.compress([t.astype(np.float16) for t in _mps()], 4),
        TypeError,
        ["tensor", "train 0", "site 0", "float16", "float32"],
        False,
    ),
    (
        "bfloat16_torch_sites",
        lambda m: m.compress([torch.from_numpy(t).bfloat16() for t in _mps()], 4),
        TypeError,
        ["tensor", "train 0", "site 0", "bfloat16", "float32"],
        False,
    ),
    (
        "float16_dtype",
        lambda m: m.compress(_mps(), 4, dtype=np.float16),
        ValueError,
        ["dtype=float16", "np.float32"],
        False,
    ),
    ("seed_str", lambda m: m.compress(_mps(), 4, seed="abc"), TypeError, ["seed", "'abc'"], True),
    ("seed_negative", lambda m: m.compress(_mps(), 4, seed=-1), ValueError, ["seed", "-1"], True),
    (
        "site_without_shape",
        lambda m: m.compress([*_mps()[:2], [[1.0]], *_mps()[3:]], 4),
        TypeError,
        ["tensor", "train 0", "site 2"],
        False,
    ),
    (
        "one_site",
        lambda m: m.compress([np.ones((2, 2))], 4),
        ValueError,
        ["one site"],
        True,
    ),
    (
        "empty_train",
        lambda m: m.compress([], 4),
        ValueError,
        ["tensor", "train 0", "no sites"],
        False,
    ),
    (
        "sketch_dtype",
        lambda m: m.compress(_mps(), 4, dtype=np.int32),
        ValueError,
        ["dtype", "floating"],
        False,
    ),
    (
        "resources_type",
        lambda m: m.compress(_mps(), 4, resources="36GB"),
        TypeError,
        ["resources", "Resources("],
        False,
    ),
]


@pytest.mark.parametrize(("case", "call", "error", "words", "_"), CASES, ids=[c[0] for c in CASES])
def test_malformed_calls_raise_with_a_located_message(case, call, error, words, _):
    with pytest.raises(error) as info:
        call(_sexpgpu_tn())
    message = str(info.value)
    for word in words:
        assert word in message, f"{case}: {word!r} not in {message!r}"
    assert type(info.value) is error


PARITY = [c for c in CASES if c[4]]


@pytest.mark.parametrize(("case", "call", "error", "_w", "_p"), PARITY, ids=[c[0] for c in PARITY])
def test_src_method_raises_the_same_exception_type(case, call, error, _w, _p):
    with pytest.raises(error):
        call(src_method)


def _sexpgpu_tn():
    import sexpgpu.tn

    return sexpgpu.tn


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_gpu_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"device='gpu'.*torch.cuda.is_available\(\)"):
        compress(_mps(), 4, device="gpu")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("36GB", 36 * 10**9),
        ("36GiB", 36 * 2**30),
        ("1.5 kib", 1536),
        ("512", 512),
        ("7B", 7),
        (10**6, 10**6),
    ],
)
def test_byte_strings(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "word"),
    [
        ({"host_memory": "lots"}, ValueError, "host_memory"),
        ({"gpu_memory": "36 GX"}, ValueError, "gpu_memory"),
        ({"host_memory": -1}, ValueError, "host_memory"),
        ({"host_memory": 1.5}, TypeError, "host_memory"),
        ({"devices": 0}, ValueError, "devices"),
        ({"devices": [0, 0]}, ValueError, "devices"),
        ({"devices": "0,1"}, TypeError, "devices"),
        ({"scratch_dir": 3}, TypeError, "scratch_dir"),
    ],
)
def test_resources_validation(kwargs, error, word):
    with pytest.raises(error, match=word):
        Resources(**kwargs)


def test_resources_from_src_method_are_accepted(tmp_path):
    theirs = src_method.Resources(host_memory="1GiB", scratch_dir=tmp_path)
    out = compress(_mps(), 3, seed=0, resources=theirs)
    assert max(o.shape[0] for o in out[1:]) <= 3


def test_logging_is_silent_by_default_and_debug_shows_the_passes(caplog, capsys):
    logger = logging.getLogger("sexpgpu.tn")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    with caplog.at_level(logging.DEBUG, logger="sexpgpu.tn"):
        src(_mpo(), _mps(), chi_out=3, seed=0, oversample=2.0)
    text = caplog.text
    for phrase in ("SRC plan", "left-to-right pass", "right-to-left pass", "truncation pass"):
        assert phrase in text
    assert all(r.name.startswith("sexpgpu.tn") for r in caplog.records)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_numpy_integer_chi_out_and_keywords_match_src_method():
    a = apply(left_tensor=_mpo(), right_tensor=_mps(), chi_out=np.int64(3), seed=1)
    b = compress(tensor=_mps(), chi_out=np.int32(3), seed=1)
    assert a[1].shape[1] <= 3 and b[1].shape[1] <= 3


@pytest.mark.parametrize("site", [2, 3], ids=["read-left-to-right", "last-read-right-to-left"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_site_is_refused_not_propagated(bad, site):
    rng = np.random.default_rng(0)
    psi = [rng.random((4, 2)), rng.random((4, 4, 2)), rng.random((4, 4, 2)), rng.random((4, 2))]
    psi[site].flat[3] = bad
    with pytest.raises(ValueError) as info:
        compress(psi, 2, seed=0)
    assert str(info.value).startswith(
        f"compress: tensor (train 0, site {site}) holds 1 NaN or infinite value(s)"
    )


def test_finite_sites_whose_sum_overflows_are_accepted():
    from sexpgpu.tn.trains import Layer

    big = np.full((4, 2), 1e308)  # the quick check's sum overflows; every entry is finite
    layer = Layer([big, np.ones((4, 4, 2)), np.ones((4, 2))], "mps")
    assert np.array_equal(layer.read(0)[0, :, :, 0], big)


def test_a_chi_out_above_every_cut_rank_is_exact_and_costs_the_ranks():
    # quimb users ask for "no truncation" with a huge bond; the sketch is capped
    # at the largest rank a cut can have (here 48: the bonds 16 and 3 crossing it)
    rng = np.random.default_rng(3)
    psi, op = random_mps(12, 16, rng), random_mpo(12, 3, rng)
    exact = dense_stack([op, psi])
    for chi_out in (10**9, 2**62):
        cores = apply(op, psi, chi_out, seed=1)
        assert rel_error(cores, exact) < 1e-12
        for got, want in zip(cores, apply(op, psi, 48, seed=1), strict=True):
            np.testing.assert_array_equal(got, want)  # the same sketch: 48 columns
