"""Amounts of memory: parse ``40GiB``/``40GB``/``512MiB``/bytes, and print them."""

from __future__ import annotations

import re

__all__ = ["GiB", "MiB", "format_bytes", "parse_bytes"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3

# Binary units are powers of 1024, decimal ones powers of 1000, as in the IEC
# standard. A bare "G" is refused: it is ambiguous between the two.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}

_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """The number of bytes that `text` names, such as ``"40GiB"`` or ``"512MiB"``.

    Parameters
    ----------
    text
        A number with an optional unit: B, KiB, MiB, GiB, TiB (powers of 1024)
        or KB, MB, GB, TB (powers of 1000); case does not matter; no unit
        means bytes. Fractions are allowed (``"1.5GiB"``).

    Returns
    -------
    int
        The amount in bytes, rounded down; at least 1.

    Raises
    ------
    ValueError
        When the text is not such an amount or names zero bytes.
    """
    match = _AMOUNT.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not an amount of memory")
    amount = int(float(match.group(1)) * _UNITS[unit])
    if amount < 1:
        raise ValueError(f"{text!r} is no memory at all")
    return amount


def format_bytes(n: int | float, unit: str | None = None) -> str:
    """`n` bytes as ``"12.3 GiB"``: in `unit` (B, KiB, MiB or GiB) if given, else in the
    largest binary unit that keeps the number at 1 or more."""
    if unit is None:
        unit = "B"
        for larger in ("KiB", "MiB", "GiB"):
            if abs(n) >= _UNITS[larger.lower()]:
                unit = larger
    if unit == "B":
        return f"{int(n)} B"
    return f"{n / _UNITS[unit.lower()]:.1f} {unit}"
