"""The update-rule table: each backend's rule against the NumPy reference, and muon's own facts.

The torch rules run on PyTorch's CPU device here and on a GPU under ``-m gpu``
(there adamw is the one-launch Triton rule and muon's iteration runs in
bf16); the Triton rule also runs under Triton's interpreter in CI
(`tests/devices/test_adamw_kernel.py`).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sexpgpu.devices import update_numpy  # noqa: E402
from sexpgpu.devices.cuda import update_torch  # noqa: E402
from sexpgpu.devices.cuda.arrays import TorchOps  # noqa: E402
from sexpgpu.devices.cuda.stream import TorchStream  # noqa: E402
from sexpgpu.devices.optim import OPTIMIZERS, make_optimizer  # noqa: E402
from sexpgpu.devices.update_rules import UPDATE_RULES, scratch_bytes  # noqa: E402
from sexpgpu.lang.runs import optimizer_spec  # noqa: E402

# A hidden matrix each way round, an embedding-like matrix kept on AdamW, a vector.
SHAPES = {"wide": (4, 9), "tall": (12, 5), "embed": (7, 4), "bias": (5,)}
DECAY = {"wide": True, "tall": True, "embed": True, "bias": False}
HIDDEN = {"wide": True, "tall": True, "embed": False, "bias": False}
SPECS = {
    "sgd": optimizer_spec("sgd", lr=0.05, momentum=0.9, nesterov=True),
    "adamw": optimizer_spec("adamw", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
    "muon": optimizer_spec("muon", lr=0.02, adamw_lr=3e-3, weight_decay=0.1),
}


def test_every_optimizer_has_a_reference_and_a_torch_rule_and_a_case_here():
    for name in OPTIMIZERS:
        assert (name, "numpy") in UPDATE_RULES and (name, "torch") in UPDATE_RULES
    assert {backend for _, backend in UPDATE_RULES} == {"numpy", "torch", "triton"}
    assert set(SPECS) == set(OPTIMIZERS)


def _run(name: str, device: str | None, clip: float | None = 0.7, steps: int = 4):
    """`steps` steps of SHAPES' parameters; parameters and moments on the host.

    `device` None: the NumPy rules; else PyTorch's on that device. Each step's
    gradients enter with a factor `clip` over the step (a device scalar on torch).
    """
    rng = np.random.default_rng(5)
    host = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    draw = [{k: rng.normal(size=s) for k, s in SHAPES.items()} for _ in range(steps)]
    grads = [{k: v.astype(np.float32) for k, v in g.items()} for g in draw]
    if device is None:
        opt = make_optimizer(SPECS[name], SHAPES, DECAY, hidden=HIDDEN)
        up = np.array
    else:
        dev = torch.device(device)
        opt = make_optimizer(SPECS[name], SHAPES, DECAY, TorchOps(dev), TorchStream(dev), HIDDEN)
        up = lambda a: torch.from_numpy(np.array(a)).to(dev)  # noqa: E731
    params = {k: up(v) for k, v in host.items()}
    for t, g in enumerate(grads):
        scale = None if clip is None else clip / (t + 1)
        if device is not None and scale is not None:
            scale = torch.tensor(scale, device=device)
        opt.advance(opt.options["lr"] * (1 - 0.1 * t))
        opt.queue(params, {k: up(v) for k, v in g.items()}, scale)
    out = {k: opt.xp.download(v) for k, v in params.items()}
    return out, {k: opt.xp.download(v) for k, v in opt.tensors().items()}


@pytest.mark.parametrize("clip", [None, 0.7])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_torch_rule_updates_as_the_reference_on_the_cpu(name, clip):
    got, got_moments = _run(name, "cpu", clip)
    want, want_moments = _run(name, None, clip)
    assert set(got_moments) == set(want_moments)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
        assert not np.array_equal(want[k], _run(name, None, clip, steps=0)[0][k])  # it moved
    for k in want_moments:
        np.testing.assert_allclose(got_moments[k], want_moments[k], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_cuda_rules_update_as_the_reference(name):
    # On a GPU adamw is the one-launch Triton rule, and muon's iteration runs in
    # bf16: its matrices agree to bf16's rounding of the orthogonalized step.
    got, got_moments = _run(name, "cuda")
    want, want_moments = _run(name, None)
    atol = 2e-3 if name == "muon" else 1e-6
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=atol)
    for k in want_moments:
        np.testing.assert_allclose(got_moments[k], want_moments[k], rtol=1e-5, atol=atol)


def test_muon_keeps_momentum_for_matrices_and_adam_moments_for_the_rest():
    _, moments = _run("muon", None)
    assert sorted(moments) == [
        "exp_avg/bias", "exp_avg/embed", "exp_avg_sq/bias", "exp_avg_sq/embed",
        "momentum/tall", "momentum/wide",
    ]  # fmt: skip
    assert OPTIMIZERS["muon"].arrays_per_param() == 2


@pytest.mark.parametrize("shape", [(6, 20), (20, 6), (8, 8)])
def test_newton_schulz_brings_every_singular_value_near_one(shape):
    rng = np.random.default_rng(0)
    g = rng.normal(size=shape).astype(np.float32) * np.float32(30.0)
    o = update_numpy.newton_schulz(g, 5)
    s = np.linalg.svd(o, compute_uv=False)
    assert o.shape == g.shape and o.dtype == np.float32
    assert s.min() > 0.6 and s.max() < 1.25  # the quintic's band, not exactly 1
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    assert np.abs(o - u @ vt).max() < 0.35  # about the polar factor
    torch_o = update_torch.newton_schulz(torch.from_numpy(g)[None], 5)[0].numpy()
    np.testing.assert_allclose(torch_o, o, rtol=1e-4, atol=1e-5)


def test_muons_first_step_is_the_scaled_orthogonal_factor_of_the_gradient():
    # buf = g, nesterov: u = g + mu g, and the iteration does not see the factor (1 + mu).
    rng = np.random.default_rng(1)
    p0 = rng.normal(size=(4, 9)).astype(np.float32)
    g = rng.normal(size=(4, 9)).astype(np.float32)
    spec = optimizer_spec("muon", lr=0.02)
    opt = make_optimizer(spec, {"w": (4, 9)}, {"w": True}, hidden={"w": True})
    p = {"w": p0.copy()}
    opt.advance(0.02)
    opt.queue(p, {"w": g.copy()})
    want = p0 - 0.02 * np.sqrt(9 / 4) * update_numpy.newton_schulz(g, 5)
    np.testing.assert_allclose(p["w"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "spec",
    [
        optimizer_spec("sgd", lr=1e-2, momentum=0.9, nesterov=True),
        optimizer_spec("adamw", lr=1e-2, weight_decay=0.1),
        optimizer_spec("muon", lr=1e-2, nesterov=True),
    ],
    ids=lambda s: s.name,
)
def test_an_update_holds_no_more_than_its_rule_counts(spec):
    # The memory plan counts an update's temporaries from its rule's entry in
    # UPDATE_SCRATCH; here the rule's storages are metered on PyTorch's CPU device.
    # One gradient arrives transposed (as a tied embedding's does op by op).
    from cpu_bytes import counting

    shapes = {"a": (64, 96), "b": (64, 96), "c": (96, 32), "e": (128, 64), "v": (96,)}
    hidden = {k: len(s) == 2 and k != "e" for k, s in shapes.items()}
    cpu = torch.device("cpu")
    xp, stream = TorchOps(cpu), TorchStream(cpu)
    opt = make_optimizer(spec, shapes, dict(hidden), xp, stream, hidden)
    rng = np.random.default_rng(0)
    params = {k: torch.from_numpy(rng.standard_normal(s, np.float32)) for k, s in shapes.items()}
    grads = {k: torch.from_numpy(rng.standard_normal(s, np.float32)) for k, s in shapes.items()}
    grads["e"] = grads["e"].T.contiguous().T  # the parameter's shape in another layout
    scale = torch.tensor(0.5)
    opt.advance(1e-2)
    opt.queue(params, grads, scale)  # the moments made
    with counting() as meter, meter.measuring():
        opt.advance(1e-2)
        opt.queue(params, grads, scale)
    counted = scratch_bytes(spec.name, xp.backends, list(shapes.values()))
    assert 0 < meter.peak <= counted + 64  # a few device scalars aside
