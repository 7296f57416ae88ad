"""Bonds wider than their rank, trimmed exactly before the sweep.

A bond can carry no more rank than the physical legs on either side of it::

    b_j  <=  prod_{i <= j} u_i d_i        and        b_j  <=  prod_{i > j} u_i d_i

Trains built at a uniform bond (random trains, or trains padded for batching)
exceed this near both ends: an MPS of bond 100 has rank at most 2, 4, 8, ...
at its first cuts. Every product of the sweep scales with the bonds, so each
such layer is first brought to its bound by QR, exactly (up to rounding), from
the left and then from the right::

    site_j (l u d, r) = Q R      site_j <- Q         site_{j+1} <- R . site_{j+1}
    site_j (l, r u d) = L Q      site_j <- Q         site_{j-1} <- site_{j-1} . L

stopping at the first bond within its bound. Only the boundary sites change;
the product, the sketches and hence the result for a seed stay the same (the
cut ranks the sweep reads, `Stack.cut_ranks`, are checked to stay the same too).
This runs on the host before a CPU sweep (`prepare`, after
`merge.merge_thin_layers`): there its cost is below one left-to-right site at
the bond it removes. The replaced sites are held in memory, so trimming is
skipped where they would exceed `TRIM_BYTES`; the rule reads shapes alone, so
every budget gives the same bits.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from .linalg import qr
from .merge import merge_thin_layers
from .trains import Layer, Shape4, Stack, unpad_core

__all__ = ["TRIM_BYTES", "prepare", "trim_stack", "trimmed_bonds"]

logger = logging.getLogger(__name__)

# The most the sites trimming replaces may hold in memory.
TRIM_BYTES = 256 << 20


def prepare(stack: Stack, work: np.dtype) -> Stack:
    """The stack a CPU sweep runs: thin MPO layers merged, then bonds trimmed (both exact)."""
    return trim_stack(merge_thin_layers(stack, work), work, TRIM_BYTES)


def trimmed_bonds(shapes: list[Shape4]) -> list[int]:
    """Each bond of one layer after trimming, from its padded site shapes.

    ``bonds[j]`` is the bond between sites ``j`` and ``j + 1``.
    """
    bonds = [s[1] for s in shapes[:-1]]
    for j in range(len(bonds)):  # from the left: b_j <= b_{j-1} u_j d_j
        left = shapes[0][0] if j == 0 else bonds[j - 1]
        bonds[j] = min(bonds[j], left * shapes[j][2] * shapes[j][3])
    for j in reversed(range(len(bonds))):  # from the right: b_j <= b_{j+1} u_{j+1} d_{j+1}
        right = shapes[-1][1] if j == len(bonds) - 1 else bonds[j + 1]
        bonds[j] = min(bonds[j], right * shapes[j + 1][2] * shapes[j + 1][3])
    return bonds


def trim_stack(stack: Stack, work: np.dtype, max_bytes: int) -> Stack:
    """``stack`` with every bond above its rank bound trimmed, computed in ``work``.

    Returns ``stack`` itself where no bond is above its bound, where the
    replaced sites would hold more than ``max_bytes`` in memory (inputs read
    from files stay there), or where trimming would change the cut ranks the
    sweep reads. The sites read are checked for NaN and infinities as the
    sweep checks them.
    """
    plans = []
    for i in range(len(stack.layers)):
        shapes = [stack.shapes(j)[i] for j in range(stack.n_sites)]
        bonds = trimmed_bonds(shapes)
        plans.append((shapes, bonds) if bonds != [s[1] for s in shapes[:-1]] else None)
    if all(p is None for p in plans):
        return stack
    held = sum(_held_bytes(*p, work) for p in plans if p is not None)
    if held > max_bytes:
        logger.debug("bonds not trimmed: the sites would hold %d bytes", held)
        return stack
    layers = [
        layer if p is None else _trim_layer(layer, *p, work)
        for layer, p in zip(stack.layers, plans, strict=True)
    ]
    trimmed = replace(stack, layers=layers)
    if trimmed.cut_ranks != stack.cut_ranks:
        return stack
    logger.debug(
        "bonds above their rank bound trimmed: %s",
        [p[1] if p is not None else "as given" for p in plans],
    )
    return trimmed


def _held_bytes(shapes: list[Shape4], bonds: list[int], work: np.dtype) -> int:
    """Bytes of the sites trimming replaces: those next to a bond it changes."""
    touched = {j + side for j, b in enumerate(bonds) if b < shapes[j][1] for side in (0, 1)}
    full = [1, *bonds, 1]
    return sum(full[j] * full[j + 1] * shapes[j][2] * shapes[j][3] for j in touched) * work.itemsize


def _trim_layer(layer: Layer, shapes: list[Shape4], bonds: list[int], work: np.dtype) -> Layer:
    """One layer with the sites around its trimmed bonds replaced (in memory)."""
    n = len(shapes)
    cores: dict[int, np.ndarray] = {}
    lefts = [s[0] for s in shapes]  # each site's left bond as trimming goes

    def core(j: int) -> np.ndarray:
        if j not in cores:
            cores[j] = layer.read(j).astype(work, copy=False)
        return cores[j]

    # From the left: QR each site whose right bond exceeds its rows, R into the next.
    j = 0
    while j < n - 1 and lefts[j] * shapes[j][2] * shapes[j][3] < shapes[j][1]:
        c = core(j)  # (l, r, u, d)
        left, right, up, down = c.shape
        q, r = qr(np.ascontiguousarray(c.transpose(0, 2, 3, 1)).reshape(-1, right))
        cores[j] = q.reshape(left, up, down, -1).transpose(0, 3, 1, 2)
        nxt = core(j + 1)  # R . site_{j+1} over the bond: one GEMM
        cores[j + 1] = (r @ nxt.reshape(nxt.shape[0], -1)).reshape(r.shape[0], *nxt.shape[1:])
        lefts[j + 1] = r.shape[0]
        j += 1
    # From the right: LQ (a QR of the transpose) of each site whose left bond exceeds its columns.
    j = n - 1
    right = shapes[-1][1]
    while j > 0 and right * shapes[j][2] * shapes[j][3] < lefts[j]:
        c = core(j)
        q, r = qr(c.reshape(c.shape[0], -1).T)  # site = r^T q^T
        cores[j] = q.T.reshape(-1, *c.shape[1:])
        prev = core(j - 1)  # site_{j-1} . L over the bond: one GEMM, r_{j-1} last
        moved = np.ascontiguousarray(prev.transpose(0, 2, 3, 1))
        moved = moved.reshape(-1, prev.shape[1]) @ r.T
        cores[j - 1] = moved.reshape(prev.shape[0], *prev.shape[2:], -1).transpose(0, 3, 1, 2)
        right = r.shape[0]
        j -= 1
    assert [cores[j].shape[1] if j in cores else shapes[j][1] for j in range(n - 1)] == bonds
    sites = list(layer.sites)
    for j, c in cores.items():
        sites[j] = _user_layout(c, j, n, layer)
    return replace(layer, sites=sites)


def _user_layout(core: np.ndarray, j: int, n: int, layer: Layer) -> np.ndarray:
    """A padded core back in the layout `Layer.read` reads (quimb's, u and d swapped back)."""
    site = unpad_core(core, j, n, layer.kind)
    return np.ascontiguousarray(site.swapaxes(-2, -1)) if layer.transposed else site
