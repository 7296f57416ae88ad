"""A barrier before an Inductor kernel loads what it stored: the step sums alike every run.

Inductor (PyTorch 2.11) fuses a layer norm's backward, with the forward's
statistics recomputed, into a looped reduction that stores the normalized
row in one loop over the row's columns and loads it back in a later loop.
Nothing orders that load after the store: Triton may give an element's
load to another thread than the one that stored it, and threads of a
program are not ordered through global memory. Measured on an H200
(benches/README.md, Determinism): now and then one row of the embedding's
input gradient read the buffer's older contents in a block of its columns,
so two runs parted in a few bits of the embedding gradients (the
SEXPGPU_DETERMINISTIC runs' last source), and any run summed slightly
wrong values. PyTorch's pull request 190519 adds the same barrier to
Inductor itself.

`install` puts ``tl.debug_barrier()`` (a barrier of the program's threads,
which also orders their global memory) before each load of a buffer the
kernel stored earlier. It changes Inductor's code, so `SALT` goes into
Inductor's cache key (a graph pass that does nothing but name itself):
code compiled without the barrier is never loaded again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["SALT", "install", "options"]

VERSION = 1  # raise when the barrier's code changes: Inductor's cached code is then stale


class _Salt(CustomGraphPass):
    """A post-grad pass that leaves the graph alone; its `uuid` keys Inductor's cache."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return f"sexpgpu-readback-barrier-{VERSION}"


SALT = _Salt()


def options() -> dict[str, Any]:
    """Inductor's options that put the barrier's version into its cache key."""
    return {"post_grad_custom_post_pass": SALT}


def install() -> None:
    """Patch Inductor's Triton code generation once per process (see the module docstring)."""
    from torch._inductor.codegen.triton import TritonKernel

    if getattr(TritonKernel.load, "readback_barrier", False):
        return
    load, store = TritonKernel.load, TritonKernel.store

    def stored(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        result = store(self, name, *args, **kwargs)
        self.__dict__.setdefault("stored_here", set()).add(_real(name))
        return result

    def loaded(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if _real(name) in self.__dict__.get("stored_here", ()):
            self.loads.writeline("tl.debug_barrier()")
        return load(self, name, *args, **kwargs)

    loaded.readback_barrier = True  # type: ignore[attr-defined]
    TritonKernel.store, TritonKernel.load = stored, loaded


def _real(name: str) -> str:
    """A buffer's name after Inductor's mutations, as its kernel arguments know it."""
    from torch._inductor.virtualized import V

    scheduler = V.graph.scheduler if V.graph is not None else None
    return scheduler.mutation_real_name.get(name, name) if scheduler else name
