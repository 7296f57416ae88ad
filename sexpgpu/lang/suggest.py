"""Hints that name the valid options and the nearest one ("did you mean")."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["options_hint"]

_SHOWN = 20


def options_hint(name: str, options: Iterable[str], kind: str, prefix: str = "") -> str:
    """A hint naming the closest of `options` to `name`, then all of them.

    Parameters
    ----------
    name
        What the user wrote.
    options
        The valid names.
    kind
        What the options are, plural ("parameters", "keys").
    prefix
        Written before each option (``":"`` for keys).

    Returns
    -------
    str
        For example ``"did you mean `width`? parameters: heads, width"``.
    """
    choices = sorted(set(options))
    if not choices:
        return f"no {kind} are defined"
    shown = ", ".join(prefix + c for c in choices[:_SHOWN])
    if len(choices) > _SHOWN:
        shown += f", ... ({len(choices)} in all)"
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    lead = f"did you mean `{prefix}{close[0]}`? " if close else ""
    return f"{lead}{kind}: {shown}"
