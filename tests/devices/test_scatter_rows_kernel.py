"""The ordered scatter of rows (`sexpgpu.devices.cuda.scatter_rows`): the interpreter's sums.

Under Triton's interpreter on the CPU (a pytest of its own with
``TRITON_INTERPRET`` set, as `test_xent_kernel` does); on a GPU (``-m gpu``)
the compiled kernel, deterministic mode on, at an embedding's size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_interpreted import interpreted_only, run_interpreted

from sexpgpu.devices.cuda import scatter_rows

pytest.importorskip("triton")
HAS_CUDA = torch.cuda.is_available()


def test_the_kernel_under_the_interpreter():
    run_interpreted(__file__)


def _ordered(ids: np.ndarray, rows: np.ndarray, count: int) -> np.ndarray:
    """Each id's rows added in the order they come: the cpu interpreter's order."""
    out = np.zeros((count, rows.shape[1]), rows.dtype)
    np.add.at(out, ids, rows)
    return out


def _case(n: int, width: int, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, count, (n,), generator=gen, dtype=torch.int32)
    ids[: n // 3] = count - 1  # one id many times, one run of a sort
    rows = torch.randn(n, width, generator=gen) * torch.logspace(-3, 3, n)[:, None]
    return ids, rows


@interpreted_only
@pytest.mark.parametrize("n,width,count", [(1, 5, 3), (40, 130, 7), (64, 128, 64), (33, 1, 50)])
def test_the_kernel_adds_in_the_order_rows_came(n, width, count):
    ids, rows = _case(n, width, count, seed=n + width)
    out = torch.full((count, width), float("nan"))
    out.zero_()
    scatter_rows.launch(ids, rows, out)
    want = _ordered(ids.numpy(), rows.numpy(), count)
    assert np.array_equal(out.numpy(), want)  # bits: the same order, the same rounding


@interpreted_only
def test_a_strided_block_of_rows_and_no_rows():
    ids, rows = _case(20, 300, 9, seed=1)
    wide = torch.zeros(20, 310)
    wide[:, 5:305] = rows
    out = torch.zeros(9, 300)
    scatter_rows.launch(ids, wide[:, 5:305], out)
    assert np.array_equal(out.numpy(), _ordered(ids.numpy(), rows.numpy(), 9))
    empty = torch.zeros(4, 3)
    scatter_rows.launch(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3), empty)
    assert not empty.any()


def test_the_op_on_the_cpu_is_index_add():
    ids, rows = _case(50, 17, 6, seed=3)
    got = torch.ops.sexpgpu.scatter_rows(ids.long(), rows, 6)
    want = torch.zeros(6, 17).index_add_(0, ids.long(), rows)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_the_compiled_kernel_gives_the_same_bits_every_call():
    ids, rows = _case(16384, 768, 50304, seed=0)
    ids[::7] = 220  # a frequent token: one long run
    ids, rows = ids.cuda().long(), rows.cuda()
    want = _ordered(ids.cpu().numpy(), rows.cpu().numpy(), 50304)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        outs = [torch.ops.sexpgpu.scatter_rows(ids, rows, 50304) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(was)
    for out in outs:
        assert np.array_equal(out.cpu().numpy(), want)
