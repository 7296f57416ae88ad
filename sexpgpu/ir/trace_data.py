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

import zipfile

import numpy as np

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang import DataDef

__all__ = ["DIGITS_PIXELS", "field_specs"]

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
    out = {}
    try:
        with zipfile.ZipFile(data.path) as archive:
            for member in archive.namelist():
                if not member.endswith(".npy"):
                    continue
                with archive.open(member) as handle:
                    version = np.lib.format.read_magic(handle)
                    read = _HEADER_READERS.get(version, np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read(handle)
                out[member[: -len(".npy")]] = (tuple(shape), np.dtype(dtype))
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        raise SexpgpuError(
            "E-DATA-001",
            f"data `{data.name}`: cannot read {data.path}: {err}",
            data.span,
            "check the path (relative to the experiment file) and that it is an .npz file",
        ) from None
    return out
