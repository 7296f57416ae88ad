"""`compress_network`: SRC of a lazy 1D quimb network of MPOs and an MPS.

quimb's ``tensor_network_apply_op_vec(A, psi, contract=False)`` and
``tensor_network_apply_op_op(A, B, contract=False)`` (and their repeats)
build one network with a tensor per layer at every site, joined by the
physical indices within a site and by the bonds of each layer between sites::

    site:    0       1       2
             k0      k1      k2          open upper indices (the result's)
             |       |       |
    A        o ----- o ----- o           layer 0
             |       |       |
    psi      o ----- o ----- o           layer 1 (an MPS: no lower index)

Each site's tensors are ordered from the open upper index down the chain of
physical indices; each becomes a site of its layer in quimb's layout, read by
its index names. The layers are then a stack for `run_stack`, and the result
is a quimb MPS or MPO with the network's index names, site tags and tags, as
``tensor_network_1d_compress`` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .api import StackCall, StackOptions, run_stack
from .interop import QuimbTrain, build_quimb, site_data
from .resources import Resources

__all__ = ["compress_network"]


def compress_network(
    tn: Any,
    chi_out: int | np.integer,
    *,
    cutoff: float = 0.0,
    oversample: float | None = 1.0,
    dtype: DTypeLike | None = None,
    seed: int | np.random.Generator | None = None,
    device: str | None = None,
    resources: Resources | None = None,
) -> Any:
    """Compress a lazy 1D quimb network of MPO layers (and an MPS) by one SRC sweep.

    The network is what quimb's ``tensor_network_apply_op_vec`` and
    ``tensor_network_apply_op_op`` build with ``contract=False``: at every
    site one tensor per layer, carrying the site's tag. This does what
    ``quimb.tensor.tensor_network_1d_compress(tn, max_bond=chi_out,
    method="src")`` does, by the sweep of `src` (Camaño, Epperly and Tropp,
    arXiv:2504.06475), on the CPU or, with ``device="gpu"``, on GPUs.

    Parameters
    ----------
    tn : quimb.tensor.TensorNetwork1D
        A ``MatrixProductState`` (the network ends in an MPS) or a
        ``MatrixProductOperator`` (MPO layers only) with several tensors per
        site. Arrays may be NumPy, torch or CuPy.
    chi_out : int
        The largest bond dimension of the result (quimb's ``max_bond``).
    cutoff, oversample, dtype, seed, resources
        As in `src`.
    device : {"cpu", "gpu", "cuda"} or None, default None
        Where the sweep runs; None: on a GPU when the arrays live on one.

    Returns
    -------
    quimb.tensor.MatrixProductState or quimb.tensor.MatrixProductOperator
        The compressed network: its open indices, site tags and other tags
        kept, its arrays on the input's backend and device.

    Raises
    ------
    TypeError
        ``tn`` is not a 1D quimb network of stacked trains (a tensor without
        a site tag or with two, layers that do not line up between sites),
        and everything `src` raises.
    ValueError
        As in `src`.
    """
    layers, keep = _layers(tn)
    names = [f"tn layer {i}" for i in range(len(layers))]
    call = StackCall(
        "compress_network",
        layers,
        names,
        chi_out,
        StackOptions(cutoff, oversample, dtype, seed, device, resources),
    )
    cores = run_stack(call)
    result = build_quimb(cores, keep.kind, keep, keep)
    return result


def _fail(why: str) -> TypeError:
    return TypeError(
        f"compress_network: tn {why}; pass the network quimb's tensor_network_apply_op_vec "
        "or tensor_network_apply_op_op builds with contract=False (one tensor per layer "
        "at every site, each tagged with its site)."
    )


def _open_legs(tn: Any, site: Any) -> tuple[str, str | None]:
    """The names of the open upper (and, for an operator, lower) index at ``site``."""
    if hasattr(tn, "upper_ind_id"):
        return tn.upper_ind_id.format(site), tn.lower_ind_id.format(site)
    if hasattr(tn, "site_ind_id"):
        return tn.site_ind_id.format(site), None
    raise _fail(f"is a {type(tn).__name__}, neither a MatrixProductState nor an Operator")


def _column(tn: Any, site: Any, outer: set[str]) -> list[tuple[Any, str, str | None]]:
    """The site's tensors from the top down, each with its upper and lower index."""
    tensors = list(tn.select_tensors(tn.site_tag(site)))
    up, bottom = _open_legs(tn, site)
    if up not in outer:
        raise _fail(f"has no open index {up!r} at site {site}")
    column = []
    while tensors:
        holders = [t for t in tensors if up in t.inds]
        if len(holders) != 1:
            raise _fail(f"has {len(holders)} tensors at site {site} holding index {up!r}")
        tensor = holders[0]
        tensors.remove(tensor)
        down = [ix for ix in tensor.inds if ix != up and (ix == bottom or _within(ix, tensors))]
        if len(down) > 1:
            raise _fail(f"has a tensor at site {site} with lower indices {down}")
        column.append((tensor, up, down[0] if down else None))
        if not down or down[0] == bottom:
            break
        up = down[0]
    if tensors:
        raise _fail(f"has {len(tensors)} tensor(s) at site {site} outside its chain of layers")
    return column


def _within(ix: str, tensors: Sequence[Any]) -> bool:
    return any(ix in t.inds for t in tensors)


def _layers(tn: Any) -> tuple[list[list[Any]], QuimbTrain]:
    """The network's layers as plain trains (top first), and what the result keeps."""
    if not hasattr(tn, "gen_site_coos") or not hasattr(tn, "site_tag"):
        raise _fail(f"is a {type(tn).__name__}, not a 1D quimb network")
    sites = list(tn.gen_site_coos())
    site_tags = {tn.site_tag(s) for s in sites}
    for tensor in tn:
        if len(site_tags & set(tensor.tags)) != 1:
            raise _fail(f"has a tensor with site tags {sorted(site_tags & set(tensor.tags))}")
    outer = set(tn.outer_inds())
    columns = [_column(tn, s, outer) for s in sites]
    depth = len(columns[0])
    if any(len(c) != depth for c in columns):
        raise _fail(f"has {[len(c) for c in columns]} layers at its sites")
    layers: list[list[Any]] = [[] for _ in range(depth)]
    for j, column in enumerate(columns):
        for i, (tensor, up, down) in enumerate(column):
            bonds = []
            if j > 0:
                bonds.append(_bond(tensor, columns[j - 1][i][0], sites[j]))
            if j < len(sites) - 1:
                bonds.append(_bond(tensor, columns[j + 1][i][0], sites[j]))
            legs = [up] if down is None else [up, down]
            layers[i].append(site_data(tensor, [*bonds, *legs]))
    kind = "mps" if columns[0][-1][2] is None else "mpo"
    up_id, down_id = _ids(tn)
    tags = tuple(t for t in tn.tags if t not in site_tags)
    sample = columns[0][0][0].data
    return layers, QuimbTrain(kind, tn.site_tag_id, up_id, down_id, tags, sample)


def _bond(tensor: Any, neighbour: Any, site: Any) -> str:
    """The one index a layer's tensor shares with the same layer's at the next site."""
    shared = [ix for ix in tensor.inds if ix in neighbour.inds]
    if len(shared) != 1:
        raise _fail(f"has a layer whose tensors at site {site} and its neighbour share {shared}")
    return shared[0]


def _ids(tn: Any) -> tuple[str, str]:
    if hasattr(tn, "upper_ind_id"):
        return tn.upper_ind_id, tn.lower_ind_id
    return tn.site_ind_id, tn.site_ind_id
