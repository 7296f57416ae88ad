"""Trains from other libraries: quimb MPS/MPO objects, torch tensors and CuPy arrays.

`src` works on plain lists of array-likes in quimb's layout (`trains.py`). This
module turns what a quimb user holds into such lists and the result back:

- A quimb ``MatrixProductState`` or ``MatrixProductOperator`` becomes the
  list of its site arrays, each read by its index names (``l, r, p`` or
  ``l, r, u, d``), so a tensor whose indices quimb has permuted is still read
  right. The result is rebuilt as the same kind, with the quimb objects' site
  tags, index names and other tags, its arrays on the input's backend
  (NumPy, torch on the input's device, CuPy).
- A torch tensor or a CuPy array as a site becomes a `ForeignSite`: its shape
  and NumPy dtype are known without a copy, and it reaches the host only when
  the sweep reads that site (a CPU tensor without a copy).

quimb and torch are never imported here unless the caller already holds their
objects.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ForeignSite",
    "OpenedTrains",
    "QuimbTrain",
    "build_quimb",
    "foreign_site",
    "open_trains",
    "quimb_kind",
    "site_data",
]


class ForeignSite:
    """A site held by torch or CuPy, seen as an array-like with a NumPy dtype.

    Parameters
    ----------
    data : torch.Tensor or cupy.ndarray
        The site.
    perm : tuple of int, optional
        Axes to read it in (quimb may keep a tensor's indices in another order).
    """

    def __init__(self, data: Any, perm: Sequence[int] | None = None) -> None:
        self.data = data
        self.library = _library(data)
        shape = tuple(int(n) for n in data.shape)
        self.perm = tuple(range(len(shape))) if perm is None else tuple(perm)
        self.shape = tuple(shape[a] for a in self.perm)
        self.dtype = _numpy_dtype(data)
        self.on_gpu = _on_gpu(data, self.library)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The site on the host, in ``perm`` order."""
        data = self.data
        torch_held = self.library == "torch"
        host = data.detach().resolve_conj().cpu().numpy() if torch_held else data.get()
        host = host.transpose(self.perm)
        return host if dtype is None else host.astype(dtype, copy=False)


def foreign_site(site: Any) -> Any:
    """``site`` as a `ForeignSite` when torch or CuPy holds it, else unchanged."""
    return ForeignSite(site) if _library(site) else site


def _library(x: Any) -> str | None:
    module = type(x).__module__.split(".")[0]
    return module if module in ("torch", "cupy") and hasattr(x, "shape") else None


def _numpy_dtype(data: Any) -> np.dtype | str:
    """The site's NumPy dtype; a dtype NumPy lacks (bfloat16) as its name."""
    try:
        return np.dtype(str(data.dtype).removeprefix("torch."))
    except TypeError:
        return str(data.dtype)


def _on_gpu(data: Any, library: str) -> bool:
    if library == "cupy":
        return True
    return data.device.type != "cpu"


# --- quimb -------------------------------------------------------------------


def quimb_kind(obj: object) -> str | None:
    """``"mps"`` or ``"mpo"`` for a quimb MatrixProductState/Operator, else None."""
    qtn = sys.modules.get("quimb.tensor")
    if qtn is None:
        return None
    if isinstance(obj, qtn.MatrixProductState):
        return "mps"
    if isinstance(obj, qtn.MatrixProductOperator):
        return "mpo"
    return None


@dataclass(frozen=True)
class QuimbTrain:
    """What a quimb train's result keeps: its names, tags and array backend.

    Attributes
    ----------
    kind : {"mps", "mpo"}
        The object's kind.
    site_tag_id : str
        quimb's site tag pattern, e.g. ``"I{}"``.
    up, down : str
        The index patterns: ``site_ind_id`` twice for an MPS, else the MPO's
        ``upper_ind_id`` and ``lower_ind_id``.
    tags : tuple of str
        The object's tags other than its site tags.
    sample : object
        One site array, whose library and device the result's arrays take.
    """

    kind: str
    site_tag_id: str
    up: str
    down: str
    tags: tuple[str, ...]
    sample: Any = field(repr=False)

    def array(self, core: np.ndarray) -> Any:
        """``core`` on the backend (and device) of this train's arrays."""
        library = _library(self.sample)
        if library == "torch":
            import torch  # held by the caller already

            return torch.from_numpy(np.ascontiguousarray(core)).to(self.sample.device)
        if library == "cupy":
            return sys.modules["cupy"].asarray(core)
        return core


def _read_quimb(obj: Any, kind: str, where: str) -> tuple[list[Any], QuimbTrain]:
    """The sites of a quimb MPS/MPO in quimb's default layout, and what to keep."""
    if obj.cyclic:
        raise TypeError(
            f"{where} is a cyclic (periodic) quimb {type(obj).__name__}; open trains only."
        )
    sites = list(obj.gen_site_coos())
    if obj.num_tensors != len(sites):
        raise TypeError(
            f"{where} is a quimb {type(obj).__name__} with {obj.num_tensors} tensors on "
            f"{len(sites)} sites, a lazy network rather than a train; compress it with "
            "sexpgpu.tn.compress_network(tn, chi_out)."
        )
    if kind == "mps":
        up = down = obj.site_ind_id
    else:
        up, down = obj.upper_ind_id, obj.lower_ind_id
    arrays = []
    for i, site in enumerate(sites):
        tensor = obj[obj.site_tag(site)]
        bonds = []
        if i > 0:
            bonds.append(obj.bond(sites[i - 1], site))
        if i < len(sites) - 1:
            bonds.append(obj.bond(site, sites[i + 1]))
        legs = [up.format(site)] if kind == "mps" else [up.format(site), down.format(site)]
        arrays.append(site_data(tensor, [*bonds, *legs]))
    site_tags = {obj.site_tag(s) for s in sites}
    keep = tuple(t for t in obj.tags if t not in site_tags)
    return arrays, QuimbTrain(kind, obj.site_tag_id, up, down, keep, obj.arrays[0])


def site_data(tensor: Any, inds: Sequence[str]) -> Any:
    """A quimb tensor's data with its axes in the order of ``inds``."""
    perm = [tensor.inds.index(ix) for ix in inds]
    data = tensor.data
    if _library(data):
        return ForeignSite(data, perm)
    array = np.asarray(data)
    return array if perm == sorted(perm) else array.transpose(perm)


def build_quimb(cores: Sequence[np.ndarray], kind: str, top: QuimbTrain, bottom: QuimbTrain) -> Any:
    """The result as a quimb object: names from ``top`` (and the lower leg from ``bottom``)."""
    import quimb.tensor as qtn  # held by the caller already

    arrays = [top.array(core) for core in cores]
    if kind == "mps":
        return qtn.MatrixProductState(
            arrays, site_ind_id=top.up, site_tag_id=top.site_tag_id, tags=top.tags
        )
    return qtn.MatrixProductOperator(
        arrays,
        upper_ind_id=top.up,
        lower_ind_id=bottom.down,
        site_tag_id=top.site_tag_id,
        tags=top.tags,
    )


# --- the calls' trains ---------------------------------------------------------


@dataclass
class OpenedTrains:
    """The trains as plain lists, and how to give the result back.

    Attributes
    ----------
    trains : list of list
        Plain lists of array-likes (torch and CuPy sites wrapped).
    quimb : list of QuimbTrain or None
        Per train, what a quimb train keeps (None for a list).
    on_gpu : bool
        Whether any site lives on a GPU.
    """

    trains: list[Any]
    quimb: list[QuimbTrain | None]
    on_gpu: bool

    def result(self, cores: list[Any], kind: str) -> Any:
        """The result: a quimb object when any train was one, else ``cores``."""
        held = [q for q in self.quimb if q is not None]
        if not held:
            return cores
        mps = [q for q in held if q.kind == "mps"]
        if kind == "mps":
            top = bottom = mps[0] if mps else held[0]
        else:
            top = self.quimb[0] or held[0]
            bottom = self.quimb[-1] or held[-1]
        return build_quimb(cores, kind, top, bottom)


def open_trains(trains: Sequence[Any], fn: str, names: Sequence[str]) -> OpenedTrains:
    """Unwrap quimb objects and foreign sites; lists of NumPy sites pass unchanged."""
    plain: list[Any] = []
    quimb: list[QuimbTrain | None] = []
    for i, train in enumerate(trains):
        kind = quimb_kind(train)
        if kind is not None:
            sites, kept = _read_quimb(train, kind, f"{fn}: {names[i]} (train {i})")
            plain.append(sites)
            quimb.append(kept)
        elif isinstance(train, list | tuple) and any(_library(s) for s in train):
            plain.append([foreign_site(s) for s in train])
            quimb.append(None)
        else:
            plain.append(train)
            quimb.append(None)
    on_gpu = any(
        isinstance(s, ForeignSite) and s.on_gpu for t in plain if isinstance(t, list) for s in t
    )
    return OpenedTrains(plain, quimb, on_gpu)
