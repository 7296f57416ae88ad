"""`scatter_rows`: rows summed into a table by id, the same bits every run.

The gradient of an embedding is such a sum. PyTorch's ``index_add_`` on a
GPU adds with atomics, and its deterministic ``index_put_`` was measured on
an H200 (benches/README.md) to give runs that differ in a few rows of the
embedding gradients now and then. Where runs are deterministic
(`sexpgpu.devices.cuda.process`), the op sorts the ids (stably, so each
id's rows keep the order they came in) and one program per id and block of
columns sums its rows in that order (`scatter_rows_kernel`): the order the
cpu interpreter adds them in. Elsewhere, and on the CPU, ``index_add_``.
"""

from __future__ import annotations

import torch

from sexpgpu.devices.cuda.triton_support import available, kernel

__all__ = ["launch", "scatter_rows"]

BLOCK = 128  # columns a program sums


@torch.library.custom_op("sexpgpu::scatter_rows", mutates_args=())
def scatter_rows(ids: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    """A ``[count, width]`` table (of `rows`' dtype) whose row i sums the `rows` whose id is i."""
    return _in_torch(ids, rows, count)


@scatter_rows.register_fake
def _(ids, rows, count):
    return rows.new_empty((count, rows.shape[1]))


@scatter_rows.register_kernel("cuda")
def _(ids, rows, count):
    if not (torch.are_deterministic_algorithms_enabled() and available(rows.device)):
        return _in_torch(ids, rows, count)
    out = torch.zeros((count, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    launch(ids, rows, out)
    return out


def _in_torch(ids: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    out = torch.zeros((count, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    return out.index_add_(0, ids, rows)


def launch(ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """Add each row of 2-D `rows` into the row of zeroed `out` its id in 1-D `ids` names."""
    n, width = rows.shape
    if n == 0 or width == 0:
        return
    ids, order = torch.sort(ids.long(), stable=True)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    assert out.stride(-1) == 1
    grid = (n, -(-width // BLOCK))
    kernel("scatter_rows_kernel", "scatter_rows_kernel")[grid](
        ids, order, rows, rows.stride(0), out, out.stride(0), n, width, BLOCK=BLOCK,
    )  # fmt: skip
