"""The weight gradients' products on a second CUDA stream, beside the rest of the backward.

In a training step's backward, each weight's gradient is a product
(``x^T @ dy``) that nothing else in the step reads: only the sum into its
gradient buffer does, after the step. The backward's own chain (the data
gradients' products, the elementwise and normalization kernels, attention)
does not wait for it. So these products can run on a side stream while the
chain goes on: on an H200 the weight-gradient products of GPT-2 small's
MLP backward, run so beside its chain, shortened it from 8.1 to 7.35 ms
(docs/devices.md, "The weight gradients on a side stream").

`to_side_stream` rewrites a traced step (its sums already taken out, so
that those products' values flow to the graph's outputs): each such
product, and the cast to its buffer's dtype that follows it, becomes one
``sexpgpu::side_mm`` call placed right after its operands are made, where
Inductor keeps it as a library call. The call queues the product on the
device's side stream after what the main stream has queued so far, and
keeps its operands alive; `join` makes the main stream wait for the side
stream and lets them go. The caller joins before it reads the outputs
(`sexpgpu.devices.cuda.parallel_compile.PartedCall`). Each product
computes what it computed on the main stream, kernel for kernel, so the
step's numbers do not change. On the CPU the call computes in place.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

__all__ = ["SIDE_PRODUCT", "capture_stream", "join", "side_products", "to_side_stream"]

_streams: dict[int, Any] = {}  # device index -> its side stream
_captures: dict[int, Any] = {}  # device index -> a stream of the highest priority
_held: defaultdict[int, list] = defaultdict(list)  # device index -> operands until the join
_lock = threading.Lock()  # ranks run in threads of their own


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _side(device: torch.device) -> Any:
    with _lock:
        if _index(device) not in _streams:  # the lowest priority, PyTorch's default
            _streams[_index(device)] = torch.cuda.Stream(device)
        return _streams[_index(device)]


def capture_stream(device: torch.device) -> Any:
    """A stream of the highest priority, to capture a step whose products go to the side.

    A CUDA graph keeps the priority of the stream each kernel was captured
    from, so the step's own chain is scheduled first, and the side stream's
    products take what it leaves of the device.
    """
    with _lock:
        if _index(device) not in _captures:
            _, highest = torch.cuda.Stream.priority_range()
            _captures[_index(device)] = torch.cuda.Stream(device, priority=highest)
        return _captures[_index(device)]


@torch.library.custom_op("sexpgpu::side_mm", mutates_args=())
def side_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``torch.mm(a, b).to(dtype)``, queued on the side stream on a GPU (join before reading)."""
    if a.device.type != "cuda":
        return torch.mm(a, b).to(dtype)
    # Made on the main stream: its memory is reused only after the main stream's join.
    out = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
    side = _side(a.device)
    side.wait_stream(torch.cuda.current_stream(a.device))
    with torch.cuda.stream(side):
        if dtype == a.dtype:
            torch.mm(a, b, out=out)
        else:
            out.copy_(torch.mm(a, b))  # the product's rounding, then the cast, as before
    # The caller may free the operands as this returns: held until the side stream is done.
    _held[_index(a.device)].append((a, b))
    return out


@side_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)


SIDE_PRODUCT = torch.ops.sexpgpu.side_mm.default


def join(device: torch.device) -> None:
    """The main stream waits for what the side stream has queued; the held operands go."""
    if device.type != "cuda":
        return
    if _index(device) in _streams:
        torch.cuda.current_stream(device).wait_stream(_streams[_index(device)])
    _held[_index(device)].clear()


_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
_VIEWS = (
    torch.ops.aten.permute.default,
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
)


def _only_user(node: Any) -> Any:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _cast_dtype(node: Any) -> torch.dtype | None:
    """The dtype a plain cast converts to, or None where `node` is something else."""
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1]
    plain = set(node.kwargs) <= {"dtype", "layout", "device"} and "dtype" in node.kwargs
    if node.target is torch.ops.aten._to_copy.default and not node.args[1:] and plain:
        return node.kwargs["dtype"]
    return None


def side_products(gm: Any) -> list[tuple[Any, Any, torch.dtype]]:
    """``(product, its last node, dtype)`` for each product whose value only the outputs read.

    The last node is the product itself or the plain cast that is its only user.
    """
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.mm.default:
            continue
        last, dtype = node, node.meta["val"].dtype
        user = _only_user(node)
        if user is not None and user.op == "call_function" and _cast_dtype(user) is not None:
            last, dtype = user, _cast_dtype(user)
        if last.users and all(u.op == "output" for u in last.users):
            found.append((node, last, dtype))
    return found


def to_side_stream(gm: Any) -> tuple[int, int]:
    """Put each `side_products` product on the side stream, right after its operands.

    The views it reads (a transposed activation) move up with it, so that it
    is queued as soon as the gradient it multiplies is made. Its operands
    are appended to the graph's outputs: Inductor reuses a buffer's memory
    for a later one after its last use (and writes some kernels' outputs
    into a dead operand), which must not happen while the side stream reads
    it; an output it never reuses. Returns how many products moved and how
    many outputs were appended (the caller drops them).
    """
    graph = gm.graph
    kept: dict[Any, None] = {}
    moved = 0
    for product, last, dtype in side_products(gm):
        for operand in product.args:
            _hoist(graph, operand)
            kept[operand] = None
        with graph.inserting_after(_latest(graph, product.args)):
            side = graph.call_function(SIDE_PRODUCT, (*product.args, dtype))
        side.meta = dict(last.meta)
        name = product.name
        last.replace_all_uses_with(side)
        if last is not product:
            graph.erase_node(last)
        graph.erase_node(product)
        side._rename(name)  # the IR's name, for the kernel report
        moved += 1
    if moved:
        output = next(n for n in graph.nodes if n.op == "output")
        output.args = ((*output.args[0], *kept),)
        graph.lint()
        gm.recompile()
    return moved, len(kept)


def _latest(graph: Any, values: Any) -> Any:
    """The node among `values` that comes last in `graph`, or its last placeholder if later."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    nodes = [v for v in values if isinstance(v, torch.fx.Node)]
    nodes += [n for n in graph.nodes if n.op == "placeholder"][-1:]
    return max(nodes, key=order.__getitem__)


def _hoist(graph: Any, node: Any) -> None:
    """Move a view (and the views it reads) to just after what it reads."""
    if not isinstance(node, torch.fx.Node) or node.target not in _VIEWS:
        return
    for operand in node.all_input_nodes:
        _hoist(graph, operand)
    _latest(graph, node.all_input_nodes).append(node)
