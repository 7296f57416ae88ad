"""AdamW in one launch (`sexpgpu.devices.cuda.adamw`) against the NumPy reference rule.

Under Triton's interpreter on the CPU: Triton reads ``TRITON_INTERPRET``
when it is first imported, so the cases run in a pytest of their own with it
set (`test_the_kernel_under_the_interpreter`); in this process they skip.
On a GPU (``-m gpu``) the cuda device's update is checked the same way.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_interpreted import interpreted_only, run_interpreted

from sexpgpu.devices.arrays import NUMPY
from sexpgpu.devices.cuda import adamw
from sexpgpu.devices.stream import HostStream
from sexpgpu.devices.update_rules import UPDATE_RULES, Update

pytest.importorskip("triton")
HAS_CUDA = torch.cuda.is_available()
SHAPES = [(3, 50), (7,), (130,), (1,)]  # across blocks of 64, with tails


def test_the_kernel_under_the_interpreter():
    run_interpreted(__file__)


def _reference(params, grads, m, v, lr, step, scale, wd) -> None:
    """The NumPy rule of one AdamW step (every parameter decayed by `wd`)."""
    n = len(params)
    options = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd}
    moments = {"exp_avg": m, "exp_avg_sq": v}
    numbers = {"lr": lr, "step": step}
    update = Update(params, grads, moments, [True] * n, [False] * n, numbers, scale, options,
                    NUMPY, HostStream())  # fmt: skip
    UPDATE_RULES["adamw", "numpy"](update)


def _launch(tables):
    def call(params, grads, m, v, lr, step, scale, wd) -> None:
        numbers = adamw.Numbers(lr, step, scale, 0.9, 0.95, 1e-8)
        adamw.launch(tables, params, grads, m, v, numbers, wd)

    return call


def _steps(update, device, clip: float | None, wd: float):
    """Three AdamW steps of SHAPES' parameters through `update`; the arrays on the host."""
    rng = np.random.default_rng(0)
    host = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    grads = [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(3)]
    state = [host, *([np.zeros(s, np.float32) for s in SHAPES] for _ in range(2))]
    if device is not None:
        state = [[torch.from_numpy(a.copy()).to(device) for a in arrays] for arrays in state]
    for t, gs in enumerate(grads, 1):
        if device is not None:
            gs = [torch.from_numpy(g).to(device) for g in gs]
        lr, step, scale = 1e-2 * t, float(t), clip
        if device is not None:
            lr, step = (torch.tensor(x, dtype=torch.float32, device=device) for x in (lr, step))
            scale = None if clip is None else torch.tensor(clip, device=device)
        update(state[0], gs, state[1], state[2], lr, step, scale, wd)
    return [[np.asarray(a.cpu() if device is not None else a) for a in arrays] for arrays in state]


@interpreted_only
@pytest.mark.parametrize("clip", [None, 0.3])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_one_launch_updates_as_the_cpu_device(monkeypatch, clip, wd):
    monkeypatch.setattr(adamw, "BLOCK", 64)
    evictions = []
    tables = adamw.Tables(evicted=lambda: evictions.append(1), capacity=2)
    got = _steps(_launch(tables), torch.device("cpu"), clip, wd)
    want = _steps(_reference, None, clip, wd)
    for ours, theirs in zip(got, want, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
    # Three steps' new gradients: three tables, the oldest dropped (and said).
    assert len(tables._made) == 2 and evictions == [1]


def _copies_written(device: torch.device) -> tuple[list, list]:
    """One step of SHAPES' parameters, all but the last with a bf16 copy: (params, copies)."""
    tables = adamw.Tables(evicted=lambda: None)
    rng = np.random.default_rng(1)
    params, grads = (
        [torch.from_numpy(rng.normal(size=s).astype(np.float32)).to(device) for s in SHAPES]
        for _ in range(2)
    )
    moments = [[torch.zeros(s, device=device) for s in SHAPES] for _ in range(2)]
    copies = [torch.zeros(s, dtype=torch.bfloat16, device=device) for s in SHAPES[:-1]] + [None]
    one = torch.ones((), device=device)
    numbers = adamw.Numbers(one * 0.1, one, None, 0.9, 0.95, 1e-8)
    adamw.launch(tables, params, grads, *moments, numbers, 0.0, copies)
    return params[:-1], copies[:-1]


@interpreted_only
def test_one_launch_writes_the_bf16_copies():
    # The interpreter rounds toward zero (a GPU to nearest even, the GPU case below).
    for p, c in zip(*_copies_written(torch.device("cpu")), strict=True):
        torch.testing.assert_close(c.float(), p, rtol=2**-7, atol=0)


@interpreted_only
def test_past_the_room_only_the_two_newest_tables_are_kept(monkeypatch):
    # Large models' tables run to hundreds of MiB, and a step without a CUDA graph
    # makes new gradients, so a new table, every step.
    monkeypatch.setattr(adamw, "BLOCK", 64)
    evictions = []
    tables = adamw.Tables(evicted=lambda: evictions.append(1), room=0)
    _steps(_launch(tables), torch.device("cpu"), None, 0.0)
    assert len(tables._made) == 2 and evictions == [1]


@interpreted_only
def test_the_same_arrays_keep_their_table():
    evictions = []
    tables = adamw.Tables(evicted=lambda: evictions.append(1), capacity=1)
    arrays = [[torch.zeros(s) for s in SHAPES] for _ in range(4)]
    one = torch.ones(())
    for _ in range(2):
        adamw.launch(tables, *arrays, adamw.Numbers(one, one, None, 0.9, 0.95, 1e-8), 0.0)
    assert len(tables._made) == 1 and not evictions


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("clip", [None, 0.3])
def test_the_cuda_device_updates_in_one_launch_as_the_cpu_device(clip):
    from sexpgpu.devices.cuda.arrays import TorchOps
    from sexpgpu.devices.cuda.stream import TorchStream

    xp, stream = TorchOps(torch.device("cuda")), TorchStream(torch.device("cuda"))
    assert xp.backends[0] == "triton"

    def rule(params, grads, m, v, lr, step, scale, wd) -> None:
        n = len(params)
        options = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd}
        moments = {"exp_avg": m, "exp_avg_sq": v}
        numbers = {"lr": lr, "step": step}
        update = Update(params, grads, moments, [True] * n, [False] * n, numbers, scale, options,
                        xp, stream)  # fmt: skip
        UPDATE_RULES["adamw", "triton"](update)

    got = _steps(rule, torch.device("cuda"), clip, 0.1)
    want = _steps(_reference, None, clip, 0.1)
    for ours, theirs in zip(got, want, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_the_bf16_copies_are_the_casts_on_a_gpu():
    for p, c in zip(*_copies_written(torch.device("cuda")), strict=True):
        assert torch.equal(c, p.to(torch.bfloat16))  # rounded to nearest even, as the cast


def test_the_plan_counts_a_launch_table_as_it_is_made():
    # The memory plan's workspace counts two tables by `table_bytes`.
    sizes = [1, 511, 512, 513, 5000]
    arrays = [[torch.zeros(n) for n in sizes] for _ in range(4)]
    table = adamw.Tables(evicted=lambda: None)(arrays, [None] * len(sizes))
    assert table.nbytes == adamw.table_bytes(sizes)
