"""A compiled graph's entry in AOTAutograd's cache, by its key: noted when compiled, loaded by it.

``torch._inductor.compile`` finds a graph compiled before by computing its
AOTAutograd cache key: the graph's code generated and hashed, fake inputs
made, the configuration and PyTorch's own sources hashed (2.0 s of a warm
GPT-2 small start on an H200, for its 6 parts). Everything that goes into
that key is in the compile cache's key too (`sexpgpu.devices.cuda.compile_cache`:
the graph, its inputs, Inductor's options, the process settings, the
libraries' versions), so the cache entry notes each graph's AOTAutograd key
when it is compiled (`noting_key`), and a later run loads the graph's code
by it (`load_by_key`), as Inductor's `CompiledArtifact.load` does.

Both use PyTorch's private names, those Inductor's own `CompiledArtifact`
uses (in 2.13, and alike in an earlier release); where one is missing or
a load fails, the key is None or the load returns None (and says why),
and the caller compiles the graph as before (a hit in Inductor's cache).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["KeyedCall", "Noted", "load_by_key", "noting_key"]

log = logging.getLogger(__name__)


class Noted:
    """The AOTAutograd key of the graph compiled inside `noting_key` (None: not known)."""

    key: str | None = None


@contextlib.contextmanager
def noting_key() -> Iterator[Noted]:
    """Note the AOTAutograd cache key of the one graph compiled (or loaded) inside.

    AOTAutograd records the entries it saves and loads for PyTorch's
    portable caches; the records are kept apart here, and the key read from
    them. None where there is not exactly one entry.
    """
    noted = Noted()
    try:
        from torch.compiler._cache import CacheArtifactManager

        fresh = CacheArtifactManager.with_fresh_cache()
    except (ImportError, AttributeError):  # another PyTorch: no key, the usual load
        yield noted
        return
    with fresh:
        yield noted
        try:  # {kind: [artifact]} in PyTorch 2.7 to 2.13
            records = CacheArtifactManager._new_cache_artifacts["aot_autograd"]
            keys = {record.key for record in records}
        except (AttributeError, KeyError, TypeError):
            keys = set()
        noted.key = keys.pop() if len(keys) == 1 else None


class KeyedCall:
    """A graph's code loaded by its key, called as ``torch._inductor.compile``'s result is.

    AOTAutograd's code takes the graph's constants (its buffers) before
    its inputs, in one list it empties (the boxed convention); a graph that
    returns one value had it made a tuple for Inductor, and has it back here.
    """

    def __init__(self, compiled: Callable[[list], Any], graph: Any) -> None:
        import torch.utils._pytree as pytree

        self._compiled = compiled
        self._constants = [
            *dict(graph.named_parameters(remove_duplicate=False)).values(),
            *dict(graph.named_buffers(remove_duplicate=False)).values(),
        ]
        (result,) = next(n for n in graph.graph.nodes if n.op == "output").args
        self._spec = None if _returns_tuple(result) else pytree.tree_flatten(result)[1]

    def call_boxed(self, inputs: list) -> Any:
        """The call on `inputs`, which it empties: the code frees each after its last use."""
        full = [*self._constants, *inputs]
        inputs.clear()
        return self._compiled(full)

    def __call__(self, *inputs: Any) -> Any:
        out = self.call_boxed(list(inputs))
        if self._spec is None:
            return out
        import torch.utils._pytree as pytree

        return pytree.tree_unflatten(out, self._spec)


def _returns_tuple(result: Any) -> bool:
    """Whether Inductor takes a graph's result as it is (``compile_fx.graph_returns_tuple``)."""
    if isinstance(result, (list, tuple)):
        return True
    returns = getattr(getattr(result, "target", None), "_schema", None)
    returns = returns.returns if returns is not None else []
    return len(returns) > 1 and all(str(r.type) == "Tensor" for r in returns)


def load_by_key(key: str, graph: Any, options: dict[str, Any]) -> KeyedCall | None:
    """`graph`'s code as AOTAutograd's cache holds it under `key`, or None where it does not.

    `graph` is the ``GraphModule`` compiled (its constants are the code's
    first operands); `options` are Inductor's, as it was compiled with.
    Loading starts no pool of compile processes: each kernel is found
    compiled (were one not, it would compile here).
    """
    try:
        import torch
        import torch._inductor.async_compile  # the loaded code reads it as an attribute
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
        from torch._inductor.cudagraph_utils import BoxedDeviceIndex
        from torch._inductor.utils import BoxedBool
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        found = AOTAutogradCache._lookup(
            key, local=True, remote=False, args=[], cache_info={}, aot_config=None
        )
        if found is None:  # not there, or unreadable (AOTAutograd logs which)
            return None
        # (entry, its pickle) in PyTorch 2.13; the entry alone in earlier versions.
        entry = found[0] if isinstance(found, tuple) else found
        fx_config = {
            "cudagraphs": BoxedBool(False),
            "boxed_forward_device_index": BoxedDeviceIndex(0),
        }
        context = torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
        threads = {**options, "compile_threads": 1}
        with torch._inductor.config.patch(threads), torch._guards.tracing(context):
            compiled = entry.wrap_post_compile([], entry.sanitized_aot_config, fx_config)
        return KeyedCall(compiled, graph)
    except Exception as error:  # Inductor's code gone from under its entry; another PyTorch
        log.warning(
            "compile cache: a graph did not load by its key (%s: %s); compiled from its graph",
            type(error).__name__,
            error,
        )
        return None
