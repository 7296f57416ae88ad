"""Trains and stacks: kinds, validation, the ket form and lazy site reading.

A train is a list of per-site array-likes in quimb's layout::

    MPS   (r, p)      (l, r, p) ...      (l, p)
    MPO   (r, u, d)   (l, r, u, d) ...   (l, u, d)

Its kind is read from the rank of the first site. A stack ``T_1, ..., T_m`` is
the product ``T_1 T_2 ... T_m``: the ``d`` leg of each train meets the ``u``
(or only physical) leg of the next. An MPS may stand first (a row vector, not
conjugated) or last (a ket), never both.

The sweep works on the *ket form*: MPOs, then at most one MPS. A leading MPS
``phi^T A_1 ... A_k`` is rewritten as ``A_k^T ... A_1^T phi`` (``^T`` swaps
``u`` and ``d``). Every site is seen through a `Layer` as a padded bulk core
``(l, r, u, d)``: boundary sites get a size-1 outer bond and an MPS a size-1
``d`` leg, so one set of contractions serves every site. Validation reads only
``shape`` and ``dtype``; data is read by `Layer.read` when the sweep needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import Any, Literal

import numpy as np

__all__ = ["COMPUTE_DTYPES", "Kind", "Layer", "Stack", "normalize_stack", "unpad", "unpad_core"]

Kind = Literal["mps", "mpo"]
Shape4 = tuple[int, int, int, int]

_BOUNDARY_RANK = {"mps": 2, "mpo": 3}

# Floating dtypes the sweep computes in (BLAS and cuBLAS products have no other).
COMPUTE_DTYPES = ("float32", "float64", "complex64", "complex128")


@dataclass(frozen=True)
class Layer:
    """One train of a stack in ket form, read one padded site at a time.

    Attributes
    ----------
    sites : sequence of array-likes
        The user's sites, untouched.
    kind : {"mps", "mpo"}
        The train's kind.
    transposed : bool
        Whether ``u`` and ``d`` are swapped on reading (a bra rewritten as a ket).
    where : str
        How errors name the train (``compress: tensor (train 0``).
    """

    sites: Sequence[Any]
    kind: Kind
    transposed: bool = False
    where: str = "train"

    def __len__(self) -> int:
        return len(self.sites)

    def shape(self, j: int) -> Shape4:
        """Return the padded ``(l, r, u, d)`` shape of site ``j`` without reading it."""
        dims = list(_shape(self.sites[j]))
        if self.kind == "mps":
            dims.append(1)
        elif self.transposed:
            dims[-2], dims[-1] = dims[-1], dims[-2]
        if j == 0:
            dims.insert(0, 1)
        if j == len(self.sites) - 1:
            dims.insert(1, 1)
        left, right, up, down = dims
        return left, right, up, down

    def read(self, j: int, check: bool = True) -> np.ndarray:
        """Read site ``j`` into memory as a padded ``(l, r, u, d)`` array.

        ``check`` looks for NaN and infinities (a sweep checks each site once).
        """
        site = self.sites[j]
        core = site if type(site) is np.ndarray else np.asarray(site)
        # Sites are read lazily: each is checked as it comes. A sum (one read,
        # no temporary) is NaN or infinite when any entry is; only then, or on
        # an overflow, is every entry looked at.
        if check and not _finite_sum(core) and not np.isfinite(core).all():
            bad = int(core.size - np.count_nonzero(np.isfinite(core)))
            raise ValueError(
                f"{self.where}, site {j}) holds {bad} NaN or infinite value(s); the result "
                "would be NaN. Check the input (a failed earlier step, an overflow)."
            )
        if self.kind == "mps":
            core = core[..., None]
        elif self.transposed:
            core = core.swapaxes(-2, -1)
        if j == 0:
            core = core[None]
        if j == len(self.sites) - 1:
            core = core[:, None]
        return core


@dataclass(frozen=True)
class Stack:
    """A validated stack in ket form.

    Attributes
    ----------
    layers : list of Layer
        MPOs, then at most one MPS, in the order the sweep contracts them.
    kind : {"mps", "mpo"}
        The kind of the result.
    dtype : numpy.dtype
        The inputs' promoted dtype.
    """

    layers: list[Layer]
    kind: Kind
    dtype: np.dtype

    @property
    def n_sites(self) -> int:
        """The number of sites of every train."""
        return len(self.layers[0])

    @cached_property
    def _shapes(self) -> list[list[Shape4]]:
        # The plan asks for every site's shapes many times over: read them once.
        return [[layer.shape(j) for layer in self.layers] for j in range(self.n_sites)]

    def shapes(self, j: int) -> list[Shape4]:
        """Return the padded shapes of every layer at site ``j``."""
        return list(self._shapes[j])

    @cached_property
    def cut_ranks(self) -> list[int]:
        """For every cut ``j | j+1``, a bound on the product's rank there.

        The smallest of the product of the bonds crossing the cut and the
        products of the physical dimensions left and right of it.
        """
        cap = 2**62
        phys = [min(cap, s[0][2] * s[-1][3]) for s in self._shapes]
        rights, right = [], 1
        for p in reversed(phys[1:]):
            right = min(right * p, cap)
            rights.append(right)
        bounds, left = [], 1
        for j, right in enumerate(reversed(rights)):
            left = min(left * phys[j], cap)
            bounds.append(min(left, right, prod(s[1] for s in self._shapes[j])))
        return bounds

    @cached_property
    def in_memory(self) -> bool:
        """Whether every site is a NumPy array in memory (nothing to read ahead)."""
        return all(type(site) is np.ndarray for layer in self.layers for site in layer.sites)

    def read(self, j: int, check: bool = True) -> list[np.ndarray]:
        """Read site ``j`` of every layer (``check``: look for NaN and infinities)."""
        return [layer.read(j, check) for layer in self.layers]


def _finite_sum(core: np.ndarray) -> bool:
    """Whether the entries' sum is finite (it is not when any entry is not, or on overflow)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(core.sum()))


def _shape(site: Any) -> tuple[int, ...]:
    if type(site) is np.ndarray:  # its shape is already a tuple of ints
        return site.shape
    return tuple(int(n) for n in site.shape)


def _label(fn: str, names: Sequence[str], i: int) -> str:
    """``compress: tensor (train 0``: `_where` without its closing parenthesis."""
    return _where(fn, names, i)[:-1]


def _where(fn: str, names: Sequence[str], i: int, j: int | None = None) -> str:
    """Return the location prefix of a message: function, argument, train, site."""
    site = "" if j is None else f", site {j}"
    return f"{fn}: {names[i]} (train {i}{site})"


def _check_train(fn: str, names: Sequence[str], i: int, train: object) -> Kind:
    """Check one train's container, sites, ranks and bonds; return its kind."""
    here = _where(fn, names, i)
    if hasattr(train, "arrays") and not isinstance(train, Sequence):
        raise TypeError(
            f"{here} is a {type(train).__name__}; pass its list of site arrays, "
            "e.g. `mps.arrays` or `list(mpo.arrays)`."
        )
    if isinstance(train, str | bytes | np.ndarray) or not isinstance(train, Sequence):
        raise TypeError(
            f"{here} must be a list of per-site arrays, got {type(train).__name__}; "
            "pass e.g. `[site0, site1, ...]` or quimb's `tn.arrays`."
        )
    if len(train) == 0:
        raise ValueError(f"{here} has no sites; pass a list of at least two site arrays.")
    for j, site in enumerate(train):
        if not (hasattr(site, "shape") and hasattr(site, "dtype")):
            raise TypeError(
                f"{_where(fn, names, i, j)} is a {type(site).__name__} without shape and "
                "dtype; pass a NumPy array, np.memmap, or an HDF5 or zarr dataset."
            )
        if type(site.dtype) not in _CHECKED or site.dtype not in _CHECKED_DTYPES:
            _check_dtype(_where(fn, names, i, j), site.dtype)
        if any(n < 1 for n in _shape(site)):
            raise ValueError(
                f"{_where(fn, names, i, j)} has an empty dimension, shape {_shape(site)}; "
                "every bond and physical dimension must be at least 1."
            )
    rank = len(_shape(train[0]))
    kind: Kind
    if rank == 2:
        kind = "mps"
    elif rank == 3:
        kind = "mpo"
    else:
        raise TypeError(
            f"{_where(fn, names, i, 0)} has rank {rank}, shape {_shape(train[0])}: the first "
            "site of an open train is (r, p) for an MPS or (r, u, d) for an MPO. Closed "
            "(periodic) trains are not supported; open the boundary bond first."
        )
    _check_ranks(fn, names, i, train, kind)
    _check_bonds(fn, names, i, train, kind)
    return kind


def _check_ranks(fn: str, names: Sequence[str], i: int, train: Sequence[Any], kind: Kind) -> None:
    """Open boundary: boundary sites have one bond, bulk sites two."""
    edge = _BOUNDARY_RANK[kind]
    for j, site in enumerate(train):
        want = edge if j in (0, len(train) - 1) else edge + 1
        rank = len(_shape(site))
        if rank != want:
            layout = {"mps": "(l, r, p)", "mpo": "(l, r, u, d)"}[kind]
            raise ValueError(
                f"{_where(fn, names, i, j)} has rank {rank}, shape {_shape(site)}, but the "
                f"train is an {kind.upper()} (first site rank {edge}): bulk sites are "
                f"{layout} and boundary sites drop the outer bond. Closed (periodic) "
                "boundaries are not supported."
            )


def _check_bonds(fn: str, names: Sequence[str], i: int, train: Sequence[Any], kind: Kind) -> None:
    """Neighbouring sites must agree on the bond between them."""
    for j in range(len(train) - 1):
        right = _shape(train[j])[0 if j == 0 else 1]
        left = _shape(train[j + 1])[0]
        if right != left:
            raise ValueError(
                f"{_where(fn, names, i, j)} has right bond {right} but site {j + 1} has left "
                f"bond {left}; neighbouring sites must share their bond dimension."
            )


# The dtypes every site may have without a look (`_check_dtype` passes them).
_CHECKED_DTYPES = frozenset(
    np.dtype(t) for t in (*COMPUTE_DTYPES, "int8", "int16", "int32", "int64", "bool")
)
_CHECKED = {type(d) for d in _CHECKED_DTYPES}


def _check_dtype(where: str, dtype: object) -> None:
    """Numeric sites only; floating ones in a precision the sweep computes in."""
    try:
        resolved = np.dtype(dtype)  # type: ignore[call-overload]
        name = resolved.name
    except TypeError:
        resolved, name = None, str(dtype)  # a dtype NumPy lacks, e.g. torch's bfloat16
    if resolved is not None and resolved.kind not in "biufc":
        raise TypeError(
            f"{where} has dtype {dtype}; pass numeric arrays (float32/64 or complex64/128)."
        )
    if resolved is None or (resolved.kind in "fc" and name not in COMPUTE_DTYPES):
        raise TypeError(
            f"{where} has dtype {name}, which the sweep does not compute in (it runs in "
            "float32, float64, complex64 or complex128); convert the sites first, e.g. "
            "[t.astype(np.float32) for t in train]."
        )


def _check_roles(fn: str, names: Sequence[str], kinds: Sequence[Kind]) -> None:
    """An MPS may stand only first or last, and not at both ends."""
    if len(kinds) < 2:
        return
    for i in range(1, len(kinds) - 1):
        if kinds[i] == "mps":
            raise TypeError(
                f"{_where(fn, names, i)} is an MPS in the middle of the stack {list(kinds)}; "
                "an MPS may stand only first (a row vector) or last (a ket)."
            )
    if kinds[0] == kinds[-1] == "mps":
        raise TypeError(
            f"{fn}: the stack {list(kinds)} has an MPS at both ends, which is a number, not "
            "a train; contract it with quimb, or drop one MPS to get a train."
        )


def _physical(train: Sequence[Any], kind: Kind, j: int, leg: str) -> int:
    """The ``u`` or ``d`` dimension of site ``j`` (an MPS has one leg, both ways)."""
    shape = _shape(train[j])
    if kind == "mps":
        return shape[-1]
    return shape[-2] if leg == "u" else shape[-1]


def _check_joins(
    fn: str, names: Sequence[str], trains: Sequence[Sequence[Any]], kinds: Sequence[Kind]
) -> None:
    """Train ``i``'s ``d`` leg meets train ``i+1``'s ``u`` leg at every site."""
    for i in range(len(trains) - 1):
        for j in range(len(trains[i])):
            down = _physical(trains[i], kinds[i], j, "d")
            up = _physical(trains[i + 1], kinds[i + 1], j, "u")
            if down != up:
                raise ValueError(
                    f"{_where(fn, names, i, j)}: its lower leg d={down} does not join "
                    f"{names[i + 1]} (train {i + 1}) upper leg u={up} at site {j}; the "
                    "stack is written in mathematical order, each train's d meeting the "
                    "next train's u."
                )


def normalize_stack(trains: Sequence[object], fn: str, names: Sequence[str]) -> Stack:
    """Validate a stack and return it in ket form.

    Parameters
    ----------
    trains : sequence
        The trains in mathematical order.
    fn : str
        The public function called, for messages.
    names : sequence of str
        The argument name of each train, for messages.

    Returns
    -------
    Stack
        The layers in ket form, the result's kind and the inputs' dtype.

    Raises
    ------
    TypeError
        A train or site of the wrong type, an unknown layout, or a misplaced MPS.
    ValueError
        An empty stack or train, a closed boundary, disagreeing bonds, trains of
        different lengths, physical legs that do not join, or a one-site stack.
    """
    if len(trains) == 0:
        raise ValueError(
            f"{fn}: the stack is empty; pass at least one train, e.g. {fn}(mpo, mps, chi_out=32)."
        )
    kinds = [_check_train(fn, names, i, train) for i, train in enumerate(trains)]
    _check_roles(fn, names, kinds)
    lengths = [len(train) for train in trains]  # type: ignore[arg-type]
    for i, n in enumerate(lengths):
        if n != lengths[0]:
            raise ValueError(
                f"{_where(fn, names, i)} has {n} sites but {names[0]} (train 0) has "
                f"{lengths[0]}; every train of a stack must have the same number of sites."
            )
    typed: list[Sequence[Any]] = list(trains)  # type: ignore[arg-type]
    _check_joins(fn, names, typed, kinds)
    if lengths[0] < 2:
        raise ValueError(
            f"{fn}: the trains have one site; a train needs at least two sites (three or "
            "more for the randomized sweep). Contract a single site directly."
        )
    dtype = np.result_type(*(np.dtype(site.dtype) for train in typed for site in train))
    if len(typed) > 1 and kinds[0] == "mps":
        # phi^T A_1 ... A_k  ==  (A_k^T ... A_1^T phi)^T, and an MPS is its own transpose.
        layers = [
            Layer(t, "mpo", transposed=True, where=_label(fn, names, i))
            for i, t in reversed(list(enumerate(typed))[1:])
        ]
        return Stack([*layers, Layer(typed[0], "mps", where=_label(fn, names, 0))], "mps", dtype)
    layers = [
        Layer(t, k, where=_label(fn, names, i))
        for i, (t, k) in enumerate(zip(typed, kinds, strict=True))
    ]
    return Stack(layers, "mps" if "mps" in kinds else "mpo", dtype)


def unpad(cores: Sequence[np.ndarray], kind: Kind) -> list[np.ndarray]:
    """Return padded ``(l, r, u, d)`` cores in quimb's layout for ``kind``."""
    return [unpad_core(core, j, len(cores), kind) for j, core in enumerate(cores)]


def unpad_core(core: np.ndarray, j: int, n_sites: int, kind: Kind) -> np.ndarray:
    """Padded core ``j`` of ``n_sites`` in quimb's layout for ``kind``, C-contiguous."""
    view = core[..., 0] if kind == "mps" else core
    if j == n_sites - 1:
        view = view[:, 0]
    if j == 0:
        view = view[0]
    return np.ascontiguousarray(view)
