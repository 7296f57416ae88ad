"""AdamW over every parameter in one Triton launch: the ``("adamw", "triton")`` update rule.

PyTorch's multi-tensor ``_fused_adamw_`` took 10 launches and 1.18 ms for
GPT-2 small's 148 parameters on an H200 (about 3 TB/s of the least
traffic: the parameters, gradients and moments read, the parameters and
moments written). Here one launch covers them all: a table on the device
gives each program a block of one parameter. It holds a row per parameter
(the addresses of the parameter, its gradient and its two moments, its
first program, its size, and the address of its bf16 copy where the fused
step reads one, `sexpgpu.devices.cuda.param_copies`) and, per program, only
the number of its parameter's row (4 bytes a program: 0.02 GiB at 2.5B
parameters). The table is made once per set of addresses and kept (the
last few), so a captured update replays it.

The arithmetic is the reference's (`sexpgpu.devices.update_numpy.adamw`),
in f32, the gradient multiplied by the update's scale as it is read; the
step count and learning rate are read from their device scalars, so one
capture serves every step. Parameters in other layouts than contiguous go
to the ``("adamw", "torch")`` rule.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from sexpgpu.devices.cuda.triton_support import kernel
from sexpgpu.devices.cuda.update_torch import in_layout, largest_copy
from sexpgpu.devices.update_rules import UPDATE_RULES, Update, update_rule

__all__ = ["BLOCK", "Numbers", "Table", "Tables", "adamw", "launch", "table_bytes"]

BLOCK = 512  # elements a program: the fastest measured, benches/README.md
WARPS = 4


def table_bytes(sizes: Sequence[int]) -> int:
    """The bytes of the launch table of one update of parameters of `sizes` elements."""
    # 7 int64 columns a parameter, an int32 a program (`Tables`).
    return 7 * 8 * len(sizes) + 4 * sum(-(-n // BLOCK) for n in sizes)


# Bytes of launch tables kept at once past the two newest: a table costs 4 bytes per
# BLOCK elements, tens of MiB for billions of parameters, and a step without a CUDA
# graph makes its gradients anew, so a new table, every step.
ROOM = 64 * 2**20


class Table(NamedTuple):
    """One launch's table: a row per parameter, and each program's parameter."""

    rows: torch.Tensor  # int64 [parameters, 7]: the four addresses, first program, size, copy
    blocks: torch.Tensor  # int32 [programs]: the row of each program's parameter

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


class Tables:
    """The launch tables, by the addresses and sizes they cover, the `capacity` last used.

    Past `room` bytes, only the two newest are kept. A captured update reads
    its tables at every replay, so `evicted` is called whenever one is
    dropped: the owner drops its capture too.
    """

    def __init__(self, evicted: Callable[[], None], capacity: int = 8, room: int = ROOM) -> None:
        self._made: OrderedDict[tuple[int, ...], Table] = OrderedDict()
        self._evicted, self._capacity, self._room = evicted, capacity, room

    def __call__(
        self, arrays: Sequence[Sequence[torch.Tensor]], copies: Sequence[torch.Tensor | None]
    ) -> Table:
        params = arrays[0]
        copied = [0 if c is None else c.data_ptr() for c in copies]
        key = (BLOCK, *(t.data_ptr() for ts in arrays for t in ts), *copied)
        key += tuple(p.numel() for p in params)
        table = self._made.get(key)
        if table is not None:
            self._made.move_to_end(key)
            return table
        sizes = np.array([p.numel() for p in params], np.int64)
        programs = -(-sizes // BLOCK)
        first = np.concatenate([[0], np.cumsum(programs)[:-1]]).astype(np.int64)
        columns = [np.array([t.data_ptr() for t in ts], np.int64) for ts in arrays]
        rows = np.stack([*columns, first, sizes, np.array(copied, np.int64)], axis=1)
        blocks = np.repeat(np.arange(len(params), dtype=np.int32), programs)
        device = params[0].device
        table = self._made[key] = Table(
            torch.from_numpy(rows).to(device), torch.from_numpy(blocks).to(device)
        )
        while len(self._made) > self._capacity or (
            len(self._made) > 2 and self._bytes() > self._room
        ):
            self._made.popitem(last=False)
            self._evicted()
        return table

    def _bytes(self) -> int:
        return sum(t.nbytes for t in self._made.values())


def _scratch(shapes: Sequence[tuple[int, ...]]) -> int:
    """Two launch tables kept (`Tables`), and a gradient copied into its layout."""
    return 2 * table_bytes([math.prod(s) for s in shapes]) + largest_copy(shapes)


@update_rule("adamw", "triton", scratch=_scratch)
def adamw(update: Update) -> None:
    if not all(p.is_contiguous() for p in update.params):
        UPDATE_RULES["adamw", "torch"](update)
        return
    tables = update.keep.get("tables")
    if tables is None:
        # A captured update reads its tables: one dropped drops the capture.
        tables = update.keep["tables"] = Tables(evicted=update.stream.forget)
    wd = float(update.options["weight_decay"])
    b1, b2 = (float(b) for b in update.options["betas"])
    lr, step = (_on_device(update.numbers[k], update.params) for k in ("lr", "step"))
    scale = None if update.scale is None else _on_device(update.scale, update.params)
    for decays in (True, False):
        part = update.select([bool(wd and d) is decays for d in update.decay])
        if not part.params:
            continue
        numbers = Numbers(lr, step, scale, b1, b2, float(update.options["eps"]))
        grads = in_layout(part.params, part.grads)
        moments = (part.moments["exp_avg"], part.moments["exp_avg_sq"])
        copies = update.xp.copies.written_with(part.params)
        launch(tables, part.params, grads, *moments, numbers, wd if decays else 0.0, copies)


def _on_device(x: Any, like: Sequence[torch.Tensor]) -> torch.Tensor:
    """`x` (a host number or a device scalar) as an f32 scalar on the parameters' device."""
    if isinstance(x, torch.Tensor):
        return x.float()
    return torch.full((), float(x), dtype=torch.float32, device=like[0].device)


class Numbers(NamedTuple):
    """One launch's numbers: `lr`, `step` and `scale` (or None) are f32 device scalars."""

    lr: torch.Tensor
    step: torch.Tensor
    scale: torch.Tensor | None
    beta1: float
    beta2: float
    eps: float


def launch(
    tables: Tables,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    m: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    numbers: Numbers,
    weight_decay: float,
    copies: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """One AdamW step of contiguous f32 tensors in one launch, in place (`numbers`).

    `copies` (None, or one per parameter: a contiguous bf16 tensor of its
    shape or None) are written with the new parameters, rounded to nearest
    even.
    """
    arrays = (params, grads, m, v)
    assert all(t.is_contiguous() and t.dtype == torch.float32 for ts in arrays for t in ts)
    copies = [None] * len(params) if copies is None else copies
    assert all(
        c is None or (c.is_contiguous() and c.dtype == torch.bfloat16 and c.shape == p.shape)
        for p, c in zip(params, copies, strict=True)
    )
    table = tables(arrays, copies)
    scale = numbers.scale
    kernel("adamw_kernel", "adamw_kernel")[(table.blocks.shape[0],)](
        table.rows, table.blocks, numbers.lr, numbers.step,
        scale if scale is not None else numbers.lr,
        numbers.beta1, numbers.beta2, numbers.eps, weight_decay,
        HAS_SCALE=scale is not None, BLOCK=BLOCK, num_warps=WARPS,
    )  # fmt: skip
