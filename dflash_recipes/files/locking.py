"""One writer per output directory: an OS-level lock held for the whole of a run.

`run`, `capture` and `regenerate` write into a directory they own for hours. Two of them on the
same directory would overwrite each other's files, so each takes an exclusive `flock` on a lock
file inside it for as long as it writes. The lock belongs to the open file description: the
kernel drops it when the process exits in any way (a crash, `kill -9`, a lost node), so a stale
lock can never block the next run. The lock file also records who holds it (pid, host, start
time, command) so that the refused run can say whom it waited for.

Pure standard library (no torch): the compile path may import it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from dflash_recipes.errors import DirectoryLockedError

#: Name of the lock file inside a locked directory (hidden: never a checkpoint or an export).
LOCK_FILE = ".dflash-lock"

#: At most this much of a lock file is read back to describe its holder.
_MAX_HOLDER_BYTES = 4096


def _holder_record(purpose: str) -> str:
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "purpose": purpose,
        "command": " ".join(sys.argv)[:400],
    }
    return json.dumps(record, sort_keys=True) + "\n"


def describe_holder(lock_path: Path) -> str:
    """A one-line description of whoever wrote `lock_path` (best effort, never raises)."""
    try:
        with lock_path.open("rb") as handle:
            raw = handle.read(_MAX_HOLDER_BYTES)
        record = json.loads(raw.decode("utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError):
        return "a process whose details could not be read"
    if not isinstance(record, dict):
        return "a process whose details could not be read"
    pid = record.get("pid", "?")
    host = record.get("host", "?")
    started = record.get("started", "?")
    purpose = record.get("purpose", "?")
    return f"{purpose} (pid {pid} on host {host}, started {started})"


@contextlib.contextmanager
def hold_directory_lock(
    directory: Path, *, purpose: str, lock_name: str = LOCK_FILE, wait_s: float = 0.0
) -> Iterator[Path]:
    """Hold the exclusive lock of `directory` (created if missing) for the `with` body.

    `purpose` names the holder in the message a refused process prints ("run", "capture",
    "regenerate"). Raises :class:`DirectoryLockedError` when another process holds the lock
    (at once, or after waiting up to `wait_s` seconds for it); the message names that process
    and the fix. `lock_name` is the lock file's name in `directory` (one directory can hold
    locks for different purposes). Yields the lock file.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lock_path = directory / lock_name
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(lock_path, flags, 0o644)
    try:
        if not _lock_within(fd, wait_s):
            holder = describe_holder(lock_path)
            msg = (
                f"{directory} is in use by another {holder}; wait for it to finish (or stop "
                f"it), or choose another directory: two writers would overwrite each other's "
                f"files"
            )
            raise DirectoryLockedError(msg)
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_record(purpose).encode("utf-8"), 0)
        yield lock_path
    finally:
        # Closing the descriptor releases the flock; the file stays (removing it would race
        # with a process that has just opened it and is about to lock it).
        os.close(fd)


#: The longest pause between two tries of a held lock: how late a waiting process (another
#: rank waiting for the data cache) can notice that the holder is done. A try is one
#: non-blocking flock call, so ten a second cost nothing.
_MAX_PAUSE_S = 0.1


def _lock_within(fd: int, wait_s: float) -> bool:
    """Take the flock of `fd`, retrying for up to `wait_s` seconds; False if still held."""
    deadline = time.monotonic() + wait_s
    pause = 0.05
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, _MAX_PAUSE_S)


__all__ = ["LOCK_FILE", "describe_holder", "hold_directory_lock"]
