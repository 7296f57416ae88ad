"""Files written whole or not at all, whatever other processes and threads do.

A reader of `path` sees the old contents or the new, never half: the data
goes into a temporary file of this process's and thread's own beside it
(so writers at once never share one), which is then renamed over `path`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

__all__ = ["remove_stale_partials", "replace_whole"]


def replace_whole(path: Path, data: bytes | str, *, sync: bool = False) -> None:
    """Write `data` (text as UTF-8) to `path` in one rename; `sync` flushes it to disk first.

    Makes the folder if needed. Raises OSError, with no temporary file left,
    where the write fails.
    """
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}{_PARTIAL}")
    body = data.encode("utf-8") if isinstance(data, str) else data
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as f:
            f.write(body)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise


_PARTIAL = ".tmp"


def remove_stale_partials(folder: Path) -> int:
    """Remove the temporary files in `folder` of writers that no longer run; how many went.

    A process killed in the middle of `replace_whole` leaves its partial file
    behind; one whose process still runs may yet be renamed into place, and
    stays.
    """
    removed = 0
    for partial in Path(folder).glob(f".*{_PARTIAL}"):
        parts = partial.name[: -len(_PARTIAL)].rsplit(".", 2)
        if len(parts) != 3 or not parts[1].isdigit() or _running(int(parts[1])):
            continue
        with contextlib.suppress(OSError):
            partial.unlink()
            removed += 1
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: running
        return True
    return True
