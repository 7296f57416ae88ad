"""Thin operator layers of a stack merged into one before a CPU sweep.

A stack of several MPOs of small bond (Trotter steps ``src(U2, U1, psi)``)
makes every site's chain end in one product per thin layer, each with an inner
dimension of a bond times a physical leg (8 for bond 4): memory-bound passes
over the site's largest array, at a third of the BLAS rate on the CPU. Two
adjacent MPO layers whose bonds multiply to at most `THIN_BOND` are contracted
into one MPO exactly, site by site (a few hundred numbers each)::

    A (a, a', u, x)  B (b, b', x, d)   ->   AB (a b, a' b', u, d)

so the chain makes one product with a wider inner dimension instead of two.
The product, the bonds crossing each cut (their product), the sketches and
hence the result for a seed stay the same (to rounding). `trim.prepare` runs
it before every CPU sweep.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .trains import Layer, Stack, unpad_core

__all__ = ["THIN_BOND", "merge_thin_layers"]

# The largest merged bond: up to here the merged layer's products stay cheaper
# than the separate memory-bound ones (measured at bond 4 x 4 on the CPU).
THIN_BOND = 16


def merge_thin_layers(stack: Stack, work: np.dtype) -> Stack:
    """``stack`` with adjacent thin MPO layers merged, computed in ``work``.

    Returns ``stack`` itself where no two adjacent MPO layers are thin
    together. The sites read are checked for NaN and infinities.
    """
    layers = list(stack.layers)
    i, merged = 0, False
    while i + 1 < len(layers):
        a, b = layers[i], layers[i + 1]
        if a.kind == b.kind == "mpo" and _thin_together(a, b):
            layers[i : i + 2] = [_merge(a, b, work)]
            merged = True
        else:
            i += 1
    return replace(stack, layers=layers) if merged else stack


def _thin_together(a: Layer, b: Layer) -> bool:
    return all(a.shape(j)[1] * b.shape(j)[1] <= THIN_BOND for j in range(len(a) - 1))


def _merge(a: Layer, b: Layer, work: np.dtype) -> Layer:
    """The MPO ``a b`` (``a`` above: its ``d`` meets ``b``'s ``u``), in the user's layout."""
    n, sites = len(a), []
    for j in range(n):
        top, bottom = a.read(j).astype(work, copy=False), b.read(j).astype(work, copy=False)
        la, ra, up, inner = top.shape
        lb, rb, _, down = bottom.shape
        # One GEMM over x, then one rearranging copy: einsum's own loop over
        # these few hundred numbers cost ten times as much (50 us a site).
        core = top.reshape(-1, inner) @ bottom.transpose(2, 0, 1, 3).reshape(inner, -1)
        core = core.reshape(la, ra, up, lb, rb, down).transpose(0, 3, 1, 4, 2, 5)
        core = core.reshape(la * lb, ra * rb, up, down)  # (a b, a' b', u, d)
        sites.append(unpad_core(core, j, n, "mpo"))
    return Layer(sites, "mpo", where=a.where)
