"""Writing a file so that readers see the old content or the whole new one, never a part.

Two writers live here. :func:`write_text_atomic` is for files the tool owns (a run's
``plan.json``): temporary sibling, then rename. :func:`write_output` is for a path the user
named with ``-o``, which may not be a regular file at all:

- a regular file (or a new name): atomic, as above;
- a symlink: the link stays a link; its resolved target gets the new content, atomically;
- ``/dev/null``, another character or block device, a FIFO or a socket: written through
  (opened and written), as a shell redirection would, never replaced by a regular file;
- a directory: ``IsADirectoryError``, nothing written.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def temporary_sibling(path: Path) -> Path:
    """A hidden name next to `path`, unique to this process, to write into before renaming."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _replace_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to path through a temporary sibling, so a failure leaves no partial file.

    Raises OSError (the folder cannot be created, or is not writable) with nothing left behind.
    """
    _replace_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Like :func:`write_text_atomic`, for bytes."""
    _replace_atomic(path, data)


def write_output(path: Path, data: bytes | str) -> Path:
    """Write `data` (str: UTF-8) to a user-named output path; returns the file written.

    Regular files are replaced atomically; a symlink is followed (the link is kept, its
    target replaced atomically); special files (devices, FIFOs, sockets) are written through.
    Raises OSError (``IsADirectoryError`` for a directory) with no partial file left behind.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    path = Path(path)
    target = path.resolve() if path.is_symlink() else path
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if mode is not None and not stat.S_ISREG(mode):
        # Opened as it is (no O_CREAT, no O_TRUNC): the node stays what it was.
        fd = os.open(target, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        return target
    _replace_atomic(target, payload)
    return target


__all__ = ["temporary_sibling", "write_bytes_atomic", "write_output", "write_text_atomic"]
