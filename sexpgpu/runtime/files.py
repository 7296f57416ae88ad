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

__all__ = ["replace_whole"]


def replace_whole(path: Path, data: bytes | str, *, sync: bool = False) -> None:
    """Write `data` (text as UTF-8) to `path` in one rename; `sync` flushes it to disk first.

    Makes the folder if needed. Raises OSError, with no temporary file left,
    where the write fails.
    """
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
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
