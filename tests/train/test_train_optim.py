import math

import numpy as np
import pytest
import torch

from sexpgpu.devices.arrays import NUMPY
from sexpgpu.devices.optim import global_norm, make_optimizer
from sexpgpu.errors import SexpgpuError
from sexpgpu.lang.runs import optimizer_spec, schedule_spec
from sexpgpu.train.schedules import make_schedule

SHAPES = {"w": (5, 3), "b": (3,)}
DECAY = {"w": True, "b": False}


def _start(seed=0):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [
        {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(6)
    ]
    return params, grads


def _torch_run(params, grads, make, lrs):
    tp = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    opt = make(tp)
    for g, lr in zip(grads, lrs, strict=True):
        for group in opt.param_groups:
            group["lr"] = lr
        for k, p in tp.items():
            p.grad = torch.tensor(g[k])
        opt.step()
    return {k: p.detach().numpy() for k, p in tp.items()}


def _step(opt, params, grads, lr, scale=None):
    opt.advance(lr)
    opt.queue(params, grads, scale)


def _ours(spec, params, grads, lrs):
    params = {k: v.copy() for k, v in params.items()}
    opt = make_optimizer(spec, SHAPES, DECAY)
    for g, lr in zip(grads, lrs, strict=True):
        _step(opt, params, {k: v.copy() for k, v in g.items()}, lr)
    return params, opt


def test_adamw_matches_torch_with_decay_skipping_vectors():
    params, grads = _start()
    lrs = [1e-2, 2e-2, 3e-2, 3e-2, 1e-2, 5e-3]
    spec = optimizer_spec("adamw", lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, _ = _ours(spec, params, grads, lrs)

    def make(tp):
        groups = [
            {"params": [tp["w"]], "weight_decay": 0.1},
            {"params": [tp["b"]], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=3e-2, betas=(0.9, 0.95), eps=1e-8)

    ref = _torch_run(params, grads, make, lrs)
    for k in SHAPES:
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-6, atol=1e-6)
    # the vector moved only by Adam, the matrix also decayed: both differ from the start
    assert not np.allclose(ours["b"], params["b"])


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_matches_torch(nesterov):
    params, grads = _start(1)
    lrs = [0.1] * 6
    spec = optimizer_spec("sgd", lr=0.1, momentum=0.9, nesterov=nesterov)
    ours, opt = _ours(spec, params, grads, lrs)
    ref = _torch_run(
        params,
        grads,
        lambda tp: torch.optim.SGD(list(tp.values()), lr=0.1, momentum=0.9, nesterov=nesterov),
        lrs,
    )
    for k in SHAPES:
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-6, atol=1e-6)
    assert opt.scalars()["steps"] == 6


def test_optimizer_state_round_trips():
    params, grads = _start(2)
    spec = optimizer_spec("adamw", lr=1e-2)
    a, opt = _ours(spec, params, grads[:3], [1e-2] * 3)
    b = make_optimizer(spec, SHAPES, DECAY)
    b.load(opt.tensors(), opt.scalars())
    pa, pb = {k: v.copy() for k, v in a.items()}, {k: v.copy() for k, v in a.items()}
    _step(opt, pa, grads[3], 1e-2)
    _step(b, pb, grads[3], 1e-2)
    for k in SHAPES:
        assert np.array_equal(pa[k], pb[k])


def test_clip_matches_torch_and_reports_the_norm_before():
    _, grads = _start(3)
    g = grads[0]
    norm_before = global_norm(g)
    tg = [torch.tensor(v) for v in g.values()]
    ps = [torch.nn.Parameter(torch.zeros_like(t)) for t in tg]
    for p, t in zip(ps, tg, strict=True):
        p.grad = t.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ps, 0.5)
    clipped = {k: v.copy() for k, v in g.items()}
    scale = NUMPY.clip_scale(NUMPY.norm(list(clipped.values())), 0.5)
    NUMPY.multiply(list(clipped.values()), scale)
    assert norm_before == pytest.approx(float(ref_norm), rel=1e-6)
    for p, v in zip(ps, clipped.values(), strict=True):
        np.testing.assert_allclose(v, p.grad.numpy(), rtol=1e-6)
    assert global_norm(clipped) == pytest.approx(0.5, rel=1e-5)
    small = {k: v * 1e-3 for k, v in g.items()}
    assert NUMPY.clip_scale(NUMPY.norm(list(small.values())), 0.5) is None  # nothing to clip


