"""Rewrites of the traced aten step before Inductor sees it.

`bias_adds_onto_products`: ``torch.matmul`` of a ``[k m n]`` value by an
``[n p]`` weight traces as a view to ``[k*m n]``, ``mm`` and a view back to
``[k m p]``. A bias added to that view is out of reach of Inductor's
``add(mm, bias)`` pattern, which gives the add to cuBLAS's epilogue
(``addmm``), so the add becomes a Triton pass of its own over the product.
A stacked graph (`sexpgpu.ir.stack`) makes exactly these: every linear layer
of a microbatch ``[k rows width]``. Adding the bias to the ``mm`` and viewing
after is the same sum, and the step then has the product-with-bias kernels
of one unstacked batch.

`gelu_into_products`: a linear layer's gelu and its gradient go into the
layer's products (`sexpgpu.devices.cuda.gelu_products`), so that on a GPU
cuBLASLt's epilogues do them as the products write.

`param_casts_to_inputs`: a parameter's cast to bf16 becomes an input of the
step, the copy the update writes (`sexpgpu.devices.cuda.param_copies`).

`products_into_sums`: a product whose only reader writes it (cast or not)
into a sum buffer, or adds it there, does so itself
(`sexpgpu.devices.cuda.sum_products`): no pass of its own per weight gradient.
A step that returns its sums instead has each product it returns cast to
f32 made in f32 at once (``mm_f32``), in a tensor allocated as it is made.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from sexpgpu.devices.cuda import gelu_products, sum_products  # noqa: F401  (registers the ops)

__all__ = [
    "bias_adds_onto_products",
    "gelu_into_products",
    "param_casts_to_inputs",
    "products_into_sums",
]

_aten = torch.ops.aten
_VIEWS = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default})
_PRODUCT = frozenset({_aten.mm.default})
_GELU = frozenset({_aten.gelu.default})
_GELU_GRAD = frozenset({_aten.gelu_backward.default})
_ADD = frozenset({_aten.add.Tensor})
_CASTS = frozenset({_aten._to_copy.default})
_SUM_WRITES = {_aten.copy_.default: False, _aten.add_.Tensor: True}  # -> whether it adds
BF16 = torch.bfloat16


def bias_adds_onto_products(gm: fx.GraphModule) -> int:
    """Move each bias add from a product's viewed result onto the product; how many moved.

    A bias qualifies where it broadcasts along the last axis alone (shape
    ``[p]`` or ``[1]``, the product's dtype), so it adds the same values to
    the ``[k*m p]`` product as to its ``[k m p]`` view, and the view has no
    other use. New nodes take the add's name, so they keep its IR node.
    """
    graph, moved = gm.graph, 0
    for add in list(graph.nodes):
        if add.target is not _aten.add.Tensor or add.kwargs or len(add.args) != 2:
            continue
        for side in (0, 1):
            view, bias = add.args[side], add.args[1 - side]
            if not (_calls(view, _VIEWS) and len(view.users) == 1):
                continue
            product = view.args[0]
            if not (_calls(product, _PRODUCT) and _is_bias(bias, product, view)):
                continue
            operands = (product, bias) if side == 0 else (bias, product)
            with graph.inserting_before(add):
                rows = graph.call_function(_aten.add.Tensor, operands)
                back = graph.call_function(view.target, (rows, *view.args[1:]))
            rows.meta["val"] = product.meta["val"]  # the bias changes no shape, stride or dtype
            back.meta = dict(add.meta)
            name = add.name
            add.replace_all_uses_with(back)
            graph.erase_node(add)
            graph.erase_node(view)
            back._rename(name)
            rows._rename(f"{name}_rows")
            moved += 1
            break
    if moved:
        gm.recompile()
    return moved


def param_casts_to_inputs(gm: fx.GraphModule, params: list[fx.Node]) -> list[int]:
    """Make each f32 parameter's bf16 casts read a new placeholder instead; which ones did.

    `params` are the parameters' placeholders, in order; the new
    placeholders follow the last of them, one per parameter cast (in the
    order of the positions returned). A parameter's other readers keep the
    f32 placeholder.
    """
    graph = gm.graph
    copied, after = [], params[-1] if params else None
    for i, param in enumerate(params):
        casts = [u for u in param.users if _is_bf16_cast(u, param)]
        if not casts:
            continue
        with graph.inserting_after(after):
            copy = graph.placeholder(f"{param.name}_bf16")
        copy.meta = dict(casts[0].meta)
        for cast in casts:
            cast.replace_all_uses_with(copy)
            graph.erase_node(cast)
        copied.append(i)
        after = copy
    if copied:
        graph.lint()
        gm.recompile()
    return copied


def products_into_sums(gm: fx.GraphModule) -> int:
    """Make each product written, added or returned as a sum alone do it; how many.

    The write is ``copy_(buffer, p)`` or ``add_(buffer, p)``, where ``p`` is
    the ``mm`` or its cast to the buffer's dtype, each read by the next
    alone, and the buffer, contiguous and of the product's shape, is read
    by nothing else. The ``sexpgpu::mm_into`` that replaces them takes the
    product's place (and name): the buffer is written as the product is made.
    A bf16 product cast to f32 and only returned becomes ``sexpgpu::mm_f32``.
    """
    graph, moved = gm.graph, 0
    for write in list(graph.nodes):
        if write.op == "output":
            moved += _returned_products(graph, write)
            continue
        if write.op != "call_function" or write.target not in _SUM_WRITES or write.kwargs:
            continue
        buffer, value = write.args
        if not (isinstance(buffer, fx.Node) and buffer.op == "placeholder"):
            continue
        if len(buffer.users) != 1:
            continue
        cast = value if _calls(value, _CASTS) and len(value.users) == 1 else None
        product = value.args[0] if cast is not None else value
        if not (_calls(product, _PRODUCT) and len(product.users) == 1):
            continue
        if not _buffer_takes(cast, product, buffer):
            continue
        a, b = product.args
        with graph.inserting_before(product):
            into = graph.call_function(
                torch.ops.sexpgpu.mm_into.default, (a, b, buffer, _SUM_WRITES[write.target])
            )
        into.meta["val"] = None
        graph.erase_node(write)
        if cast is not None:
            graph.erase_node(cast)
        _take_place(into, product)
        moved += 1
    if moved:
        graph.lint()
        gm.recompile()
    return moved


def _returned_products(graph: fx.Graph, output: fx.Node) -> int:
    """Each bf16 product that `output` alone reads, cast to f32, made by ``mm_f32``; how many."""
    moved = 0
    for cast in dict.fromkeys(a for a in output.all_input_nodes):
        if not (_calls(cast, _CASTS) and set(cast.users) == {output}):
            continue
        product = cast.args[0] if cast.args else None
        if not (_calls(product, _PRODUCT) and len(product.users) == 1):
            continue
        val = _val(product)
        if val is None or val.dtype not in (BF16, torch.float16):
            continue
        if not _is_cast(cast, product, torch.float32):
            continue
        with graph.inserting_before(product):
            into = graph.call_function(torch.ops.sexpgpu.mm_f32.default, product.args)
        into.meta["val"] = _val(cast)
        cast.replace_all_uses_with(into)
        graph.erase_node(cast)
        _take_place(into, product)
        moved += 1
    return moved


def _take_place(into: fx.Node, product: fx.Node) -> None:
    """`product`, read by nothing now, gone; `into` takes its name (Inductor's provenance)."""
    name = product.name
    product.graph.erase_node(product)
    into._rename(name)


def _buffer_takes(cast: fx.Node | None, product: fx.Node, buffer: fx.Node) -> bool:
    """Whether `buffer` receives `product` (through `cast`) as its values, in its layout."""
    p, d = _val(product), _val(buffer)
    if p is None or d is None or p.shape != d.shape or not d.is_contiguous():
        return False
    if d.dtype not in (p.dtype, torch.float32) or p.dtype not in (BF16, torch.float16, d.dtype):
        return False
    return cast is None or _is_cast(cast, product, d.dtype)


def _is_bf16_cast(node: fx.Node, of: fx.Node) -> bool:
    """Whether `node` rounds the f32 `of` to bf16 and does nothing else."""
    val = _val(of)
    return val is not None and val.dtype == torch.float32 and _is_cast(node, of, BF16)


def _is_cast(node: fx.Node, of: fx.Node, dtype: torch.dtype) -> bool:
    """Whether `node` casts `of` to `dtype` and does nothing else (no move, no new layout)."""
    if not (_calls(node, _CASTS) and node.args == (of,)) or node.kwargs.get("dtype") is not dtype:
        return False
    same = {"dtype", "layout", "device", "memory_format"}  # what ``Tensor.to`` may record
    val = _val(of)
    return (
        val is not None
        and set(node.kwargs) <= same
        and node.kwargs.get("layout", torch.strided) == torch.strided
        and node.kwargs.get("device", val.device) == val.device
        and node.kwargs.get("memory_format", torch.preserve_format) == torch.preserve_format
    )


def _calls(node: object, targets: frozenset) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _is_bias(bias: object, product: fx.Node, view: fx.Node) -> bool:
    """Whether `bias` adds along the last axis alone (the view keeps it), in the product's dtype."""
    if not isinstance(bias, fx.Node):
        return False
    b, p, v = (x.meta.get("val") for x in (bias, product, view))
    if not all(isinstance(x, torch.Tensor) for x in (b, p, v)):
        return False
    last = p.shape[-1]
    return v.shape[-1] == last and b.dim() <= 1 and b.dtype == p.dtype and b.numel() in (1, last)


def gelu_into_products(gm: fx.GraphModule, backward: bool = True) -> tuple[int, int]:
    """Give each tanh gelu of a biased product, and each gelu gradient of a product, to the product.

    Forward: ``gelu(mm(x, w) + b)`` (the add as `bias_adds_onto_products`
    leaves it, maybe viewed) becomes ``sexpgpu::linear_gelu``, whose second
    result, the gelu's input, replaces the add for its other readers (the
    backward). Backward: ``gelu_backward(mm(dy, w), h)`` becomes
    ``sexpgpu::gelu_grad_mm`` (`backward` False keeps it apart). Returns how
    many of each moved; new nodes are named after the nodes they replace,
    so they keep their IR nodes.
    """
    graph = gm.graph
    moved = [0, 0]
    for node in list(graph.nodes):
        if _calls(node, _GELU) and _tanh(node, 1):
            moved[0] += _linear_gelu(graph, node)
        elif backward and _calls(node, _GELU_GRAD) and _tanh(node, 2):
            moved[1] += _gelu_grad_mm(graph, node)
    if any(moved):
        graph.lint()
        gm.recompile()
    return moved[0], moved[1]


def _tanh(node: fx.Node, operands: int) -> bool:
    default = node.args[operands] if len(node.args) > operands else "none"
    return node.kwargs.get("approximate", default) == "tanh"


def _under_views(node: fx.Node) -> tuple[list[fx.Node], fx.Node]:
    """(the views `node` is a chain of, outermost first; the node they view).

    A stacked graph views a linear layer's product twice (its rows back to
    ``[k m p]``, then as the stack's microbatches), so a chain, not one view.
    """
    views = []
    while _calls(node, _VIEWS):
        views.append(node)
        node = node.args[0]
    return views, node


def _val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _product(node: fx.Node) -> bool:
    """Whether `node` is a 2-D ``mm`` read once, with operands of its dtype."""
    if not (_calls(node, _PRODUCT) and len(node.users) == 1):
        return False
    vals = [_val(node), *(_val(a) for a in node.args)]
    return all(v is not None for v in vals) and len({v.dtype for v in vals}) == 1


def _results(graph: fx.Graph, call: fx.Node, vals: tuple, name: str) -> list[fx.Node]:
    call.meta["val"] = vals
    call._rename(name)
    outs = []
    for i, val in enumerate(vals):
        out = graph.call_function(operator.getitem, (call, i))
        out.meta["val"] = val
        out._rename(f"{name}_{i}")
        outs.append(out)
    return outs


def _take_over(graph: fx.Graph, old: fx.Node, new: fx.Node) -> None:
    """`old`'s readers read `new`, which takes `old`'s name."""
    name = old.name
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    new._rename(name)


def _as_viewed(graph: fx.Graph, new: fx.Node, views: list[fx.Node], like: fx.Node) -> fx.Node:
    """`new` (contiguous) viewed in `like`'s shape where `views` made it (else `new` itself)."""
    if not views:
        return new
    out = graph.call_function(_aten.view.default, (new, list(_val(like).shape)))
    out.meta = dict(like.meta)
    return out


def _linear_gelu(graph: fx.Graph, gelu: fx.Node) -> int:
    views, add = _under_views(gelu.args[0])
    if not (_calls(add, _ADD) and len(add.args) == 2 and not add.kwargs):
        return 0
    product, bias = add.args
    # _is_bias checks the dtype; the epilogue wants a vector, not a scalar's broadcast.
    if not (_product(product) and _is_bias(bias, product, product) and _val(bias).dim() == 1):
        return 0
    with graph.inserting_before(add):
        call = graph.call_function(torch.ops.sexpgpu.linear_gelu.default, (*product.args, bias))
        g, h = _results(graph, call, (_val(product), _val(add)), f"{gelu.name}_product")
    _take_over(graph, add, h)  # the gelu's input, for the backward
    graph.erase_node(product)
    with graph.inserting_before(gelu):
        _take_over(graph, gelu, _as_viewed(graph, g, views, gelu))
    return 1


def _gelu_grad_mm(graph: fx.Graph, grad: fx.Node) -> int:
    views, product = _under_views(grad.args[0])
    _, h = _under_views(grad.args[1])
    if any(len(v.users) != 1 for v in views) or not _product(product):
        return 0
    h_val, p_val = _val(h), _val(product)
    if h_val is None or h_val.shape != p_val.shape or h_val.dtype != p_val.dtype:
        return 0
    if not h_val.is_contiguous():
        return 0
    with graph.inserting_before(grad):
        call = graph.call_function(torch.ops.sexpgpu.gelu_grad_mm.default, (*product.args, h))
        call.meta["val"] = p_val
        call._rename(f"{grad.name}_product")
        _take_over(graph, grad, _as_viewed(graph, call, views, grad))
    for view in views:  # outermost first: each was its inner one's only reader
        graph.erase_node(view)
    graph.erase_node(product)
    return 1
