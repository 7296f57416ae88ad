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
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["bias_adds_onto_products"]

_aten = torch.ops.aten
_VIEWS = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default})
_PRODUCT = frozenset({_aten.mm.default})


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
