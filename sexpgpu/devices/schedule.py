"""A graph's schedule as both devices plan it: when each value dies, and the live set's peak.

The schedule is the graph's topological order. A value dies after its last
use; outputs outlive the run. Buffers may be shared (views, in-place
results): `simulate_peak` adds a buffer when its first value appears and
drops it after the last use of any value stored in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from sexpgpu.ir.node import Node

__all__ = ["free_lists", "last_uses", "simulate_peak"]


def last_uses(
    order: Sequence[Node],
    outputs: Iterable[int],
    inputs: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Per position: where its value is last used (``-1`` never, ``len(order)`` an output).

    `inputs` are the positions each step reads, where they are not its node's operands.
    """
    if inputs is None:
        pos = {id(node): i for i, node in enumerate(order)}
        inputs = [[pos[id(x)] for x in node.inputs] for node in order]
    last = [-1] * len(order)
    for i, reads in enumerate(inputs):
        for k in reads:
            last[k] = i
    for i in outputs:
        last[i] = len(order)  # outputs outlive the run
    return last


def free_lists(last: Sequence[int]) -> list[tuple[int, ...]]:
    """Per schedule position: the positions whose values die right after it."""
    n = len(last)
    frees: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        if 0 <= last[i] < n:
            frees[last[i]].append(i)
        elif last[i] == -1:
            frees[i].append(i)  # an unused fed leaf
    return [tuple(f) for f in frees]


def simulate_peak(
    order: Sequence[Node],
    storage: Sequence[int],
    nbytes: Sequence[int],
    buffer_last: Sequence[int],
    *,
    base: int = 0,
    change: Mapping[int, int] | None = None,
    transient: Sequence[int] | None = None,
) -> tuple[int, Node | None]:
    """The most bytes live at once over the schedule, and the node where it is reached.

    Parameters
    ----------
    order
        The schedule.
    storage
        Per position: the buffer (a position) its value lives in.
    nbytes
        Per buffer: its size (0 where no buffer starts).
    buffer_last
        Per buffer: the last use of any value stored in it.
    base
        Bytes held for the whole run (constants made once).
    change
        Position -> bytes added from that step on (negative: released).
    transient
        Per position: bytes its op holds only while it runs.
    """
    n = len(order)
    dying: list[list[int]] = [[] for _ in range(n)]
    for s in set(storage):
        if buffer_last[s] < n:
            dying[max(buffer_last[s], s)].append(s)
    live = peak = base
    at = None
    for i in range(n):
        live += (change or {}).get(i, 0)
        if storage[i] == i:
            live += nbytes[i]
        held = live + (transient[i] if transient is not None else 0)
        if held > peak:
            peak, at = held, order[i]
        for s in dying[i]:
            live -= nbytes[s]
    return peak, at
