"""State files (the orphan registry, the shared pace, images beside an episode log) written and read safely in a
folder someone else may have written to: a new file is created under an unguessable temporary name (`O_EXCL |
O_NOFOLLOW`) and moved into place; an existing one is opened `O_NOFOLLOW | O_NONBLOCK` and refused unless regular."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

__all__ = ["NotRegularFile", "create_temp", "is_regular", "open_regular", "write_atomic"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class NotRegularFile(OSError):
    """A state file's name holds something else: a symlink, a FIFO, a folder, a device."""


def create_temp(folder: Path, name: str, mode: int = 0o600) -> tuple[int, Path]:
    """A new, empty file `.<name>.<random>.tmp` in `folder`, open for reading and writing."""
    for _ in range(8):
        path = folder / f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | os.O_CLOEXEC, mode), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(folder))


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `path` whole: a temporary file beside it, then `os.replace` (a reader sees the old file or the new)."""
    fd, tmp = create_temp(path.parent, path.name, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def open_regular(path: Path, flags: int, mode: int = 0o600) -> int:
    """`os.open(path, flags)` of a regular file (never a symlink or FIFO: a `NotRegularFile`, an `OSError`)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENXIO and is_regular(path, stat.S_ISFIFO)):
            raise NotRegularFile(exc.errno, "not a regular file (a symlink or a FIFO)", str(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_regular(path: Path, kind: Callable[[int], bool] = stat.S_ISREG) -> bool:
    """Whether `path` itself (not what a symlink there points to) is a regular file (or of another `stat.S_IS*`)."""
    with contextlib.suppress(OSError):
        return kind(os.lstat(path).st_mode)
    return False