def test_schedules_follow_the_documented_formulas():
    cos = make_schedule(schedule_spec("cosine", warmup=4, floor=0.1), 1.0, 14)
    assert [cos(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos(4) == pytest.approx(1.0)
    assert cos(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(14) == pytest.approx(0.1)
    lin = make_schedule(schedule_spec("linear", floor=0.0), 2.0, 10)
    assert [lin(s) for s in (0, 5, 10)] == pytest.approx([2.0, 1.0, 0.0])
    const = make_schedule(schedule_spec("constant"), 3e-4, 10)
    assert {const(s) for s in range(10)} == {3e-4}


def test_specs_made_in_python_take_the_languages_defaults():
    assert dict(optimizer_spec("adamw", lr=1e-3).options) == {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    assert dict(schedule_spec("cosine").options) == {"warmup": 0, "floor": 0.0}


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: optimizer_spec("adam", lr=1e-3), "unknown optimizer `adam`"),
        (lambda: optimizer_spec("sgd", lr=0.1, beta=0.9), "sgd takes no option `beta`"),
        (lambda: optimizer_spec("sgd"), "sgd needs `lr`"),
        (lambda: schedule_spec("cosin"), "unknown schedule `cosin`"),
        (lambda: schedule_spec("constant", warmup=3), "constant takes no option `warmup`"),
    ],
)
def test_bad_specs_made_in_python_are_refused(make, fragment):
    with pytest.raises(SexpgpuError) as info:
        make()
    assert info.value.code.startswith("E-FORM-")
    assert fragment in info.value.message


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("ops", ["numpy", "torch"])
def test_the_clip_factor_given_to_the_step_equals_clipping_first(ops, name):
    # torch's optimizer after clip_grad_norm_, against one step given the factor
    # (AdamW folds it into its kernel; on torch it is a device scalar).
    from sexpgpu.devices.cuda.arrays import TorchOps
    from sexpgpu.devices.cuda.stream import TorchStream

    xp = NUMPY if ops == "numpy" else TorchOps(torch.device("cpu"))
    stream = None if ops == "numpy" else TorchStream(torch.device("cpu"))
    params, grads = _start(4)
    if name == "adamw":
        spec = optimizer_spec("adamw", lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        spec = optimizer_spec("sgd", lr=3e-2, momentum=0.9)
    opt = make_optimizer(spec, SHAPES, DECAY, xp, stream)
    ours = {k: xp.upload(v) for k, v in params.items()}
    tp = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    if name == "adamw":
        groups = [{"params": [tp["w"]], "weight_decay": 0.1}]
        groups.append({"params": [tp["b"]], "weight_decay": 0})
        ref = torch.optim.AdamW(groups, lr=3e-2, betas=(0.9, 0.95))
    else:
        ref = torch.optim.SGD(list(tp.values()), lr=3e-2, momentum=0.9)
    for g in grads[:3]:
        grads = {k: xp.upload(v) for k, v in g.items()}
        scale = xp.clip_scale(xp.norm(list(grads.values())), 0.5)
        assert float(scale) < 0.5  # the clip binds
        _step(opt, ours, grads, 3e-2, scale)
        for k, p in tp.items():
            p.grad = torch.tensor(g[k])
        torch.nn.utils.clip_grad_norm_(list(tp.values()), 0.5)
        ref.step()
    for k in SHAPES:
        np.testing.assert_allclose(xp.download(ours[k]), tp[k].detach().numpy(), rtol=1e-5)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
        ),
    ],
)
def test_adamw_takes_a_gradient_in_another_layout_than_its_parameter(device):
    # Op by op, a tied embedding's gradient comes out of its product transposed.
    from sexpgpu.devices.cuda.arrays import TorchOps
    from sexpgpu.devices.cuda.stream import TorchStream

    xp, stream = TorchOps(torch.device(device)), TorchStream(torch.device(device))
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(6, 4, generator=gen)
    grad = torch.randn(4, 6, generator=gen).to(device).t()  # strides (1, 6)
    spec = optimizer_spec("adamw", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    results = []
    for g in (grad, grad.contiguous()):
        opt = make_optimizer(spec, {"w": (6, 4)}, {"w": True}, xp, stream)
        p = {"w": param.clone().to(device)}
        _step(opt, p, {"w": g}, 1e-2)
        results.append(p["w"].cpu())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
