"""The shape and dtype of each data field one microbatch holds.

===============================  ======================================
source                           fields
===============================  ======================================
bytes, tokens, python-stdlib     ``tokens``, ``next``: ``[batch seq]`` int32
digits                           ``x``: ``[batch 64]`` f32, ``y``: ``[batch]`` int32
arrays                           each field: ``[batch ...]`` from the .npz
                                 file (floats as f32, integers as int32)
===============================  ======================================

For ``arrays`` only the headers of the ``.npy`` members are read, never
the data.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang import DataDef
from sexpgpu.lang.paths import file_problem

__all__ = ["DIGITS_PIXELS", "NpyMember", "field_specs", "npz_members", "read_npy_header"]

DIGITS_PIXELS = 64
FieldSpecs = dict[str, tuple[tuple[int, ...], str]]
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0}


def field_specs(data: DataDef, batch: int) -> FieldSpecs:
    """Field name -> (per-microbatch shape, dtype) for data set `data`.

    Parameters
    ----------
    data
        The data set's definition.
    batch
        The rows of one microbatch (the run's ``:batch``).

    Raises
    ------
    SexpgpuError
        E-DATA-001 when an ``arrays`` file cannot be read, E-DATA-004 when a
        field is not in it.
    """
    if data.kind in ("bytes", "tokens", "python-stdlib"):
        seq = int(data.options["seq"])
        return {name: ((batch, seq), "int32") for name in data.fields}
    if data.kind == "digits":
        return {"x": ((batch, DIGITS_PIXELS), "f32"), "y": ((batch,), "int32")}
    assert data.kind == "arrays", data.kind
    headers = _npz_headers(data)
    specs: FieldSpecs = {}
    for name in data.fields:
        if name not in headers:
            raise SexpgpuError(
                "E-DATA-004",
                f"data `{data.name}`: field `{name}` is not in {data.path}",
                data.span,
                f"arrays in the file: {', '.join(sorted(headers)) or 'none'}",
            )
        shape, dtype = headers[name]
        kind = "f32" if dtype.kind == "f" else "int32" if dtype.kind in "iub" else None
        if kind is None or not shape:
            raise SexpgpuError(
                "E-DATA-003",
                f"data `{data.name}`: field `{name}` is {dtype} {list(shape)}; "
                "fields are arrays of numbers with the sample on the first axis",
                data.span,
                "store floats or integers with one row per sample",
            )
        specs[name] = ((batch, *shape[1:]), kind)
    return specs


def _npz_headers(data: DataDef) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Member name -> (shape, dtype), read from the .npy headers inside the .npz."""
    members = npz_members(data.path, data.name, data.span)
    return {name: (m.shape, m.dtype) for name, m in members.items()}


@dataclass(frozen=True)
class NpyMember:
    """One ``.npy`` array inside an ``.npz`` file, as its header describes it."""

    member: str  # the zip member's name
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    nbytes: int  # what the header promises


def npz_members(path: Any, name: str, where: Any) -> dict[str, NpyMember]:
    """Array name -> `NpyMember` of the ``.npz`` at `path`, reading only headers.

    Each header is checked against the zip directory: an array whose header
    promises more (or fewer) bytes than its member holds is refused, so that
    a reader never allocates what a lying header claims. Only a regular file
    is opened (a FIFO would block, ``/dev/zero`` never ends).

    Raises
    ------
    SexpgpuError
        E-DATA-001 when the file is not there, not a regular file or not a
        readable ``.npz``; E-DATA-003 when a header disagrees with its data.
    """
    problem = file_problem(path)
    if problem is not None:
        raise SexpgpuError("E-DATA-001", f"data `{name}`: {path} {problem[0]}", where, problem[1])
    out = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.filename.endswith(".npy"):
                    member = _member(archive, info, path, name, where)
                    out[info.filename[: -len(".npy")]] = member
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error, ValueError) as err:
        raise SexpgpuError(
            "E-DATA-001",
            f"data `{name}`: cannot read {path}: {err}",
            where,
            "check the path (relative to the experiment file) and that it is an .npz file",
        ) from None
    return out


def read_npy_header(handle: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) from the ``.npy`` header at `handle`, left past it."""
    version = np.lib.format.read_magic(handle)
    read = _HEADER_READERS.get(version, np.lib.format.read_array_header_2_0)
    return read(handle)


def _member(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Any, name: str, where: Any
) -> NpyMember:
    with archive.open(info) as handle:
        shape, fortran, dtype = read_npy_header(handle)
        header = handle.tell()
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if dtype.hasobject:
        raise SexpgpuError(
            "E-DATA-003",
            f"data `{name}`: array `{info.filename}` of {path} holds Python objects",
            where,
            "store numeric arrays (floats or integers)",
        )
    if header + nbytes != info.file_size:
        holds = info.file_size - header
        raise SexpgpuError(
            "E-DATA-003",
            f"data `{name}`: array `{info.filename}` of {path} claims {list(shape)} {dtype} "
            f"({nbytes} bytes) but holds {holds} bytes of data",
            where,
            "the file is damaged or was not written by numpy.savez; write it again",
        )
    return NpyMember(info.filename, tuple(shape), dtype, bool(fortran), nbytes)
