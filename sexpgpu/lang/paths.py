"""What stands at a path an experiment names: a regular file, or what else.

Data files are opened only when they are regular files: a FIFO blocks a
reader forever and a device such as ``/dev/zero`` never ends, so both are
named as such instead of being read. Nothing here opens a file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["file_problem", "is_regular_file"]

_KINDS = (
    (stat.S_ISDIR, "is a folder", "name a data file inside it"),
    (stat.S_ISFIFO, "is a FIFO (named pipe), not a regular file", "copy the data into a file"),
    (stat.S_ISCHR, "is a device, not a regular file", "copy the data into a file"),
    (stat.S_ISBLK, "is a device, not a regular file", "copy the data into a file"),
    (stat.S_ISSOCK, "is a socket, not a regular file", "copy the data into a file"),
)


def file_problem(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """None when `path` is a regular file (after symlinks), else (what it is, a hint).

    The first part completes a sentence that starts with the path: ``does not
    exist``, ``is a FIFO (named pipe), not a regular file``, ``has a name
    longer than the system allows``.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            return "does not exist", "paths are relative to the experiment file; check the name"
        if err.errno == errno.ENAMETOOLONG:
            return "has a name longer than the system allows", "use a shorter path"
        if err.errno == errno.ELOOP:
            return "is a loop of symbolic links", "point the path at the data file itself"
        return f"cannot be examined ({err.strerror})", "check the path and its permissions"
    except ValueError:  # an embedded NUL character
        return "is not a valid path", "remove the odd characters from the path"
    if stat.S_ISREG(mode):
        return None
    for test, what, hint in _KINDS:
        if test(mode):
            return what, hint
    return "is not a regular file", "copy the data into a file"


def is_regular_file(path: str | os.PathLike[str] | Path) -> bool:
    """Whether `path` is a regular file (never raises)."""
    return file_problem(path) is None
