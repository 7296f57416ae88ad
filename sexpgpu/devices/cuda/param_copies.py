"""`ParamCopies`: the bf16 copies of parameters that a fused step reads, kept by the update.

A bf16 step casts each f32 parameter before its products: on GPT-2 small
about a hundred small kernels a step, reading 4 bytes and writing 2 per
parameter. The update already holds every parameter in registers as it
writes it, so it writes the bf16 copy beside it (2 bytes more), and the
step reads the copies instead (`sexpgpu.devices.cuda.fx_rewrites.
param_casts_to_inputs`). The copy holds the same value the cast would
make: f32 rounded to nearest even.

A copy is current by one of two means:

- the update writes or refreshes them in the kernels that write the
  parameters (`written_with`, `refresh`), so a captured update replayed
  does too: its own kernel, PyTorch's fused AdamW and a replay all write
  parameters without counting up their ``_version``;
- PyTorch's other in-place ops (an sgd step's) count up the parameter's
  ``_version``: `current` sees the change and casts again.

Copies belong to the parameter tensor itself (a weak reference, not its
address: memory a freed parameter leaves may come back as another's).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ParamCopies"]

DTYPE = torch.bfloat16  # the only copies the update's kernel writes


@dataclass
class _Copy:
    param: weakref.ref
    copy: torch.Tensor
    version: int  # the parameter's ``_version`` the copy was last made from


class ParamCopies:
    """bf16 copies of f32 parameters, by parameter (see the module docstring)."""

    def __init__(self) -> None:
        self._made: dict[int, _Copy] = {}

    def _entry(self, param: torch.Tensor) -> _Copy | None:
        entry = self._made.get(id(param))
        return entry if entry is not None and entry.param() is param else None

    def current(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The copies of `params`, made or cast again (all in one launch) where they changed."""
        entries = [self._entry(p) or self._made_for(p) for p in params]
        self.refresh([p for p, e in zip(params, entries, strict=True) if e.version != p._version])
        return [e.copy for e in entries]

    def _made_for(self, param: torch.Tensor) -> _Copy:
        # Copies of parameters gone (the plan's dry calls, a resume's old ones) go first.
        self._made = {k: e for k, e in self._made.items() if e.param() is not None}
        entry = _Copy(weakref.ref(param), torch.empty_like(param, dtype=DTYPE), -1)
        self._made[id(param)] = entry
        return entry

    def written_with(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Each parameter's copy (None where it has none), which the caller writes with it."""
        copies: list[torch.Tensor | None] = []
        for p in params:
            entry = self._entry(p)
            if entry is not None:
                entry.version = p._version
            copies.append(None if entry is None else entry.copy)
        return copies

    def refresh(self, params: Sequence[torch.Tensor]) -> None:
        """Cast the copies of `params` again (after a write that did not make them)."""
        pairs = [(e, p) for p in params if (e := self._entry(p)) is not None]
        if pairs:
            torch._foreach_copy_([e.copy for e, _ in pairs], [p for _, p in pairs])
        for entry, p in pairs:
            entry.version = p._version

    @property
    def nbytes(self) -> int:
        return sum(e.copy.nbytes for e in self._made.values() if e.param() is not None)
