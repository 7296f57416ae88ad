"""`Stream`: the order a backend's work runs in, and the numbers each step hands it.

Apart from the arrays (`sexpgpu.devices.arrays`): what the update needs of
a device beyond its arithmetic. The step's numbers go in as scalars the
device holds (`scalars`), the whole update may be captured and replayed
(`replayed`), and numbers come back to the host without waiting for what is
queued after them (`read_later`). On the host (`HostStream`) each call
simply runs; the cuda device's is `sexpgpu.devices.cuda.stream.TorchStream`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["HostStream", "Stream"]


class Stream(Protocol):
    """Where a backend's work is queued (see the module docstring).

    `events` collects lines for the run's annotations (a captured update, say).
    """

    events: list[str]
    # Whether its calls only queue work (a GPU's stream) rather than compute it
    # before they return: then a run reads each step's numbers a step later.
    asynchronous: bool

    def scalars(self, name: str, **values: float) -> dict[str, Any]:
        """`values` as the update reads them: host numbers, or device scalars.

        A backend that replays the update keeps one device scalar per
        ``name`` and key and refills it here, outside the replayed part.
        """
        ...

    def replayed(
        self, key: tuple[Any, ...], arrays: Sequence[Any], queue: Callable[[], Any]
    ) -> Any:
        """``queue()``, a function that only queues work on the device, and its result.

        `key` holds the host values `queue` builds into its work and `arrays`
        every array it reads or writes beyond `scalars`; a backend may capture
        `queue` once both come twice in a row (the arrays at the same
        addresses) and replay it from then on.
        """
        ...

    def forget(self) -> None:
        """Drop a captured `queue`: something it reads (a launch table) is gone."""
        ...

    def read_later(self, x: Any) -> Any:
        """`x` (a number or a device scalar) on its way to the host, behind what is queued now.

        ``float()`` of the result waits only for the work queued before this
        call, not for what the caller queues after it (the next step).
        """
        ...


class HostStream:
    """A `Stream` whose calls run as they are made: numbers stay host numbers."""

    def __init__(self) -> None:
        self.events: list[str] = []  # nothing to say: the update runs as written
        self.asynchronous = False

    def scalars(self, name: str, **values: float) -> dict[str, Any]:
        return values

    def replayed(
        self, key: tuple[Any, ...], arrays: Sequence[Any], queue: Callable[[], Any]
    ) -> Any:
        return queue()

    def forget(self) -> None:
        pass  # nothing captured

    def read_later(self, x: Any) -> Any:
        return x  # already on the host
